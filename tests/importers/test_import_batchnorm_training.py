"""Training-mode batch normalisation (``ir.importers.onnx_batchnorm``): ONNX
``BatchNormalization`` with ``training_mode=1`` and torch's ``BatchNorm1d/2d`` imported with
``batchnorm="train"`` normalise with the batch's statistics, as ``onnx.reference`` and torch in
train mode do; gradients flow through the statistics (torch's autograd, central differences);
sharded plans verify; a data-parallel plan of the training step splits the statistics' batch
reduction across devices (SyncBatchNorm's cross-device reduction); refusals say what to do."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnx_models
from costmodel.transfers import transfer_plan
from executor import verify
from executor.run import execute
from ir.autodiff import training_step
from ir.importers.errors import ImportFailure
from ir.importers.onnx import import_onnx
from ir.rewrites import random_walk
from optimizer.search.baselines import data_parallel_step
from torch_checks import check_against_torch, kernels_of, needs_torch, torch

STATS = ("reduce_mean", "sub", "pow", "batchnorm2d")  # what training-mode batch norm is made of


def _bn_model(shape, opset: int = 15, training: int = 1, running: bool = False, conv: bool = False,
              momentum: float = 0.8, eps: float = 1e-3, seed: int = 0) -> onnx.ModelProto:
    """``y = BatchNormalization(x)`` over ``x[shape]`` (after a 3x3 ``Conv`` by ``W`` when ``conv``),
    ``training_mode`` as given; ``running``: also the outputs ``running_mean``, ``running_var``."""
    rng = np.random.default_rng(seed)
    c = shape[1]

    def init(name, shp, offset=0.0):
        return numpy_helper.from_array((offset + 0.3 * rng.standard_normal(shp)).astype(np.float32), name)

    n = helper.make_node
    nodes, inits, src = [], [], "x"
    if conv:
        nodes.append(n("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]))
        inits.append(init("W", (c, c, 3, 3)))
        src = "c"
    outs = ["y"] + (["running_mean", "running_var"] if running else [])
    if running and opset < 14:  # BatchNormalization-9 trains with five outputs
        outs += ["saved_mean", "saved_var"]
    attrs = {"epsilon": eps, "momentum": momentum}
    if opset >= 14:
        attrs["training_mode"] = training
    nodes.append(n("BatchNormalization", [src, "scale", "bias", "mean", "var"], outs, name="bn", **attrs))
    inits += [init("scale", (c,), 1.0), init("bias", (c,)), init("mean", (c,)), init("var", (c,), 1.0)]
    # running statistics must stay positive for the variance
    inits[-1] = numpy_helper.from_array(np.abs(numpy_helper.to_array(inits[-1])) + 0.5, "var")
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))]
    if running:
        outputs += [helper.make_tensor_value_info(k, TensorProto.FLOAT, [c]) for k in ("running_mean", "running_var")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                          outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


# -- ONNX: outputs equal onnx.reference, sharded plans verify --------------------------------------

@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5), (4, 3, 4, 4), (2, 2, 3, 2, 2)],
                         ids=["NC", "NCL", "NCHW", "NCDHW"])
@pytest.mark.parametrize("opset", [14, 15])
def test_training_mode_equals_onnx_reference(shape, opset):
    g, _ = onnx_models.check_reference(_bn_model(shape, opset), {"x": shape}, kernels=STATS)
    # the batch is a reduction of its own over [N, C], which a data-parallel plan can split
    batch = [o for o in g.ops.values() if o.kernel == "reduce_mean" and o.params.get("dim") == 0]
    assert len(batch) == 2 and all(g.tensors[o.inputs[0][1]].shape == shape[:2] for o in batch)


def test_running_statistics_outputs_follow_the_onnx_spec():
    """``running_mean``/``running_var`` are ``input · momentum + current · (1 - momentum)`` with
    the batch's mean and biased variance, as ``onnx.reference`` computes them."""
    shape = (4, 3, 4, 4)
    m = _bn_model(shape, running=True, momentum=0.7)
    g, vals = import_onnx(m, {})
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    env = execute(g, {**vals, "x": x})
    ref = ReferenceEvaluator(m).run(None, {"x": x})
    for name, want in zip(("y", "running_mean", "running_var"), ref):
        np.testing.assert_allclose(np.asarray(env[name]), want, rtol=1e-5, atol=1e-6, err_msg=name)
    # not the input's statistics: the update really mixes in the batch's
    assert not np.allclose(np.asarray(env["running_mean"]), 0.7 * vals["mean"], atol=1e-3)
    for seed in (0, 1):  # sharded plans of all three outputs verify
        rep = verify(random_walk(g, np.random.default_rng(seed), 4, 20), values=vals)
        assert rep.ok, rep


def test_inference_mode_is_unchanged():
    """``training_mode=0`` stays one ``batchnorm2d`` on the running statistics."""
    g, _ = onnx_models.check_reference(_bn_model((4, 3, 4, 4), training=0), {"x": (4, 3, 4, 4)},
                                       kernels={"batchnorm2d"})
    assert kernels_of(g) == ["batchnorm2d"]


# -- gradients through the batch statistics -----------------------------------------------------

def test_gradients_match_central_differences():
    """Conv -> training-mode BN: the conv weight's gradient is only right if it flows through the
    mean and variance (a shift or scale of the conv output is normalised away)."""
    shape = (3, 2, 3, 3)
    g, vals = import_onnx(_bn_model(shape, conv=True), {})
    onnx_models.check_central_differences(g, vals, shape, wrt=("W", "scale", "bias"))


def _conv_bn(torch_mod, bn):
    class ConvBN(torch_mod.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch_mod.nn.Conv2d(3, 4, 3, padding=1, bias=True)
            self.bn = bn
            self.fc = torch_mod.nn.Linear(4 * 4 * 4, 3)

        def forward(self, x):
            return self.fc(torch_mod.relu(self.bn(self.conv(x))).flatten(1))

    return ConvBN()


@needs_torch
def test_batchnorm2d_train_mode_matches_torch():
    """Forward and every parameter's gradient (conv, BN affine, head) equal torch's autograd of
    ``nn.BatchNorm2d`` in train mode; the caller's modes and running statistics are untouched."""
    from ir.importers.torch_export import import_torch

    torch.manual_seed(0)
    m = _conv_bn(torch, torch.nn.BatchNorm2d(4)).train()
    m.fc.eval()  # a submodule's own mode comes back too
    x = torch.randn(4, 3, 4, 4)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    import_torch(m, {"x": x}, batchnorm="train")  # its export runs the forward in train mode
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # running stats put back
    assert m.training and m.bn.training and not m.fc.training
    check_against_torch(m, x, STATS, batchnorm="train")


@needs_torch
@pytest.mark.parametrize("shape", [(6, 4), (4, 3, 5)], ids=["NC", "NCL"])
def test_batchnorm1d_train_mode_matches_torch(shape):
    """``nn.BatchNorm1d`` after a layer (``Linear`` on ``[N, F]``, ``Conv1d`` on ``[N, C, L]``), so
    that layer's gradient passes through the batch statistics."""
    torch.manual_seed(1)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = torch.nn.Linear(shape[1], 5) if len(shape) == 2 else torch.nn.Conv1d(3, 5, 3, padding=1)
            self.bn = torch.nn.BatchNorm1d(5, momentum=0.3)
            self.fc = torch.nn.Linear(5 if len(shape) == 2 else shape[-1], 2)

        def forward(self, x):
            return self.fc(torch.tanh(self.bn(self.pre(x))))

    check_against_torch(Net().train(), torch.randn(*shape), STATS, batchnorm="train")


@needs_torch
def test_default_import_keeps_running_statistics():
    """Without ``batchnorm="train"`` a module in train mode still imports on its running
    statistics (the default is unchanged): one ``batchnorm2d``, torch's eval-mode numbers."""
    from ir.importers.torch_export import import_torch

    torch.manual_seed(2)
    m = torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.Flatten(), torch.nn.Linear(12, 2))
    m[0].running_mean.uniform_(-1, 1)
    m[0].running_var.uniform_(0.5, 2)
    m.train()
    x = torch.randn(2, 3, 2, 2)
    g, vals = import_torch(m, {"x": x})
    assert "batchnorm2d" in kernels_of(g) and "reduce_mean" not in kernels_of(g)
    with torch.no_grad():
        want = m.eval()(x).numpy()
    np.testing.assert_allclose(execute(g, {**vals, "x": x.numpy()})["output"], want, rtol=1e-5, atol=1e-6)


# -- data parallelism: the statistics are reduced across devices ----------------------------------

def test_data_parallel_step_reduces_statistics_across_devices():
    """The training step of Conv -> BN under plain data parallelism (4 devices) verifies, and the
    per-channel partial sums of the batch mean and variance cross devices (SyncBatchNorm)."""
    shape = (8, 4, 4, 4)
    g, vals = import_onnx(_bn_model(shape, conv=True), {})
    step = training_step(g, loss="mse", optimizer="sgd")
    plan = data_parallel_step(step, 4)
    rep = verify(plan, values=vals)
    assert rep.ok, rep
    for stat in ("bn.mean.batch", "bn.var.batch"):
        assert plan.ops[stat].params.get("split"), stat  # the batch reduction is split ...
        partial = plan.ops[stat].output
        assert plan.tensors[partial].shape == (4, shape[1])  # ... into one [C] partial per device
    moved = transfer_plan(plan, 4).transfers
    for stat in ("bn.mean.batch", "bn.var.batch"):
        partial = plan.ops[stat].output
        sent = {t["src"] for t in moved if t["tensor"] == partial and t["src"] != t["dst"]}
        assert sent == {0, 1, 2, 3}, (stat, sent)  # every device sends its partial sums


# -- refusals ---------------------------------------------------------------------------------

def test_training_before_opset_14_is_refused():
    """BatchNormalization-9 marks training by its extra outputs; it is refused with the fix."""
    m = _bn_model((4, 3, 2, 2), opset=9, running=True)
    onnx_models.check_refused(m, "BatchNormalization", "opset 9", "re-export at opset 14 or later")


def test_running_outputs_in_inference_mode_are_refused():
    m = _bn_model((4, 3, 2, 2), training=0, running=True)
    onnx_models.check_refused(m, "running_mean / running_var outputs with training_mode=0")


@needs_torch
def test_torch_batchnorm_option_is_checked():
    from ir.importers.torch_export import import_torch

    m = _conv_bn(torch, torch.nn.BatchNorm2d(4))
    x = {"x": torch.randn(2, 3, 4, 4)}
    with pytest.raises(ImportFailure, match=r"batchnorm='bogus': give one of \['eval', 'train'\]"):
        import_torch(m, x, batchnorm="bogus")
    with pytest.raises(ImportFailure, match="batchnorm='train' needs opset 14 or later"):
        import_torch(m, x, batchnorm="train", opset=13)


# -- the CLI ----------------------------------------------------------------------------------

_FACTORY = ("import torch\n\ndef make_model():\n    torch.manual_seed(0)\n"
            "    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())\n")


def _cli(capsys, *args: str) -> tuple[int, str]:
    from optimizer.cli import main

    with pytest.raises(SystemExit) as e:
        main(list(args))
    return int(e.value.code or 0), capsys.readouterr().err


@needs_torch
def test_cli_batchnorm_train(tmp_path, capsys):
    """``tapestry import module.py:factory --batchnorm train``: batch statistics; the default and
    ``--batchnorm eval`` keep the running ones; a bad value, or the option on an ONNX file, exits 2."""
    from ir.serialize import load

    src = tmp_path / "model.py"
    src.write_text(_FACTORY)
    ex = ["--example-input", "x:float32[2,3,6,6]"]
    for mode, has_stats in (("train", True), ("eval", False), (None, False)):
        out = tmp_path / f"{mode}.json"
        rc, err = _cli(capsys, "import", f"{src}:make_model", *ex, "-o", str(out),
                       *(["--batchnorm", mode] if mode else []))
        assert rc == 0, err
        g = load(out)
        assert ("reduce_mean" in kernels_of(g)) == has_stats, (mode, kernels_of(g))
    rc, err = _cli(capsys, "import", f"{src}:make_model", *ex, "-o", str(tmp_path / "x.json"), "--batchnorm", "fit")
    assert rc == 2 and "--batchnorm 'fit' must be eval" in err
    onnx.save(_bn_model((2, 3, 2, 2)), str(tmp_path / "bn.onnx"))
    rc, err = _cli(capsys, "import", str(tmp_path / "bn.onnx"), "-o", str(tmp_path / "o.json"), "--batchnorm", "train")
    assert rc == 2 and "--batchnorm is for PyTorch models" in err
