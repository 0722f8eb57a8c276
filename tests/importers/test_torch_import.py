"""A model exported from PyTorch: its import equals the module's output (skipped without torch)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")

from executor import verify  # noqa: E402
from executor.run import execute, random_inputs  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.importers.torch_export import import_torch  # noqa: E402
from ir.rewrites import random_walk  # noqa: E402
from optimizer.cli import main  # noqa: E402


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


class NanoGPTBlock(torch.nn.Module):
    """nanoGPT's block: fused QKV split, heads by view/transpose, a registered tril buffer applied
    with masked_fill, exact GELU; exported with symbolic batch and sequence length."""

    def __init__(self, d: int = 32, h: int = 4, max_seq: int = 64) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.register_buffer("bias", torch.tril(torch.ones(max_seq, max_seq)).view(1, 1, max_seq, max_seq))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
        att = torch.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


def test_nanogpt_block_with_symbolic_dims():
    torch.manual_seed(0)
    m = NanoGPTBlock().eval()
    axes = {"x": {0: "batch", 1: "seq"}}
    for batch, seq in ((2, 16), (3, 40)):
        g, values = import_torch(m, {"x": torch.randn(2, 16, 32)}, {"batch": batch, "seq": seq}, dynamic_axes=axes)
        kernels = sorted({o.kernel for o in g.ops.values()})
        assert "causal_mask" in kernels and "where" not in kernels and "gelu_erf" in kernels
        x = torch.randn(batch, seq, 32)
        ins = random_inputs(g, 0)
        ins.update(values)
        ins["x"] = x.numpy()
        with torch.no_grad():
            np.testing.assert_allclose(execute(g, ins)["output"], m(x).numpy(), rtol=1e-5, atol=2e-6)


class TorchRMSNorm(torch.nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LlamaBlock(torch.nn.Module):
    """Embedding, RMSNorm written as torch ops, bias-free projections, an additive triu(-inf)
    mask, SwiGLU with F.silu."""

    def __init__(self, vocab: int = 50, d: int = 32, h: int = 4, ff: int = 48) -> None:
        super().__init__()
        self.h = h
        self.emb = torch.nn.Embedding(vocab, d)
        self.n1, self.n2 = TorchRMSNorm(d), TorchRMSNorm(d)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(d, ff, bias=False), torch.nn.Linear(d, ff, bias=False)
        self.down = torch.nn.Linear(ff, d, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        B, T, C = x.shape
        h = self.n1(x)
        q, k, v = (lin(h).view(B, T, self.h, C // self.h).transpose(1, 2) for lin in (self.q, self.k, self.v))
        mask = torch.full((T, T), float("-inf")).triu(1)
        att = torch.softmax(q @ k.transpose(-2, -1) / (C // self.h) ** 0.5 + mask, dim=-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(B, T, C))
        h = self.n2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def test_llama_block_from_torch_maps_patterns():
    torch.manual_seed(0)
    m = LlamaBlock().eval()
    ids = torch.randint(0, 50, (2, 12))
    g, values = import_torch(m, {"ids": ids})
    kernels = [o.kernel for o in g.ops.values()]
    assert kernels.count("rmsnorm") == 2 and "silu" in kernels and "causal_mask" in kernels
    assert "embedding" in kernels and "sigmoid" not in kernels and "sqrt" not in kernels
    ins = random_inputs(g, 0)
    ins.update(values)
    ins["ids"] = ids.numpy().astype(np.int32)
    with torch.no_grad():
        np.testing.assert_allclose(execute(g, ins)["output"], m(ids).numpy(), rtol=1e-5, atol=2e-6)
    assert verify(random_walk(g, np.random.default_rng(1), 4, 25), values=values).ok
    # weights the exporter folded as weight.T are named after their state_dict entries, and train
    np.testing.assert_array_equal(values["q.weight.T"], m.q.weight.detach().numpy().T)
    step = training_step(g, loss="mse", optimizer="sgd")
    assert "q.weight.T.next" in step.tensors


class ResNetStem(torch.nn.Module):
    """Conv/BN/ReLU, the 3x3 stride-2 padded max pool, one basic residual block, global average
    pool, flatten, linear: the ops of a torchvision ResNet."""

    def __init__(self, c: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c)
        self.pool = torch.nn.MaxPool2d(3, stride=2, padding=1)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c)
        self.fc = torch.nn.Linear(c, classes)

    def forward(self, x):
        h = self.pool(torch.relu(self.bn1(self.conv1(x))))
        h = torch.relu(h + self.bn2(self.conv2(h)))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(h, 1), 1))


def test_resnet_stem_from_torch():
    torch.manual_seed(0)
    m = ResNetStem()
    for bn in (m.bn1, m.bn2):  # non-trivial running statistics
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 1.5)
    m = m.eval()
    x = torch.randn(2, 3, 12, 12)
    g, values = import_torch(m, {"x": x})
    kernels = {o.kernel for o in g.ops.values()}
    assert {"conv2d", "maxpool2d", "avgpool2d"} <= kernels
    ins = random_inputs(g, 0)
    ins.update(values)
    ins["x"] = x.numpy()
    with torch.no_grad():
        np.testing.assert_allclose(execute(g, ins)["output"], m(x).numpy(), rtol=1e-4, atol=1e-5)
    assert verify(random_walk(g, np.random.default_rng(2), 4, 25), values=values).ok


class DownsampleBlock(torch.nn.Module):
    """A torchvision ``BasicBlock`` that halves the plane (3x3 stride-2 conv, 3x3 conv, 1x1
    stride-2 shortcut), after a stem conv so that its input needs a gradient; without batch norm,
    which the exporter folds into the conv weights in eval mode (their names would be lost)."""

    def __init__(self, c: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.conv1 = torch.nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False)
        self.conv2 = torch.nn.Conv2d(2 * c, 2 * c, 3, padding=1, bias=False)
        self.down = torch.nn.Conv2d(c, 2 * c, 1, stride=2, bias=False)
        self.fc = torch.nn.Linear(2 * c, classes)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        h = torch.relu(self.conv2(torch.relu(self.conv1(h))) + self.down(h))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(h, 1), 1))


def test_strided_block_gradients_equal_torch_autograd():
    """The imported training step's weight gradients (through the inputs of the stride-2 3x3
    conv and the 1x1 downsample) equal PyTorch's autograd of the same MSE loss, on an odd plane
    (9 rows: the transposed convs write 10 and are cropped)."""
    torch.manual_seed(0)
    m = DownsampleBlock().eval()
    x, target = torch.randn(2, 3, 9, 9), torch.randn(2, 3)
    g, values = import_torch(m, {"x": x})
    step = training_step(g, loss="mse", optimizer="sgd")
    assert sum(o.kernel == "conv2d_input_grad" and o.params.get("stride") == 2 for o in step.ops.values()) == 2
    env = execute(step, {**values, "x": x.numpy(), "target": target.numpy()}, precision="float64")
    torch.nn.functional.mse_loss(m(x), target).backward()
    for name, p in m.named_parameters():
        np.testing.assert_allclose(env[f"{name}.grad"], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
