"""PyTorch models at the importer's edges: weights used twice, masks that broadcast, nested and
half-precision results, and the errors a user's mistakes get (skipped without torch).

Each import is checked against the module itself (forward) or its autograd (training step)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper  # noqa: E402

from executor.run import execute  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.importers.errors import ImportFailure  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.importers.torch_export import import_torch  # noqa: E402
from optimizer.cli import main  # noqa: E402


def _forward(m, inputs: dict, **kw):
    """(imported outputs by name, torch's outputs flattened, graph)."""
    g, values = import_torch(m, inputs, **kw)
    feed = {k: (v.numpy().astype(np.int32) if not v.is_floating_point() else v.float().numpy())
            for k, v in inputs.items()}
    env = execute(g, {**values, **feed})
    outs = [n for n, t in g.tensors.items() if t.role == "output"]
    return {n: np.asarray(env[n], dtype=np.float64) for n in outs}, g, values


class Tied(torch.nn.Module):
    """GPT's tied input and output embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.e = torch.nn.Embedding(10, 16)

    def forward(self, ids):
        return self.e(ids) @ self.e.weight.t()


class Shared(torch.nn.Module):
    """One Linear applied twice to a 3-D input (the exporter folds its W.T once per use)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.l(torch.relu(self.l(x)))


class TiedHead(torch.nn.Module):
    """GPT-2's tie as Hugging Face writes it: the head's weight *is* the embedding's Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.head = torch.nn.Embedding(10, 16), torch.nn.Linear(16, 10, bias=False)
        self.head.weight = self.e.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.e(ids)))


@pytest.mark.parametrize("make,inputs", [
    (Tied, lambda: {"ids": torch.randint(0, 10, (2, 5))}),
    (TiedHead, lambda: {"ids": torch.randint(0, 10, (2, 5))}),
    (Shared, lambda: {"x": torch.randn(2, 5, 16)})])
def test_a_weight_used_twice_is_one_parameter_with_both_uses_gradients(make, inputs):
    torch.manual_seed(0)
    m, ins = make(), inputs()
    g, values = import_torch(m, ins)
    assert len(values) == len(dict(m.named_parameters()))  # no copy per use
    assert not any(o.kernel == "permute" for o in g.ops.values())  # the tied table is read transposed in place
    step = training_step(g, loss="mse", optimizer="sgd")
    with torch.no_grad():
        target = torch.randn_like(m(*ins.values()))
    feed = {k: (v.numpy().astype(np.int32) if not v.is_floating_point() else v.numpy()) for k, v in ins.items()}
    env = execute(step, {**values, **feed, "target": target.numpy()}, precision="float64")
    torch.nn.functional.mse_loss(m(*ins.values()), target).backward()
    for name, p in m.named_parameters():
        got = env[f"{name}.grad"] if f"{name}.grad" in env else env[f"{name}.T.grad"].T
        np.testing.assert_allclose(got, p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def test_zero_filled_weights_are_not_tied_to_each_other():
    """Equal arrays of one value (zero biases) say nothing of tying: each stays its own parameter."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for layer in m:
        torch.nn.init.zeros_(layer.bias)
    g, values = import_torch(m, {"x": torch.randn(3, 4)})
    assert {"0.bias", "1.bias"} <= set(values)
    assert sorted(t for o in g.ops.values() for _, t in o.inputs if t.endswith("bias")) == ["0.bias", "1.bias"]


class WideMask(torch.nn.Module):
    """A causal ``where`` whose condition has more leading dims than the scores: the result
    broadcasts up to the condition's shape."""

    def forward(self, x):
        mask = torch.tril(torch.ones(4, 4, dtype=torch.bool)).expand(1, 3, 4, 4)
        y = torch.where(mask, x.unsqueeze(1), float("-inf"))
        return y.softmax(-1).sum(1)


class RankUp(torch.nn.Module):
    """A one-element constant of higher rank raises the graph output's rank."""

    def forward(self, x):
        return x * torch.tensor([[[2.0]]])


@pytest.mark.parametrize("m,x", [(WideMask(), torch.randn(2, 4, 4)), (RankUp(), torch.randn(4, 16))])
def test_broadcasting_masks_and_constants_equal_torch(m, x):
    outs, _, _ = _forward(m, {"x": x})
    with torch.no_grad():
        ref = m(x).numpy()
    (got,) = outs.values()
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


class Nested(torch.nn.Module):
    def forward(self, x):
        return {"logits": x * 2, "parts": (x.relu(), x.tanh())}


def test_nested_results_are_named_by_their_paths():
    x = torch.randn(3, 4)
    outs, _, _ = _forward(Nested(), {"x": x})
    assert set(outs) == {"output_logits", "output_parts_0", "output_parts_1"}
    for name, ref in (("output_logits", x * 2), ("output_parts_0", x.relu()), ("output_parts_1", x.tanh())):
        np.testing.assert_allclose(outs[name], ref.numpy(), rtol=1e-6, err_msg=name)


class HalfLayer(torch.nn.Module):
    """A bf16 layer fed by a cast of an fp32 input (mixed precision)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(8, 4).bfloat16()

    def forward(self, x):
        return self.l(x.bfloat16()).float()


@pytest.mark.parametrize("make,dtype", [(lambda: torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU())
                                         .bfloat16(), torch.bfloat16), (HalfLayer, torch.float32)])
def test_bfloat16_weights_import_and_equal_torch(make, dtype):
    torch.manual_seed(0)
    m, x = make(), torch.randn(4, 16 if dtype == torch.bfloat16 else 8, dtype=dtype)
    outs, g, values = _forward(m, {"x": x})
    assert any(g.tensors[n].dtype == "bfloat16" for n in values)
    with torch.no_grad():
        ref = m(x).float().numpy()
    np.testing.assert_allclose(next(iter(outs.values())), ref, rtol=2e-2, atol=2e-2)


def test_the_callers_training_mode_is_kept():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)).train()
    import_torch(m, {"x": torch.randn(2, 4)})
    assert m.training


def test_a_size_traced_into_a_constant_warns_under_dynamic_axes():
    class Scaled(torch.nn.Module):
        def forward(self, x):
            return x * (1.0 / float(x.shape[1]) ** 0.5)

    with pytest.warns(torch.jit.TracerWarning):
        import_torch(Scaled(), {"x": torch.randn(2, 16)}, {"n": 40}, dynamic_axes={"x": {1: "n"}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none without dynamic axes: the export is exact at its shapes
        import_torch(Scaled(), {"x": torch.randn(2, 16)})


def test_an_output_whose_rank_contradicts_the_declared_one_is_refused():
    """The importer's safety net: a mapping that changes an output's rank never imports silently;
    other sizes than those declared warn (exporters' shape inference is not always the framework's)."""
    node = helper.make_node("Relu", ["x"], ["y"])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    for declared, fate in ((["batch", 3], "ok"), ([2, 3], "ok"), ([2, 4], "warns"), (["batch", 3, 1], "refused")):
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, declared)
        model = helper.make_model(helper.make_graph([node], "g", [x], [y]))
        if fate == "refused":
            with pytest.raises(ImportFailure, match="declares"):
                import_onnx(model, {"batch": 2})
            continue
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert import_onnx(model, {"batch": 2})[0].tensors["y"].shape == (2, 3)
        assert [str(w.message) for w in seen if "declares" in str(w.message)] == (
            ["graph output 'y' has shape [2, 3] in the block graph; the model declares [2, 4] (its exporter's "
             "shape inference)"] if fate == "warns" else [])


MODEL = """import torch

def make():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

def make_raises():
    raise RuntimeError("boom")
"""


@pytest.mark.parametrize("spec,inputs,says", [
    ("make", ["x:float32[4,9]"], "forward failed on the example inputs (x: torch.float32[4, 9])"),
    ("make", ["x:float32[4,8]", "y:float32[4,8]"], "forward failed"),
    ("make", ["x:int64[4,8]"], "forward failed"),
    ("make_raises", ["x:float32[4,8]"], "make_raises() failed: RuntimeError: boom")])
def test_a_forward_or_factory_that_fails_is_one_clear_error(tmp_path, capsys, spec, inputs, says):
    (tmp_path / "model.py").write_text(MODEL)
    args = ["import", f"{tmp_path / 'model.py'}:{spec}", "-o", str(tmp_path / "p.json")]
    for x in inputs:
        args += ["--example-input", x]
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in " ".join(err.split()) and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("args,says", [
    (["{py}:make", "--example-input", "x:float32[4,8]", "--set", "batch=4"], "--set batch binds symbolic dims"),
    (["{py}"], "is a Python file; name the function"),
])
def test_cli_says_how_a_pytorch_model_is_named_and_sized(tmp_path, capsys, args, says):
    py = tmp_path / "model.py"
    py.write_text(MODEL)
    with pytest.raises(SystemExit) as e:
        main(["import", *(a.format(py=py) for a in args), "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in " ".join(err.split()) and "Traceback" not in err


def test_a_bare_transformer_layer_gets_the_workaround(tmp_path, capsys):
    """torch's exporter fails on a bare ``nn.TransformerEncoderLayer``; the error says to wrap it."""
    (tmp_path / "enc.py").write_text("import torch\n\ndef make():\n"
                                     "    return torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)\n")
    with pytest.raises(SystemExit) as e:
        main(["import", f"{tmp_path / 'enc.py'}:make", "--example-input", "x:float32[2,5,16]",
              "-o", str(tmp_path / "p.json")])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and "return a module whose forward calls the layer" in err
