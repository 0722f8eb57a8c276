"""``optimizer.realrun.measurement``: shard, transfer and plan timings with predictions, stored."""

from __future__ import annotations

import pytest

from costmodel.evaluate import serial_prediction
from costmodel.lowering import Lowerer
from costmodel.presets import PRESETS
from costmodel.transfers import transfer_plan
from optimizer.realrun.measurement import measure_plan, store_measurements
from storage import Archive


def test_records_carry_predictions_and_go_into_the_archive(plans, tmp_path):
    g = plans.spread_plan("mlp", 1)
    hw = PRESETS["h100-sxm-8"]
    recs = measure_plan(g, hw, backend="numpy", repeats=2)
    kinds = [r["kind"] for r in recs]
    n_transfers = kinds.count("transfer")
    assert kinds.count("shard") == g.n_shards and kinds.count("plan") == 1 and n_transfers > 0
    assert all(r["measured_seconds"] > 0 and r["predicted_seconds"] > 0 for r in recs)
    assert all(r["plan_digest"] == g.digest and r["backend"] == "numpy" for r in recs)
    low = Lowerer(hw).lower(g)
    nc = int(low.op_offsets[-1])
    shards = [r for r in recs if r["kind"] == "shard"]
    assert [r["predicted_seconds"] for r in shards] == pytest.approx(list(low.dur[:nc]))
    transfers = [r for r in recs if r["kind"] == "transfer"]
    assert [r["predicted_seconds"] for r in transfers] == pytest.approx(list(low.dur[nc:] + low.lat[nc:]))  # occupancy + link latency
    plan = recs[-1]
    assert plan["kind"] == "plan" and plan["verified"] is True and plan["max_rel_error"] < 1e-4
    assert plan["predicted_seconds"] == pytest.approx(serial_prediction(g, hw))
    assert plan["predicted_seconds"] == pytest.approx(float(low.dur[:nc].sum()))

    url = tmp_path / "m.db"
    with Archive.open(url) as a:  # measurements need no campaign
        assert store_measurements(a, recs) == len(recs)
    assert store_measurements(str(url), recs[:1]) == 1  # by path, too
    with Archive.open(url, readonly=True) as a:
        back = a.measurements()
    assert len(back) == len(recs) + 1
    assert [b["kind"] for b in back[:-1]] == kinds
    t = next(b for b in back if b["kind"] == "transfer")
    assert {"tensor", "src", "dst", "bytes"} <= set(t["details"]) and t["op"] in g.ops
    p = next(b for b in back if b["kind"] == "plan")
    assert p["verified"] and p["details"]["prediction"] == "serial" and p["predicted_seconds"] > 0


def test_plans_wider_than_the_hardware_use_one_bigger_node(plans):
    g = plans.spread_plan("mlp", 1)  # 4 plan devices on the 1-device cpu preset
    recs = measure_plan(g, "cpu", repeats=1, warmup=0)
    assert recs[-1]["verified"] and recs[-1]["details"]["n_devices"] == 4


def test_campaign_sampling_task_measures_and_predicts(plans):
    """``optimizer.realrun.sampling.measure_task`` (sampled executions in campaigns) runs and its
    prediction is the serial shard sum of the lowering (``serial_prediction``)."""
    import json

    from optimizer.realrun.sampling import MeasureTaskSpec, measure_task

    g = plans.spread_plan("mlp", 1)
    hw = PRESETS["cpu"]
    recs = measure_task(MeasureTaskSpec(g.digest, json.dumps(g.to_json()), "numpy", 1, hw.to_dict()))
    kinds = [r["kind"] for r in recs]
    assert kinds.count("plan") == 1 and kinds.count("shard") == g.n_shards
    assert kinds.count("transfer") == len(transfer_plan(g, 1 + max(g.devices)).transfers) > 0  # device-aware
    assert all(r["plan_digest"] == g.digest and r["measured_seconds"] > 0 for r in recs)
    m = recs[-1]
    assert m["kind"] == "plan" and m["verified"] and m["details"]["worker"]
    assert m["predicted_seconds"] == pytest.approx(serial_prediction(g, hw)) and m["predicted_seconds"] > 0
