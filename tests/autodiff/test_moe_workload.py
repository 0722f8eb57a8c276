"""The Mixtral-style mixture-of-experts layers of ``workloads.llama(experts=...)``.

The MoE block against a token-by-token NumPy formula of Mixtral's layer (Jiang et al. 2024, §2.1)
with the balanced routing the workload fixes; its training step's gradients against central
differences; sharded plans, expert-parallel ones included, against the unsharded program; and the
parameters that make no balanced routing."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.special

from test_vjp_finite_differences import fd_check

from executor import verify
from executor.run import execute, random_inputs
from ir import workloads
from ir.mesh import Mesh
from ir.rewrites import random_walk
from ir.rewrites.layout import layout

SMALL = dict(layers=2, d_model=16, heads=2, d_ff=24, vocab=20, seq=8, batch=2)


def silu(x):
    return x / (1.0 + np.exp(-x))


def moe_formula(x, w_router, w_gate, w_up, w_down, top_k):
    """Mixtral's layer, one token at a time: token ``s`` of each sequence picks experts
    ``(s·k + j) mod E``; its gates are the softmax of the router's logits over those experts."""
    b, s, _ = x.shape
    experts = w_router.shape[1]
    y = np.zeros_like(x)
    for i in range(b):
        for t in range(s):
            chosen = [(t * top_k + j) % experts for j in range(top_k)]
            logits = np.array([x[i, t] @ w_router[:, e] for e in chosen])
            gates = scipy.special.softmax(logits)
            for gate, e in zip(gates, chosen):
                y[i, t] += gate * ((silu(x[i, t] @ w_gate[e]) * (x[i, t] @ w_up[e])) @ w_down[e])
    return y


@pytest.mark.parametrize("experts,top_k,seq", [(4, 2, 8), (8, 2, 4), (3, 1, 6), (4, 4, 2)])
def test_moe_block_matches_mixtral_formula(experts, top_k, seq):
    g = workloads.build("llama", **{**SMALL, "seq": seq}, experts=experts, top_k=top_k)
    ins = {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in random_inputs(g, 0).items()}
    env = execute(g, ins, precision="float64")
    for layer in (0, 1):
        x = np.asarray(env[f"l{layer}.ffn_norm.out"])
        want = moe_formula(x, ins[f"l{layer}_W_router"], ins[f"l{layer}_W_gate"], ins[f"l{layer}_W_up"],
                           ins[f"l{layer}_W_down"], top_k)
        np.testing.assert_allclose(np.asarray(env[f"l{layer}.moe_mix.out"]), want, rtol=1e-10, atol=1e-12)


def test_every_expert_gets_as_many_tokens():
    """The dispatched tensor ``[e, b, c, d]`` holds each token ``top_k`` times, ``c`` per expert
    and sequence: the balanced load."""
    g = workloads.build("llama", **SMALL, experts=4, top_k=2)
    assert g.tensors["l0.moe_dispatch.out"].shape == (4, 2, 4, 16)
    env = execute(g, random_inputs(g, 0), precision="float64")
    x, xe = np.asarray(env["l0.ffn_norm.out"]), np.asarray(env["l0.moe_dispatch.out"])
    for t in range(8):
        for j in range(2):
            e, slot = (t * 2 + j) % 4, (t * 2 + j) // 4
            np.testing.assert_array_equal(xe[e, :, slot], x[:, t])


@pytest.mark.parametrize("factor,cap", [(1.25, 5), (1.5, 6), (2, 8), (1.1, 5)])
def test_a_capacity_factor_pads_each_experts_buffer(factor, cap):
    """``c = 4`` tokens per expert and sequence; the buffer holds ``ceil(factor·4)`` slots, the
    ones past 4 zero: the experts' GEMMs and the dispatch carry them, the layer's output is
    Mixtral's all the same, and the training step computes the same update as without padding."""
    g = workloads.build("llama", **SMALL, experts=4, top_k=2, capacity_factor=factor)
    assert g.tensors["l0.moe_dispatch.out"].shape == (4, 2, cap, 16)
    assert g.tensors["l1.ff_gate.out"].shape == (4, 2, cap, 24)
    ins = {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in random_inputs(g, 0).items()}
    env = execute(g, ins, precision="float64")
    assert not np.asarray(env["l0.moe_dispatch.out"])[:, :, 4:].any()  # padding, written as zeros
    x = np.asarray(env["l0.ffn_norm.out"])
    want = moe_formula(x, ins["l0_W_router"], ins["l0_W_gate"], ins["l0_W_up"], ins["l0_W_down"], 2)
    np.testing.assert_allclose(np.asarray(env["l0.moe_mix.out"]), want, rtol=1e-10, atol=1e-12)
    # the padded training step updates every parameter as the unpadded one does, also split by experts
    plain, padded = (workloads.build("llama", **SMALL, mode="train", experts=4, top_k=2, capacity_factor=f)
                     for f in (1.0, factor))
    assert {n for n in padded.tensors if n not in plain.tensors} >= {"l0.moe_capacity.out", "l0.moe_crop.out"}
    ep = layout(padded, "all", Mesh((2, 2), 2), ("b", "e"))
    ins = random_inputs(plain, 3)
    a, b = execute(plain, ins), execute(ep, ins)
    outs = [n for n, t in plain.tensors.items() if t.role == "output"]
    assert len(outs) > 10
    for n in outs:
        np.testing.assert_allclose(np.asarray(b[n]), np.asarray(a[n]), rtol=1e-5, atol=1e-7, err_msg=n)


def test_a_capacity_factor_costs_what_the_buffer_holds():
    """The experts' FLOPs grow by the buffer's slots over the tokens (6 / 4), and an expert-parallel
    plan's step gets slower; a factor of 1 builds the program without padding, op for op."""
    from costmodel import evaluate

    flops = {}
    for f in (1.0, 1.5):
        g = workloads.build("llama", **SMALL, experts=4, top_k=2, capacity_factor=f)
        sig = g.signature(g.ops["l0.ff_down"])
        flops[f] = float(np.prod(sig.extents)) * sig.flops_per_point
    assert flops[1.5] / flops[1.0] == pytest.approx(6 / 4)
    big = dict(SMALL, d_model=1024, heads=8, d_ff=4096, seq=512, batch=8, vocab=64)
    steps = {f: workloads.build("llama", **big, mode="train", experts=4, top_k=2, capacity_factor=f)
             for f in (1.0, 1.5, 2.0)}
    assert steps[1.0].digest == workloads.build("llama", **big, mode="train", experts=4, top_k=2).digest
    ev = {f: evaluate(layout(g, "all", Mesh((2, 4), 4), ("b", "e")), "h100-sxm-8") for f, g in steps.items()}
    assert ev[2.0].makespan > 1.3 * ev[1.0].makespan
    # the all-to-alls carry the buffers: each half of a factor adds as many bytes
    moved = [ev[f].bytes_moved for f in (1.0, 1.5, 2.0)]
    assert moved[1] - moved[0] == pytest.approx(moved[2] - moved[1], rel=1e-9) and moved[1] > moved[0]


@pytest.mark.parametrize("params,field", [
    (dict(experts=4, capacity_factor=0.8), "capacity_factor 0.8 must be a number from 1"),
    (dict(experts=4, capacity_factor=100), "from 1 to 8"),
    (dict(capacity_factor=1.5), "needs experts"),
    (dict(experts=4, capacity_factor="big"), "capacity_factor must be a number"),
])
def test_capacity_factors_that_make_no_buffer_are_refused(params, field):
    with pytest.raises(workloads.WorkloadError, match=field):
        workloads.build("llama", **{**SMALL, **params})


@pytest.mark.slow  # 11 s of central differences: CI's test-slow runs it (each VJP is checked in make test)
def test_training_gradients_match_finite_differences():
    g = workloads.build("llama", layers=1, d_model=4, heads=2, d_ff=3, vocab=5, seq=4, batch=1, experts=4, top_k=2)
    assert fd_check(g, loss="cross_entropy") > 250  # every element of every parameter, the experts' included


def test_sharded_and_expert_parallel_plans_verify():
    step = workloads.build("llama", **SMALL, mode="train", experts=4, top_k=2)
    assert verify(random_walk(step, np.random.default_rng(0), 4, 25)).ok
    # the experts' dim split over a mesh axis: each device holds two experts' weights
    ep = layout(step, "all", Mesh((2, 2), 2), ("b", "e"))
    assert verify(ep).ok
    for name in ("l0.ff_gate", "l1.ff_down"):  # [e, b, c, f]: experts over axis 1, batch over axis 0
        sh = ep.ops[name].shards
        got = {(int(d), int(lo[0]), int(lo[1])) for d, lo in zip(sh.device, sh.lo)}
        assert got == {(0, 0, 0), (1, 2, 0), (2, 0, 1), (3, 2, 1)}, name
    # the experts' optimizer states: one expert a device (dim 0 over both axes, as ZeRO shards them)
    sh = ep.ops["l0_W_gate.update"].shards
    assert {(int(d), int(lo[0])) for d, lo in zip(sh.device, sh.lo)} == {(0, 0), (1, 1), (2, 2), (3, 3)}
    # attention: the expert axis acts as a batch axis; the batch of 2 is split already, so the
    # sequence takes it (q_proj's index [b, k, g, s, e])
    sh = ep.ops["l0.q_proj"].shards
    assert {(int(lo[0]), int(lo[3])) for lo in sh.lo} == {(0, 0), (0, 4), (1, 0), (1, 4)}


def test_the_expert_axis_goes_to_the_experts_when_their_tokens_cannot_take_it():
    """8 experts with 4 tokens each per sequence, batch 2, on 2 x 8: the dispatch cannot split its
    tokens (4) or batch (2, taken) 8 ways, so the expert axis lands on its model dim. The experts'
    GEMMs took that as a reduction split (partial sums over d, each device holding every expert's
    weights in part); they now split their experts (an all-to-all before them), as ``e`` means."""
    from ir.layout_describe import describe_op

    step = workloads.build("llama", **{**SMALL, "seq": 16}, mode="train", experts=8, top_k=2)
    mesh = Mesh((2, 8), 8)
    ep = layout(step, "all", mesh, ("b", "e"))
    assert describe_op(ep, "l1.moe_dispatch", mesh).startswith("d1/2 over n0 · d3/8 over g0")
    for name in ("l0.ff_gate", "l1.ff_up", "l1.ff_down"):
        assert describe_op(ep, name, mesh).startswith("e/8 over g0 · b/2 over n0"), name
    assert verify(ep).ok


@pytest.mark.parametrize("params,field", [
    (dict(experts=3, top_k=2, seq=8), "seq * top_k"),  # 16 tokens' choices over 3 experts
    (dict(experts=4, top_k=5), "top_k"),
    (dict(experts=0), "experts"),
])
def test_parameters_without_balanced_routing_are_refused(params, field):
    with pytest.raises(workloads.WorkloadError, match=field.replace("*", r"\*")):
        workloads.build("llama", **{**SMALL, **params})


def test_mixtral_preset():
    from ir.model_presets import PRESETS

    p = PRESETS["mixtral-8x7b"]
    assert (p.layers, p.d_model, p.heads, p.kv_heads, p.d_ff, p.experts, p.top_k) == (32, 4096, 32, 8, 14336, 8, 2)
    g = workloads.build("llama", preset="mixtral-8x7b", layers=2, seq=64, batch=1)
    n = sum(int(np.prod(t.shape)) for t in g.tensors.values() if t.role == "parameter")
    # 2 layers of 8 experts' 3 x 4096 x 14336 weights, attention (GQA 8 kv heads), router, norms, embeddings
    per_layer = 8 * 3 * 4096 * 14336 + 4096 * (4096 + 2 * 1024 + 4096) + 4096 * 8 + 2 * 4096
    assert n == 2 * per_layer + 2 * 32000 * 4096 + 4096


def test_expert_parallel_baseline_only_for_experts():
    from optimizer.search.baselines import baselines

    moe = workloads.build("llama", **SMALL, mode="train", experts=4, top_k=2)
    dense = workloads.build("llama", **SMALL, mode="train")
    got = baselines(moe, 8, 4)
    assert "dp2-ep4" in got and "dp2-ep4" not in baselines(dense, 8, 4)
    assert verify(got["dp2-ep4"]).ok
    # inside each node of 4, every device holds one expert's GEMMs, both nodes alike
    sh = got["dp2-ep4"].ops["l1.ff_up"].shards
    assert sorted((int(d), int(lo[0])) for d, lo in zip(sh.device, sh.lo)) == [(i, i % 4) for i in range(8)]


def test_layout_draws_take_the_expert_use_only_for_experts():
    """Dense programs draw ``b``/``s``/``t`` exactly as before (same random stream); mixtures
    draw ``e`` too."""
    from optimizer.search.layouts import draw_layout

    dense = workloads.build("llama", **SMALL, mode="train")
    moe = workloads.build("llama", **SMALL, mode="train", experts=4, top_k=2)
    uses = {name: set() for name in ("dense", "moe")}
    for name, g in (("dense", dense), ("moe", moe)):
        rng = np.random.default_rng(0)
        for _ in range(200):
            uses[name].update(draw_layout(g, rng, 16, 8).use.split("."))
    assert uses["dense"] == {"b", "s", "t"} and uses["moe"] == {"b", "s", "t", "e"}


def test_mixtral_campaign_config_builds():
    from pathlib import Path

    from optimizer.campaign.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "mixtral-train-h100x64.yaml")
    params = {**cfg.workload.params, "layers": 2, "seq": 64, "batch": 1, "dtype": "float32"}
    g = workloads.build(cfg.workload.name, **params)
    assert g.tensors["l1_W_gate"].shape == (8, 4096, 14336) and "l1_W_gate.m.next" in g.tensors
    rack = load_config(Path(__file__).resolve().parents[2] / "configs" / "mixtral-train-gb200-nvl72.yaml")
    assert rack.hardware == "gb200-nvl72"
    params = {**rack.workload.params, "layers": 2, "seq": 64, "batch": 1, "dtype": "float32"}
    g = workloads.build(rack.workload.name, **params)
    assert g.tensors["l1.moe_dispatch.out"].shape == (8, 1, 20, 4096)  # 16 tokens an expert, 20 slots
