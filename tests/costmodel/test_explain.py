"""``costmodel.explain``: per-op bounds, critical path, collectives, Gantt chart."""

from __future__ import annotations

import pytest

from costmodel import Evaluator
from costmodel.explain import explain, gantt
from costmodel.presets import PRESETS
from ir import workloads
from ir.builder import GraphBuilder
from ir.mesh import Mesh
from ir.rewrites import retile, unshard
from ir.rewrites.layout import layout

HW = PRESETS["h100-sxm-8"]


def test_bounds_by_hand():
    b = GraphBuilder("bfloat16")
    y = b.matmul(b.input("a", (4096, 4096)), b.parameter("w", (4096, 4096)), name="mm")  # compute-bound
    b.relu(y, name="act")  # memory-bound
    r = explain(Evaluator(HW), b.build())
    ops = {o["op"]: o for o in r["ops"]}
    assert ops["mm"]["bound"] == "compute" and ops["act"]["bound"] == "memory"
    # at the H100 GEMM curve's efficiency for one 4096^2 x 4096 shard (it read 100% of the peak, so a
    # 31.6 us shard showed a 503 ns FLOP time), and it is the shard's time less its launch
    from costmodel.efficiency import curves_for, gemm_efficiency

    eff = float(gemm_efficiency(4096 * 4096, 4096, curves_for(HW)))
    assert 0.5 < eff < 0.9
    assert ops["mm"]["flop_s"] == pytest.approx(2 * 4096**3 / (989.4e12 * eff))
    assert ops["mm"]["flop_s"] + HW.launch_overhead_for("matmul") == pytest.approx(ops["mm"]["compute_s"])
    assert [p["what"] for p in r["critical_path"]] == ["mm", "act"]
    assert r["critical_path"][-1]["finish"] == pytest.approx(r["makespan"])
    assert r["collectives"] == []


def test_training_plan_lists_its_collectives_and_draws(tmp_path):
    g = workloads.build("mlp", batch=64, widths=[256, 1024, 256], mode="train", optimizer="sgd")
    p = layout(unshard(g), "all", Mesh((8,), 8), ("b",))
    r = explain(Evaluator(HW), p)
    kinds = {c["kind"] for c in r["collectives"]}
    assert {"reduce_scatter", "all_gather"} <= kinds
    assert all(c["ranks"] == 8 and c["nodes"] == 1 and c["algorithm"] == "ring" for c in r["collectives"])
    assert sum(r["bounds"].values()) == len(p.ops)
    for suffix in ("png", "svg"):
        out = gantt(r["evaluation"], tmp_path / f"g.{suffix}")
        assert out.stat().st_size > 1000


def test_each_replica_s_collective_is_counted_once_per_row():
    """Megatron TP8 inside each of 8 nodes x DP8: each tensor-parallel all-gather and
    reduce-scatter runs in every node on its own (8 ranks, one node, NVLink), listed once with
    a count of 8. (Eight heads: with four, TP8 splits the head dim and two tensors are reshuffled
    between layouts, all-to-alls.)"""
    from optimizer.search.baselines import megatron

    g = workloads.build("transformer", batch=8, seq=128, d_model=256, heads=8, d_ff=1024)
    r = explain(Evaluator(PRESETS["h100-sxm-64"]), megatron(g, 64))
    assert r["collectives"] and {c["kind"] for c in r["collectives"]} == {"all_gather", "reduce_scatter"}
    assert all((c["count"], c["ranks"], c["nodes"]) == (8, 8, 1) for c in r["collectives"])


def test_comm_bound_op():
    b = GraphBuilder()
    y = b.relu(b.input("x", (4096, 4096)), name="a")
    b.relu(y, name="b")
    g = retile(b.build(), "b", [1, 1], [1])  # b waits for 64 MB over NVLink and then reads it once
    r = explain(Evaluator(HW), g)
    ops = {o["op"]: o for o in r["ops"]}
    assert ops["b"]["bound"] == "comm" and ops["b"]["comm_s"] == pytest.approx(4 * 4096**2 / 450e9)
    assert [p["kind"] for p in r["critical_path"]] == ["compute", "transfer", "compute"]


def _gpt_step():
    return workloads.build("gpt", layers=2, d_model=256, heads=4, seq=64, batch=16, vocab=512, mode="train",
                           dtype="bfloat16")


def test_critical_path_accounts_for_the_whole_makespan():
    """Each node on the path is reached through what held it up: a data predecessor, or the node
    that held its device or ports last before it started. Walking data edges alone left 86% of a
    ZeRO-3 step's makespan as gaps (nodes that waited for their device)."""
    from optimizer.search.baselines import megatron, zero3

    for plan in (zero3(_gpt_step(), 8), megatron(_gpt_step(), 8)):
        r = explain(Evaluator(HW), plan)
        cp = r["critical_path"]
        assert cp[0]["start"] == pytest.approx(0.0, abs=1e-12)
        assert cp[-1]["finish"] == pytest.approx(r["makespan"])
        gaps = sum(max(0.0, b["start"] - a["finish"]) for a, b in zip(cp, cp[1:]))
        assert gaps < 0.01 * r["makespan"]


def test_explain_with_a_reused_evaluator_lists_the_plan_s_own_collectives():
    """The lowering's cache hit on an earlier plan made it the most recent state, so the
    collectives listed were those of the plan evaluated last."""
    from optimizer.search.baselines import megatron, zero3

    a, b = zero3(_gpt_step(), 8), megatron(_gpt_step(), 8)
    ev = Evaluator(HW)
    ev(a)
    ev(b)
    key = lambda r: sorted((c["tensor"], c["kind"], c["count"]) for c in r["collectives"])  # noqa: E731
    assert key(explain(ev, a)) == key(explain(Evaluator(HW), a)) != key(explain(Evaluator(HW), b))
