"""Interleaved repeated passes (``optimizer.realrun.rounds``) and merging a plan's rounds
(``optimizer.realrun.measurement.merge_rounds``)."""

from __future__ import annotations

import pytest

import optimizer.realrun.rounds as rounds_mod
from costmodel.presets import PRESETS
from optimizer.realrun.calibration import kernel_spread
from optimizer.realrun.measurement import measure_plan, merge_rounds, plan_predictions
from optimizer.realrun.rounds import measure_rounds


def _round(digest: str, shard_s: list[float], transfer_s: list[float], gap: float, verified: bool = True,
           err: float = 1e-6) -> list[dict]:
    recs = [{"plan_digest": digest, "kind": "shard", "op": "a", "shard": i, "measured_seconds": s, "details": {}}
            for i, s in enumerate(shard_s)]
    recs += [{"plan_digest": digest, "kind": "transfer", "op": "a", "shard": 0, "measured_seconds": s,
              "details": {"index": i}} for i, s in enumerate(transfer_s)]
    recs.append({"plan_digest": digest, "kind": "plan", "measured_seconds": sum(shard_s) + sum(transfer_s) + gap,
                 "verified": verified, "max_rel_error": err,
                 "details": {"gap_seconds": gap, "wall_median_seconds": 1.0}})
    return recs


def test_merge_takes_the_least_disturbed_figure_of_every_item():
    r1 = _round("p", [3.0, 1.0], [0.5], gap=0.2)
    r2 = _round("p", [2.0, 4.0], [0.25], gap=0.1, err=2e-6)
    r3 = _round("p", [5.0, 1.5], [0.75], gap=0.4)
    m = merge_rounds([r1, r2, r3], "min")
    assert [r["measured_seconds"] for r in m if r["kind"] == "shard"] == [2.0, 1.0]
    assert [r["measured_seconds"] for r in m if r["kind"] == "transfer"] == [0.25]
    plan = m[-1]
    assert plan["measured_seconds"] == pytest.approx(2.0 + 1.0 + 0.25 + 0.2)  # + the median gap
    assert plan["details"]["rounds"] == 3 and plan["verified"] is True and plan["max_rel_error"] == 2e-6
    med = merge_rounds([r1, r2, r3], "median")
    assert [r["measured_seconds"] for r in med if r["kind"] == "shard"] == [3.0, 1.5]
    assert r1[0]["measured_seconds"] == 3.0  # the inputs are left as they were
    assert merge_rounds([r1, _round("p", [1, 1], [1], 0.0, verified=False)], "min")[-1]["verified"] is False


def test_merge_refuses_rounds_of_different_plans():
    with pytest.raises(ValueError, match="not measurements of one plan"):
        merge_rounds([_round("p", [1.0], [], 0.0), _round("q", [1.0], [], 0.0)])
    with pytest.raises(ValueError, match="not measurements of one plan"):
        merge_rounds([_round("p", [1.0], [], 0.0), _round("p", [1.0, 2.0], [], 0.0)])


def test_rounds_visit_every_item_once_per_round_in_a_fresh_order(monkeypatch, plans):
    """Each round times every kernel point and plan once, in a new shuffled order; an item keeps
    the minimum over its rounds."""
    calls: list[str] = []
    seen: dict[str, int] = {}

    def visit(key: str) -> int:
        calls.append(key)
        seen[key] = seen.get(key, 0) + 1
        return seen[key]

    def fake_time_ops(g, backend, repeats, warmup, statistic):
        (name,) = g.topo_order
        return {name: [3.0, 1.0, 2.0][visit(str(id(g))) - 1]}

    def fake_measure_plan(g, hw, backend, repeats, warmup, statistic):
        return _round(g.digest, [[9.0, 8.0, 7.0][visit(g.digest) - 1]], [], gap=0.0)

    monkeypatch.setattr(rounds_mod, "time_ops", fake_time_ops)
    monkeypatch.setattr(rounds_mod, "measure_plan", fake_measure_plan)
    cases = kernel_spread("numpy", quick=True)[:4]
    ps = [(i, plans.spread_plan("mlp", k)) for i, k in enumerate((1, 2, 3))]
    kernels, merged = measure_rounds(cases, ps, PRESETS["cpu"], rounds=3, seed=0)
    per_round = [calls[i * 7:(i + 1) * 7] for i in range(3)]
    assert len(calls) == 21 and all(len(set(r)) == 7 for r in per_round)
    assert len({tuple(r) for r in per_round}) == 3  # three different orders
    assert [k["rounds"] for k in kernels] == [3] * 4 and [k["case"] for k in kernels] == [c.name for c in cases]
    assert all(k["seconds"] == 1.0 for k in kernels)  # the minimum of its three rounds
    assert set(merged) == {0, 1, 2} and all(m[-1]["details"]["rounds"] == 3 for m in merged.values())
    assert all(m[-1]["measured_seconds"] == 7.0 for m in merged.values())
    with pytest.raises(ValueError, match="unique"):
        measure_rounds([], [(0, ps[0][1]), (0, ps[1][1])], PRESETS["cpu"])


def test_rounds_on_numpy_and_predictions_on_another_hardware(plans):
    g = plans.spread_plan("mlp", 1)
    cases = kernel_spread("numpy", quick=True)[:2]
    kernels, merged = measure_rounds(cases, [("p", g)], PRESETS["cpu"], rounds=2, repeats=1)
    assert len(kernels) == 2 and all(k["seconds"] > 0 and k["rounds"] == 2 for k in kernels)
    recs = merged["p"]
    assert recs[-1]["verified"] is True and recs[-1]["details"]["rounds"] == 2
    assert sum(r["kind"] == "shard" for r in recs) == g.n_shards
    # plan_predictions: the figures measure_plan stores, for any hardware
    hw = PRESETS["cpu"].with_efficiency({"matmul": (0.25, 0.5)})
    one = measure_plan(g, hw, "numpy", repeats=1)[-1]
    serial, with_t = plan_predictions(g, hw)
    assert serial == pytest.approx(one["predicted_seconds"])
    assert with_t == pytest.approx(one["details"]["serial_with_transfers"])
    assert with_t > serial  # this plan moves data between its devices
