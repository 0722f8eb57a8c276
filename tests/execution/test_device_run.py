"""Device-aware execution: one buffer set per plan device; only planned boxes move."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from costmodel.transfers import transfer_plan
from executor.device_run import IncompleteCommunication, run_on_devices
from executor.run import execute


@pytest.mark.parametrize("name", ["mlp", "transformer", "convnet"])
@pytest.mark.parametrize("seed", range(3))
def test_equals_the_shard_by_shard_executor(plans, name, seed):
    g = plans.spread_plan(name, seed) if seed % 2 else plans.random_plan(name, seed, 4)
    assert len(g.devices) > 1
    tp = transfer_plan(g, 4)
    res = run_on_devices(g, tp.transfers, tp.residency)
    ref = execute(g)
    assert set(res.outputs) == {n for n, t in g.tensors.items() if t.role == "output"}
    for n, a in res.outputs.items():
        assert np.array_equal(a, ref[n]), n  # same shards, same order: bit-identical


def test_plain_data_from_json_works(plans):
    import json

    g = plans.spread_plan("mlp", 1)
    doc = json.loads(json.dumps(transfer_plan(g, 4).to_json()))  # boxes as nested lists
    res = run_on_devices(g, doc["transfers"], doc["residency"])
    assert np.array_equal(res.outputs["fc2.out"], execute(g)["fc2.out"])


@pytest.mark.parametrize("name", ["mlp", "transformer", "convnet"])
def test_dropping_any_transfer_fails_loudly(plans, name):
    g = plans.spread_plan(name, 1)
    tp = transfer_plan(g, 4)
    assert len(tp.transfers) >= 5
    for j, dropped in enumerate(tp.transfers):
        with pytest.raises(IncompleteCommunication) as ei:
            run_on_devices(g, tp.transfers[:j] + tp.transfers[j + 1:], tp.residency)
        e = ei.value
        assert e.tensor == dropped["tensor"] and e.device == dropped["dst"]
        assert e.op in g.ops and 0 <= e.shard < len(g.ops[e.op].shards)
        lo, hi = e.box
        assert any(all(max(a, c) < min(b, d) for a, b, c, d in zip(lo, hi, blo, bhi))
                   for blo, bhi in dropped["boxes"]), "the missing box overlaps what the dropped transfer carried"
        for word in (repr(e.op), f"shard {e.shard}", f"device {e.device}", repr(e.tensor)):
            assert word in str(e)


def test_shrinking_one_box_fails_loudly(plans):
    g = plans.spread_plan("convnet", 1)
    tp = transfer_plan(g, 4)
    for j in range(len(tp.transfers)):
        cut = copy.deepcopy(tp.transfers)
        lo, hi = cut[j]["boxes"][0]
        d = next(k for k in range(len(lo)) if hi[k] - lo[k] >= 1)
        hi = tuple(h - (k == d) for k, h in enumerate(hi))  # one slab of cells fewer
        cut[j]["boxes"][0] = (lo, hi)
        with pytest.raises(IncompleteCommunication):
            run_on_devices(g, cut, tp.residency)


def test_missing_residency_fails_loudly(plans):
    g = plans.spread_plan("transformer", 1)
    tp = transfer_plan(g, 4)
    for j, r in enumerate(tp.residency):
        with pytest.raises(IncompleteCommunication) as ei:
            run_on_devices(g, tp.transfers, tp.residency[:j] + tp.residency[j + 1:])
        assert ei.value.tensor == r["tensor"] and ei.value.device == r["device"]
    # a residency box cut short fails too
    cut = copy.deepcopy(tp.residency)
    lo, hi = cut[0]["boxes"][0]
    cut[0]["boxes"][0] = (lo, tuple(h - (k == 0) for k, h in enumerate(hi)))
    with pytest.raises(IncompleteCommunication):
        run_on_devices(g, tp.transfers, cut)


def test_a_transfer_of_cells_its_source_lacks_fails(plans):
    g = plans.spread_plan("mlp", 1)
    tp = transfer_plan(g, 4)
    bad = copy.deepcopy(tp.transfers)
    t = bad[0]
    t["src"] = next(d for d in range(4) if d not in (t["src"], t["dst"]))
    with pytest.raises(IncompleteCommunication, match="transfer"):
        run_on_devices(g, bad, tp.residency)


def test_malformed_transfers_are_refused(plans):
    g = plans.spread_plan("mlp", 1)
    tp = transfer_plan(g, 4)
    with pytest.raises(ValueError, match="producer op 'nope'"):
        run_on_devices(g, [{**tp.transfers[0], "producer": "nope"}], tp.residency)
    with pytest.raises(ValueError, match="moves tensor"):
        run_on_devices(g, [{**tp.transfers[0], "tensor": "x"}], tp.residency)


def test_timing_gives_one_positive_time_per_shard_and_transfer(plans):
    g = plans.spread_plan("transformer", 1)
    tp = transfer_plan(g, 4)
    res = run_on_devices(g, tp.transfers, tp.residency, timing=True, repeats=2, warmup=1)
    assert [(s["op"], s["shard"]) for s in res.shards] == [
        (n, i) for n in g.topo_order for i in range(len(g.ops[n].shards))]
    assert all(s["seconds"] > 0 and s["gpu"] is None for s in res.shards)
    assert len(res.transfers) == len(tp.transfers)
    assert [t["index"] for t in sorted(res.transfers, key=lambda t: t["index"])] == list(range(len(tp.transfers)))
    assert all(t["seconds"] > 0 for t in res.transfers)
    assert res.plan_seconds > 0 and res.repeats == 2
    assert res.plan_seconds >= 0.5 * sum(s["seconds"] for s in res.shards)
    assert set(res.device_map) == set(range(4)) and set(res.device_map.values()) == {None}
    ref = execute(g)
    for n, a in res.outputs.items():
        assert np.array_equal(a, ref[n])
