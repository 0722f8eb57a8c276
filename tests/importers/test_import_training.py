"""An imported forward program plus a named loss becomes a training step that verifies."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")

import onnx_models  # noqa: E402
from executor import verify  # noqa: E402
from executor.run import execute, random_inputs  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.rewrites import place, random_walk, split  # noqa: E402


def test_imported_mlp_trains_with_mse_and_sgd():
    g, values = import_onnx(onnx_models.mlp(), {"batch": 8})
    step = training_step(g, loss="mse", optimizer="sgd", optimizer_params={"lr": 0.1})
    assert set(step.carried) == set(values)  # every initializer gets its next value
    ins = random_inputs(step, 0)
    ins.update(values)
    env = execute(step, ins)
    # one SGD step on the model's own weights lowers the loss on the same batch
    ins2 = dict(ins)
    ins2.update({p: np.asarray(env[nxt]) for p, nxt in step.carried.items()})
    env2 = execute(step, ins2)
    assert float(np.asarray(env2["loss"]).sum()) < float(np.asarray(env["loss"]).sum())
    # data parallel over 4 devices, and random plans, verify against the unsharded step
    dp = step
    for op in dp.topo_order:
        sig = dp.signature(op)
        if sig.dims and sig.extents[0] == 8:
            dp = place(split(dp, op, 0, 4), op, [0, 1, 2, 3])
    assert verify(dp, values=values).ok
    rng = np.random.default_rng(3)
    for _ in range(2):
        rep = verify(random_walk(step, rng, 4, 30), values=values)
        assert rep.ok, rep


@pytest.mark.parametrize("make,params", [(onnx_models.gpt2_block, {"batch": 2, "seq": 4}),
                                         (onnx_models.llama_block, {"batch": 2})], ids=["gpt2", "llama"])
def test_imported_transformer_blocks_train(make, params):
    """Split (slice), reshape, causal mask, Erf GELU, RMSNorm and SwiGLU all have gradients: a
    small SGD step on the model's weights lowers the loss, and random plans of the step verify."""
    g, values = import_onnx(make(), params)
    step = training_step(g, loss="mse", optimizer="sgd", optimizer_params={"lr": 0.01})
    ins = random_inputs(step, 0)
    ins.update(values)
    env = execute(step, ins)
    ins2 = dict(ins)
    ins2.update({p: np.asarray(env[nxt]) for p, nxt in step.carried.items()})
    assert float(np.asarray(execute(step, ins2)["loss"]).sum()) < float(np.asarray(env["loss"]).sum())
    rep = verify(random_walk(step, np.random.default_rng(5), 4, 30), values=values)
    assert rep.ok, rep


def test_imported_resnet_block_trains_through_strided_convs():
    """A ResNet stem and downsampling block (3x3 stride-2 Conv with SAME_UPPER, 1x1 stride-2
    shortcut) equals ``onnx.reference``; its training step sends gradients through the inputs of
    both strided convs (transposed convs over blocks of stride rows), lowers the loss, and its
    data-parallel and random sharded plans verify."""
    g, values = onnx_models.check_import(onnx_models.resnet_block(), {"N": 4}, {"conv2d", "maxpool2d", "batchnorm2d"},
                                         walks=1)
    step = training_step(g, loss="mse", optimizer="sgd", optimizer_params={"lr": 0.05})
    strided = [o for o in step.ops.values() if o.kernel == "conv2d_input_grad" and o.params.get("stride") == 2]
    assert len(strided) == 2  # b1 (SAME_UPPER: padding 1) and the 1x1 downsample
    assert set(step.carried) == set(values)  # every initializer trains, the stem's too
    ins = random_inputs(step, 0)
    ins.update(values)
    env = execute(step, ins)
    ins2 = {**ins, **{p: np.asarray(env[nxt]) for p, nxt in step.carried.items()}}
    assert float(np.asarray(execute(step, ins2)["loss"]).sum()) < float(np.asarray(env["loss"]).sum())
    dp = step
    for op in dp.topo_order:
        sig = dp.signature(op)
        if sig.dims and sig.dims[0] == "n" and sig.extents[0] == 4:
            dp = place(split(dp, op, 0, 4), op, [0, 1, 2, 3])
    for o in strided:  # and the transposed convs split over row blocks too
        dp = place(split(dp, o.name, "hb", 2), o.name, [0, 1, 2, 3, 0, 1, 2, 3])
    rep = verify(dp, values=values)
    assert rep.ok, rep
    rng = np.random.default_rng(12)
    for _ in range(2):
        rep = verify(random_walk(step, rng, 4, 40), values=values)
        assert rep.ok, rep
