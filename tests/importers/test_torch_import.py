"""A model exported from PyTorch: its import equals the module's output (skipped without torch)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")

from executor import verify  # noqa: E402
from executor.run import execute, random_inputs  # noqa: E402
from ir.importers.torch_export import import_torch  # noqa: E402
from ir.rewrites import random_walk  # noqa: E402


class Block(torch.nn.Module):
    """Pre-norm MLP block with exact GELU, a SiLU gate and a residual."""

    def __init__(self, d: int = 16, h: int = 32) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, h)
        self.gate = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d)

    def forward(self, x):
        z = self.ln(x)
        return x + self.down(torch.nn.functional.gelu(self.up(z)) * torch.nn.functional.silu(self.gate(z)))


def test_torch_module_import_equals_module():
    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(6, 16)
    g, values = import_torch(m, {"x": x})
    assert {"up.weight", "ln.weight"} <= set(values)  # state_dict names survive
    ins = random_inputs(g, 0)
    ins.update(values)
    ins["x"] = x.numpy()
    out = execute(g, ins)
    with torch.no_grad():
        ref = m(x).numpy()
    np.testing.assert_allclose(out["output"], ref, rtol=1e-5, atol=1e-5)
    kernels = {o.kernel for o in g.ops.values()}
    assert "gelu_erf" in kernels and "layernorm" in kernels
    rep = verify(random_walk(g, np.random.default_rng(0), 4, 20), values=values)
    assert rep.ok, rep


def test_torch_factory_cli(tmp_path, capsys):
    from optimizer.cli import main

    src = tmp_path / "model.py"
    src.write_text("import torch\n\ndef make_model():\n    torch.manual_seed(0)\n"
                   "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))\n")
    with pytest.raises(SystemExit) as e:
        main(["import", f"{src}:make_model", "--example-input", "x:float32[4,8]", "-o", str(tmp_path / "p.json")])
    assert e.value.code in (0, None)
    assert (tmp_path / "p.npz").exists()
    with pytest.raises(SystemExit) as e:
        main(["import", f"{src}:nope", "--example-input", "x:float32[4,8]", "-o", str(tmp_path / "q.json")])
    assert e.value.code == 2 and "no function 'nope'" in capsys.readouterr().err
