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
