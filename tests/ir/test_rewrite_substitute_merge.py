"""merge_matmuls / split_matmuls: contractions sharing an input as one over concatenated weights."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import verify
from ir import workloads
from ir.autodiff import training_step
from ir.builder import GraphBuilder
from ir.folding import folded_ops
from ir.rewrites import (RewriteError, fuse_attention, merge_matmuls, parse_move, place, random_rewrite, split,
                         split_matmuls, split_reduction, unshard)
from ir.rewrites.substitute_merge import merge_sites, merged_matmuls
from ir.serialize import dumps, loads
from ir.validate import validate

QKV = "q_proj+k_proj+v_proj"


def assert_equivalent(h, g):
    issues = validate(h)
    assert issues == [], "\n".join(map(str, issues))
    rep = verify(h, reference=g)
    assert rep.ok, str(rep)


def test_qkv_becomes_one_einsum_and_back(kit):
    g = kit.small("transformer")
    assert merge_sites(g) == [("q_proj", "k_proj", "v_proj"), ("q_proj", "k_proj"), ("q_proj", "v_proj"),
                              ("k_proj", "v_proj")]
    h = merge_matmuls(g, ["q_proj", "k_proj", "v_proj"])
    m = h.ops[QKV]
    assert m.kernel == "einsum" and h.tensors[f"{QKV}.out"].shape == (2, 6, 6, 4)  # [b, 3h, s, e]
    assert h.tensors[f"{QKV}.wcat2.out"].shape == (8, 6, 4)  # Wq|Wk|Wv along the heads
    assert [h.ops[n].kernel for n in ("q_proj", "k_proj", "v_proj")] == ["slice"] * 3
    assert h.ops["v_proj"].params == {"axis": 1, "start": 4, "stop": 6, "step": 1}
    assert h.topo_order == tuple(h.ops)  # the merged op before its slices: op order is program order
    assert_equivalent(h, g)
    assert split_matmuls(h, QKV).digest == g.digest
    assert unshard(h).digest == g.digest
    assert loads(dumps(h)).digest == h.digest
    # The attention pattern still matches on the sliced q, k, v.
    assert_equivalent(fuse_attention(h, "attn_qk"), g)


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(["gpt", "llama"]), seq=st.integers(2, 5), kv=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**32 - 1))
def test_kv_and_gate_up_on_random_shapes(name, seq, kv, seed):
    g = workloads.build(name, batch=2, seq=seq, d_model=16, heads=2, kv_heads=kv, d_ff=24, vocab=20)
    every = merge_sites(g)
    sites = [s for s in every if not any(set(s) < set(t) for t in every)]  # the largest groups
    assert sites  # k+v in every layer (q has group dims), gate+up in llama
    h = g
    for s in sites:
        h = merge_matmuls(h, s)
    rng = np.random.default_rng(seed)
    merged = merged_matmuls(h)
    assert sorted(merged) == sorted("+".join(s) for s in sites)
    n = merged[int(rng.integers(len(merged)))]
    h = place(split(h, n, h.signature(n).dims[0], 2), n, [0, 1])  # a merged op shards like any einsum
    assert_equivalent(h, g)
    assert unshard(h).digest == g.digest


def test_refusals_name_the_reason(kit):
    g = kit.small("transformer")
    with pytest.raises(RewriteError, match="at least two"):
        merge_matmuls(g, ["q_proj"])
    with pytest.raises(RewriteError, match="no shared input"):
        merge_matmuls(_two_inputs(), ["p", "q"])
    with pytest.raises(RewriteError, match="is not a plain"):
        merge_matmuls(g, ["q_proj", "attn_softmax"])
    with pytest.raises(RewriteError, match="is not a plain"):
        merge_matmuls(split_reduction(g, "k_proj", 2), ["q_proj", "k_proj"])
    with pytest.raises(RewriteError, match="not parameters"):
        merge_matmuls(_activation_weights(), ["p", "q"])
    with pytest.raises(RewriteError, match="differ in kernel or params"):  # grouped q has other letters than k
        merge_matmuls(workloads.build("llama", batch=2, seq=4, d_model=16, heads=4, kv_heads=2, d_ff=24, vocab=20),
                      ["l0.q_proj", "l0.k_proj"])
    b = GraphBuilder()
    x = b.input("x", (3, 4))
    b.matmul(x, b.parameter("A", (4, 5)), name="p")
    b.matmul(x, b.parameter("B", (4, 6)), name="q")
    with pytest.raises(RewriteError, match="differ in shape"):
        merge_matmuls(b.build(), ["p", "q"])
    with pytest.raises(RewriteError, match="not a merged contraction"):
        split_matmuls(g, "q_proj")


def _two_inputs():
    b = GraphBuilder()
    x, y = b.input("x", (3, 4)), b.input("y", (3, 4))
    b.matmul(x, b.parameter("A", (4, 5)), name="p")
    b.matmul(y, b.parameter("B", (4, 5)), name="q")
    return b.build()


def _activation_weights():
    b = GraphBuilder()
    x = b.input("x", (3, 4))
    b.matmul(x, b.input("A", (4, 5)), name="p")
    b.matmul(x, b.input("B", (4, 5)), name="q")
    return b.build()


def test_moves_search_training_and_cost(kit):
    g = kit.small("transformer")
    m = parse_move("merge_matmuls{ops=[q_proj,k_proj,v_proj]}")
    assert str(m) == "merge_matmuls{ops=[q_proj,k_proj,v_proj]}"
    h = m.apply(g)
    assert parse_move(f"split_matmuls{{op={QKV}}}").apply(h).digest == g.digest
    for seed in range(4):  # a group or a pair of its ops, stacked along h or e
        h2, move = random_rewrite(g, np.random.default_rng(seed), 2, weights={"merge_matmuls": 1.0})
        assert move.ops in merge_sites(g) and move.along in ("h", "e")
        assert parse_move(str(move)) == move
        assert_equivalent(h2, g)
    # Training through the concat and slices gives the unmerged step's gradients (lr 1: full size).
    ref = training_step(g, optimizer_params={"lr": 1.0})
    assert_equivalent(training_step(h, optimizer_params={"lr": 1.0}), ref)


def test_kv_stacked_per_head_keeps_the_layout_and_verifies(kit):
    g = kit.small("transformer")
    for op in ("k_proj", "v_proj"):  # both split over the batch and the heads, alike
        g = place(split(split(g, op, "b", 2), op, "h", 2), op, [0, 1, 2, 3])
    h = merge_matmuls(g, ["k_proj", "v_proj"], along="e")
    m = h.ops["k_proj+v_proj"]
    assert h.tensors["k_proj+v_proj.out"].shape == (2, 2, 6, 8)  # [b, h, s, 2e]: each head's k then its v
    assert m.shards.device.tolist() == [0, 1, 2, 3]  # the layout of k and v, each shard twice as wide in e
    assert (m.shards.hi[:, 3] == 8).all() and (m.shards.lo[:, :3] == g.ops["k_proj"].shards.lo[:, :3]).all()
    assert h.ops["v_proj"].params == {"axis": 3, "start": 4, "stop": 8, "step": 1}
    assert_equivalent(h, g)
    assert split_matmuls(h, "k_proj+v_proj").digest == g.digest
    with pytest.raises(RewriteError, match="cannot stack along 's'"):
        merge_matmuls(g, ["k_proj", "v_proj"], along="s")


def test_the_stacked_weight_is_folded_and_the_slices_are_views():
    from costmodel import Evaluator
    from costmodel.efficiency import curves_for, gemm_time
    from costmodel.presets import preset

    hw = preset("h100-sxm-8")
    ev = Evaluator(hw)
    b_, s_, d, heads, e = 8, 1024, 1024, 16, 64
    big = workloads.build("transformer", batch=b_, seq=s_, d_model=d, heads=heads, d_ff=4096, dtype="bfloat16")
    h = merge_matmuls(big, ["k_proj", "v_proj"], along="e")
    a, b = ev(big, keep=True), ev(h, keep=True)
    low = b.lowered
    # the concat of the weights runs once, at load time (ir.folding): no node; the slices are views
    assert "k_proj+v_proj.wcat1" not in low.op_names
    off = low.op_offsets
    dur = {n: low.dur[off[i]:off[i + 1]].sum() for i, n in enumerate(low.op_names)}
    assert dur["k_proj"] == dur["v_proj"] == 0.0
    # one GEMM of [b·s, d] x [d, heads·2e] (everything whole on one device: the step is serial)
    kv = gemm_time(b_ * s_, heads * 2 * e, d, "bfloat16", hw, curves_for(hw))
    assert dur["k_proj+v_proj"] == pytest.approx(kv, rel=1e-9)
    old = {n: a.lowered.dur[a.lowered.op_offsets[i]:a.lowered.op_offsets[i + 1]].sum()
           for i, n in enumerate(a.lowered.op_names)}
    assert b.makespan - a.makespan == pytest.approx(kv - old["k_proj"] - old["v_proj"], rel=1e-9)
    assert b.lower_bound == a.lower_bound  # the same program
    # in a training step the weights change every step: nothing folds, the concat runs in it
    assert folded_ops(h) == ("k_proj+v_proj.wcat1",) and folded_ops(training_step(h)) == ()


def test_a_training_step_of_a_merged_program_keeps_its_merge():
    """``training_step`` of a program with merged q, k, v differentiates the merged op: its backward
    reads the stacked weights. ``unshard`` split the merge anyway and failed (KeyError on the
    concat's output), and with it ``evaluate``; the merge is that program's own now."""
    from costmodel import evaluate
    from ir.autodiff import training_step
    from ir.rewrites import split, split_matmuls, unshard
    from ir.rewrites.errors import RewriteError
    from ir.rewrites.substitute_merge import merged_matmuls

    g = workloads.build("transformer", batch=2, seq=6, d_model=8, heads=2, d_ff=12)
    step = training_step(merge_matmuls(g, ["q_proj", "k_proj", "v_proj"]))
    assert merged_matmuls(step) == []
    with pytest.raises(RewriteError, match="stacked weights are read by"):
        split_matmuls(step, "q_proj+k_proj+v_proj")
    assert unshard(step).digest == step.digest
    plan = split(step, "q_proj+k_proj+v_proj", "b", 2)
    assert unshard(plan).digest == step.digest
    assert evaluate(plan, "h100-sxm-8").makespan > 0
    assert verify(plan, reference=training_step(g)).ok  # the same step as the unmerged program's


def test_rewrites_that_recomputed_copies_would_break_are_refused():
    """Sequences that made plans ``unshard`` could not undo (a KeyError in every evaluation) or
    invalid plans now stop at the rewrite that would break them, naming the way round."""
    from ir.rewrites import unshard

    g = workloads.build("gpt", mode="train", optimizer="sgd", layers=1, d_model=8, heads=2, vocab=10, seq=4, batch=4)
    r = parse_move("recompute{prefix=l0.}").apply(g)
    for move, why in (("merge_matmuls{ops=[l0.k_proj.re,l0.v_proj.re],along=e}", "is a recomputed copy"),
                      ("fuse_attention{op=l0.attn_qk}", "l0.v_proj.re is a recomputed copy"),
                      ("split_reduction{op=l0.o_proj.re,parts=2,reduction=k}; unrecompute{op=l0.o_proj}",
                       "copy's reduction is split")):
        with pytest.raises(RewriteError, match=why):
            parse_move(move).apply(r)
    assert "l0.k_proj.re" not in {n for site in merge_sites(r) for n in site}
    d = parse_move("split_reduction{op=l0.o_proj,parts=2}; fuse{producer=l0.o_proj.acc,consumer=l0.resid1}; "
                   "recompute{prefix=l0.}").apply(g)
    with pytest.raises(RewriteError, match="has a recomputed copy"):
        parse_move("unfuse{op=l0.o_proj.acc+l0.resid1}").apply(d)
    assert unshard(d).digest == unshard(g).digest
    # a recomputed accumulate: its copy reads the partials beside the original (unshard merged
    # only the last split reduction and returned a program with accumulate ops left in it)
    a = parse_move("split_reduction{op=l0.q_proj,parts=4,reduction=d}; recompute{op=l0.q_proj.acc}; "
                   "split_reduction{op=l0.ff2.dW,parts=2}").apply(g)
    u = unshard(a)
    assert u.digest == unshard(g).digest and not any(o.kernel == "accumulate" for o in u.ops.values())
    # a layout's split reductions, the accumulate fused, everything recomputed: unshard raised
    e = parse_move("layout{ops=all,mesh=2x2x2,use=t.s.s,node=4}; fuse{producer=l0.o_proj.acc,consumer=l0.resid1}; "
                   "recompute{prefix=l0.}").apply(g)
    assert unshard(e).digest == unshard(g).digest
