"""Training steps: an SGD and an AdamW step of an MLP against NumPy written here, names and
roles of the step's tensors, mixed precision, errors, and sharded training plans (data parallel,
ZeRO-sharded state, tensor parallel) of tiny gpt and llama models verified against the
unsharded step."""

from __future__ import annotations

import numpy as np
import pytest

from executor.run import execute, random_inputs
from executor.verify import verify
from ir import workloads
from ir.autodiff import AutodiffError, training_step
from ir.builder import GraphBuilder
from ir.graph import STATE_ROLES
from ir.rewrites import split_reduction
from tests.autodiff.plans import data_parallel, tensor_parallel


def _mlp():
    return workloads.build("mlp", batch=4, widths=[3, 5, 2], activation="tanh")


def _numpy_mlp_grads(v):
    """Forward and backward of tanh-MLP + mse by hand."""
    h = v["x"] @ v["W1"] + v["b1"]
    a = np.tanh(h)
    y = a @ v["W2"] + v["b2"]
    loss = np.mean((y - v["target"]) ** 2)
    dy = 2 * (y - v["target"]) / y.size
    dW2, db2 = a.T @ dy, dy.sum(0)
    dh = (dy @ v["W2"].T) * (1 - a**2)
    dW1, db1 = v["x"].T @ dh, dh.sum(0)
    return loss, {"W1": dW1, "b1": db1, "W2": dW2, "b2": db2}


def test_sgd_step_of_an_mlp_matches_numpy():
    step = training_step(_mlp(), loss="mse", optimizer="sgd", optimizer_params={"lr": 0.1, "weight_decay": 0.01})
    ins = {k: a.astype(np.float64) for k, a in random_inputs(step, seed=3).items()}
    env = execute(step, ins, precision="float64")
    loss, grads = _numpy_mlp_grads(ins)
    assert float(env["loss"][0]) == pytest.approx(loss, rel=1e-12)
    for p, g in grads.items():
        np.testing.assert_allclose(env[f"{p}.next"], ins[p] - 0.1 * (g + 0.01 * ins[p]), rtol=1e-12, atol=1e-14)


def test_sgd_momentum_and_adamw_steps_match_numpy():
    ins = None
    for opt, hp in (("sgd", {"lr": 0.05, "momentum": 0.9}), ("adamw", {"lr": 0.01, "step": 4})):
        step = training_step(_mlp(), optimizer=opt, optimizer_params=hp)
        ins = {k: a.astype(np.float64) for k, a in random_inputs(step, seed=5).items()}
        env = execute(step, ins, precision="float64")
        _, grads = _numpy_mlp_grads(ins)
        for p, g in grads.items():
            if opt == "sgd":
                buf = 0.9 * ins[f"{p}.momentum"] + g
                np.testing.assert_allclose(env[f"{p}.momentum.next"], buf, rtol=1e-12)
                np.testing.assert_allclose(env[f"{p}.next"], ins[p] - 0.05 * buf, rtol=1e-12)
            else:  # torch.optim.AdamW, written out
                m = 0.9 * ins[f"{p}.m"] + 0.1 * g
                v = 0.999 * ins[f"{p}.v"] + 0.001 * g * g
                want = ins[p] * (1 - 0.01 * 0.01) - 0.01 * (m / (1 - 0.9**4)) / (np.sqrt(v / (1 - 0.999**4)) + 1e-8)
                np.testing.assert_allclose(env[f"{p}.m.next"], m, rtol=1e-12)
                np.testing.assert_allclose(env[f"{p}.v.next"], v, rtol=1e-12)
                np.testing.assert_allclose(env[f"{p}.next"], want, rtol=1e-10)
    assert (ins["W1.v"] >= 0).all()  # second moments drawn inside the kernel's declared range


def test_sgd_momentum_with_weight_decay_matches_torch_sgd():
    """torch.optim.SGD (no dampening, no Nesterov), written out: the decay joins the gradient
    before the momentum buffer (``d = g + wd·p; buf = m·buf + d; p -= lr·buf``). The step added it
    after the buffer: the parameter matched for one step, the buffer was off by ``wd·p``."""
    hp = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}
    step = training_step(_mlp(), optimizer="sgd", optimizer_params=hp)
    assert "W1.momentum.update" in step.ops and step.ops["W1.momentum.update"].kernel == "momentum_decay_update"
    ins = {k: a.astype(np.float64) for k, a in random_inputs(step, seed=7).items()}
    env = execute(step, ins, precision="float64")
    _, grads = _numpy_mlp_grads(ins)
    for p, g in grads.items():
        buf = 0.9 * ins[f"{p}.momentum"] + g + 0.01 * ins[p]
        np.testing.assert_allclose(env[f"{p}.momentum.next"], buf, rtol=1e-12)
        np.testing.assert_allclose(env[f"{p}.next"], ins[p] - 0.05 * buf, rtol=1e-12)


def test_step_names_roles_and_carried_state():
    step = training_step(_mlp(), optimizer="adamw")
    outs = {n for n, t in step.tensors.items() if t.role == "output"}
    params = ["W1", "b1", "W2", "b2"]
    assert outs == {"loss"} | {f"{p}{s}.next" for p in params for s in ("", ".m", ".v")}
    assert {n for n, t in step.tensors.items() if t.role == "state"} == {f"{p}.{s}" for p in params for s in "mv"}
    assert step.carried == {n: f"{n}.next" for n, t in step.tensors.items() if t.role in STATE_ROLES}
    assert step.tensors["target"].role == "input" and step.tensors["target"].shape == (4, 2)
    assert all(f"{p}.grad" in step.tensors for p in params)


def test_mixed_precision_keeps_fp32_master_weights():
    g = workloads.build("gpt", layers=1, d_model=8, heads=2, vocab=16, seq=4, batch=2, dtype="bfloat16")
    step = training_step(g, loss="cross_entropy", optimizer="adamw")
    assert step.tensors["wte"].dtype == "float32" and step.tensors["wte.m"].dtype == "float32"
    assert step.tensors["wte.lowp"].dtype == "bfloat16"
    assert step.ops["wte.cast"].kernel == "cast"
    assert step.tensors["l0.ff1.out"].dtype == "bfloat16"  # activations stay low precision
    assert step.tensors["wte.grad"].dtype == "float32"  # the cast rule brings the gradient back to fp32
    assert verify(split_reduction(step, "l0.ff1.dW", 2), reference=step).ok


@pytest.mark.parametrize("kwargs,message", [
    (dict(loss="hinge"), "loss 'hinge' is not one of"),
    (dict(optimizer="lion"), "optimizer 'lion' is not one of"),
    (dict(optimizer_params={"betas": 1}), "has no parameter 'betas'"),
    (dict(output="nope"), "output 'nope' is not a produced tensor"),
])
def test_bad_arguments_say_why(kwargs, message):
    with pytest.raises(AutodiffError, match=message):
        training_step(_mlp(), **kwargs)


def test_programs_that_cannot_be_differentiated():
    b = GraphBuilder()
    b.reduce_max(b.parameter("w", (3, 4)), name="mx", dim=1)
    with pytest.raises(AutodiffError, match="'mx': kernel 'reduce_max' has no vector-Jacobian rule"):
        training_step(b.build())
    b = GraphBuilder()
    b.relu(b.input("x", (3,)), name="r")
    with pytest.raises(AutodiffError, match="no parameters"):
        training_step(b.build())
    with pytest.raises(AutodiffError, match="already a training step"):
        training_step(training_step(_mlp()))


def test_a_forward_with_fused_norms_trains_as_its_unfused_form():
    """``norm_matmul`` has no VJP: the step unfuses the norms (the backward reads the normalised
    activations), so it is the unfused forward's step; the norm can be fused again in the step,
    kept for the backward's readers, and that step verifies equal."""
    from executor.verify import verify
    from ir.rewrites import fuse, fuse_norm

    g = workloads.build("transformer", batch=2, seq=8, d_model=16, heads=2, d_ff=32)
    fused = fuse_norm(fuse_norm(fuse(g, "ff1", "ff_act"), "ln1"), "ln2")
    assert sum(o.kernel == "norm_matmul" or o.kernel == "fused" for o in fused.ops.values()) == 4
    step = training_step(fused, optimizer="adamw")
    assert step.digest == training_step(g, optimizer="adamw").digest
    refused = fuse_norm(step, "ln1", "q_proj")
    assert "ln1" in refused.ops and refused.ops["ln1+q_proj"].kernel == "norm_matmul"
    assert verify(refused, reference=step).ok


TINY = {
    "gpt": dict(layers=2, d_model=12, heads=2, d_ff=20, vocab=18, seq=6, batch=4),
    "llama": dict(layers=2, d_model=12, heads=2, kv_heads=1, d_ff=20, vocab=18, seq=6, batch=4),
}


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("plan", ["dp", "zero", "tp"])
def test_sharded_training_plans_verify(name, plan):
    step = workloads.build(name, mode="train", optimizer="adamw", **TINY[name])
    if plan == "tp":
        p = tensor_parallel(step, 2, {"heads": 2, "d_ff": 20})
    else:
        p = data_parallel(step, 2, batch=4, zero=plan == "zero")
    assert len(p.devices) == 2 and p.n_shards > len(step.ops)
    accs = [n for n, o in p.ops.items() if o.kernel == "accumulate"]
    assert accs, "weight gradients are reduced across devices"
    if plan == "zero":
        homes = {n for n, o in p.ops.items() if o.output.endswith(".next")}
        assert any(len(set(p.ops[n].shards.device.tolist())) == 2 for n in homes)
    report = verify(p, reference=step)
    assert report.ok, report
    assert set(report.per_output) >= {"loss", "W_head.next" if name == "llama" else "wte.next"}


def test_parameters_with_onnx_names_train():
    """Op names derived from tensor names are cleaned (ONNX initializers hold '/' and '::')."""
    b = GraphBuilder()
    h = b.linear(b.input("x", (4, 3)), b.parameter("onnx::MatMul_109", (3, 5)), b.parameter("h.0/mlp/bias", (5,)),
                 name="fc")
    b.add(h, "h.0/mlp/bias", name="again")  # fan-out: a gradient sum over a '/' name
    step = training_step(b.build(), optimizer="adamw")
    assert "onnx__MatMul_109.update" in step.ops and "onnx::MatMul_109.next" in step.tensors
    assert "h.0_mlp_bias.gsum1" in step.ops and "h.0/mlp/bias.grad" in step.tensors
    assert verify(split_reduction(step, "fc.dW", 2), reference=step).ok
