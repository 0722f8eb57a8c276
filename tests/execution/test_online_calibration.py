"""Calibration inside campaigns (``optimizer.realrun.online``, ``Sampler.calibrate``): the refit
recovers known factors from synthetic shard timings, reports rank statistics that match their
closed forms, and a sampler stores its calibrated hardware in the archive (and, on the campaign's
own device kind, the re-scored front)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from costmodel.hardware_io import load_hardware
from costmodel.presets import PRESETS
from optimizer.realrun.online import plan_points, predict_plans, rank_stats, refit, same_kind, target_hardware
from storage import Archive


def _synthetic(truth, n_plans: int = 12, seed: int = 0) -> list[dict]:
    """Plan and shard records whose measured seconds are ``truth``'s roofline times exactly."""
    rng = np.random.default_rng(seed)
    recs = []
    for p in range(n_plans):
        digest = f"{p:064x}"
        total = 0.0
        for i in range(int(rng.integers(3, 9))):
            kc = ["matmul", "elementwise", "rowwise"][i % 3]
            if kc == "matmul":
                n = float(rng.choice([32, 64, 128, 256, 512]))
                flops, nbytes = 2 * n**3, 12 * n * n
            else:
                e = float(rng.choice([1e3, 1e4, 1e5, 1e6]))
                flops, nbytes = 2 * e, 12 * e
            t = float(truth.shard_time(flops, nbytes, "float32", kc))
            total += t
            recs.append({"plan_digest": digest, "kind": "shard", "op": f"op{i}", "shard": 0, "measured_seconds": t,
                         "details": {"kernel_class": kc, "dtype": "float32", "flops": flops, "bytes": nbytes}})
        recs.append({"plan_digest": digest, "kind": "plan", "measured_seconds": total, "predicted_seconds": 1.0,
                     "details": {}})
    return recs


def test_rank_stats_closed_forms():
    m = [1.0, 2.0, 3.0, 4.0]
    assert rank_stats(m, m) == {"n": 4, "spearman": pytest.approx(1.0), "mean_abs_log": pytest.approx(0.0)}
    s = rank_stats([2 * x for x in m], m)  # twice too slow, same order
    assert s["spearman"] == pytest.approx(1.0) and s["mean_abs_log"] == pytest.approx(math.log(2))
    assert rank_stats([4.0, 3.0, 2.0, 1.0], m)["spearman"] == pytest.approx(-1.0)
    assert rank_stats([1.0, 2.0], [1.0, 2.0])["spearman"] is None  # fewer than 3 points
    assert rank_stats([], []) == {"n": 0, "spearman": None, "mean_abs_log": None}


def test_refit_recovers_the_generating_factors():
    base = load_hardware("cpu")
    truth = base.with_efficiency({"matmul": (0.4, 1.0), "elementwise": (1.0, 0.3), "rowwise": (1.0, 0.5)},
                                 launch_overhead_by_class={"matmul": 60e-6, "elementwise": 30e-6, "rowwise": 45e-6})
    recs = _synthetic(truth)
    res = refit(recs, base)
    assert res["plans"] == 12 and res["shards"] == sum(1 for r in recs if r["kind"] == "shard")
    cal = res["hardware"]
    assert cal.efficiency_for("matmul")[0] == pytest.approx(0.4, rel=1e-3)
    assert cal.efficiency_for("elementwise")[1] == pytest.approx(0.3, rel=1e-3)
    assert cal.launch_overhead_for("rowwise") == pytest.approx(45e-6, rel=1e-3)
    assert res["after"]["mean_abs_log"] < 1e-3 and res["after"]["spearman"] == pytest.approx(1.0)
    assert res["before"]["mean_abs_log"] > 0.3  # the preset is far from the generating factors
    # predictions after the refit are the measured plan times
    pts = plan_points(recs)
    assert predict_plans(pts, cal) == pytest.approx([p["measured"] for p in pts], rel=1e-3)
    # held out: plans not in the previous fit, predicted with the previous hardware
    res2 = refit(recs, base, previous=cal, previous_digests=[p["digest"] for p in pts[:8]])
    assert res2["held_out"]["n"] == 4 and res2["held_out"]["mean_abs_log"] < 1e-3


def test_refit_ignores_records_without_shard_work():
    recs = [{"plan_digest": "a" * 64, "kind": "plan", "measured_seconds": 1.0, "details": {}},
            {"plan_digest": "a" * 64, "kind": "shard", "op": "x", "shard": 0, "measured_seconds": 1.0,
             "details": {"flops": 1.0}}]  # an old record: no kernel class
    assert refit(recs, load_hardware("cpu")) is None


def test_same_kind_and_target_hardware():
    cpu, h100 = load_hardware("cpu"), PRESETS["h100-sxm-8"]
    assert same_kind(cpu, cpu.replace(devices_per_node=4)) and not same_kind(cpu, h100)
    cal = h100.with_efficiency(matmul=(0.7, 0.9), launch_overhead_by_class={"matmul": 7e-6})
    big = PRESETS["h100-sxm-64"]
    t = target_hardware(big, cal)
    assert t.n_devices == 64 and t.efficiency_for("matmul") == (0.7, 0.9) and t.launch_overhead_for("matmul") == 7e-6


class _Farm:
    def __init__(self, graphs):
        self.graphs = graphs

    def front_members(self):
        return [{"digest": g.digest, "graph_json": json.dumps(g.to_json())} for g in self.graphs]


@pytest.mark.parametrize("target", ["h100-sxm-8", "cpu4"])
def test_sampler_stores_calibrations(plans, tmp_path, target):
    """Real NumPy executions of small plans, a refit every 3 plans, stored in the archive; when the
    campaign's hardware is the sampling device kind (cpu4: four cpu devices) the front is
    re-scored on the calibrated hardware too."""
    from optimizer.realrun.measurement import measure_plan
    from optimizer.realrun.sampling import Sampler

    cpu = load_hardware("cpu")
    tgt = cpu.replace(name="cpu4", devices_per_node=4) if target == "cpu4" else PRESETS[target]
    graphs = [plans.random_plan("mlp", s) for s in range(4)]

    class Done:  # a finished Dask future holding one sampled execution's records
        def __init__(self, g):
            self.records = measure_plan(g, cpu, repeats=1, warmup=0)

        def result(self):
            return self.records

        def release(self):
            pass

    with Archive.open(tmp_path / "a.db") as a:
        a.create_campaign("c", {"x": 1}, "h", ["makespan"], [1.0])
        s = Sampler("c", 1.0, "numpy", 60, 1, cpu.to_dict(), a, None, 0, calibrate_every=3, target_hw=tgt)
        for g in graphs[:3]:
            fut = Done(g)
            s.futures[fut] = g.digest
            s._store([fut])
        assert s.new_plans == 3 and len(s.window) == 3
        s._maybe_calibrate(_Farm(graphs[:2]))
        assert s.new_plans == 0 and s.last_cal is not None
        fut = Done(graphs[3])
        s.futures[fut] = graphs[3].digest
        s._store([fut])
        s._maybe_calibrate(_Farm(graphs[:2]))  # not due: 1 < 3
        assert s.new_plans == 1
        s._maybe_calibrate(_Farm(graphs[:2]), final=True)  # the campaign stops: refit with the new plan
        cals = a.calibrations("c")
        # a resumed sampler reads the window back once and knows nothing is new
        s2 = Sampler("c", 1.0, "numpy", 60, 1, cpu.to_dict(), a, None, 0, calibrate_every=3, target_hw=tgt)
        assert len(s2.window) == 4 and s2.new_plans == 0 and s2.last_cal is not None
    sampling = [c for c in cals if c["role"] == "sampling"]
    assert [c["plans"] for c in sampling] == [3, 4]
    rep = sampling[-1]["report"]
    assert rep["held_out"]["n"] == 1 and rep["before"]["n"] == 4 and len(rep["points"]) == 4
    assert rep["sampling_hardware"] == "cpu" and "matmul" in rep["factors"]
    assert load_hardware(sampling[-1]["hardware"]).device.name == cpu.device.name
    targets = [c for c in cals if c["role"] == "target"]
    if target == "cpu4":
        assert len(targets) == 2 and len(targets[-1]["report"]["front"]) == 2
        f = targets[-1]["report"]["front"][0]
        assert f["calibrated_makespan"] > 0 and f["makespan"] > 0
    else:
        assert targets == []


def test_archive_refuses_a_bad_calibration_role(tmp_path):
    from storage import InvalidRecord

    with Archive.open(tmp_path / "a.db") as a:
        a.create_campaign("c", {"x": 1}, "h", ["makespan"], [1.0])
        with pytest.raises(InvalidRecord, match="calibration role"):
            a.add_calibration("c", "other", 1, {}, {})
        assert a.calibrations("c") == []


def test_refit_finds_the_executors_time_between_shards():
    """Plan times = Σ shard times + D per shard (what the executor spends between shards): the
    refit recovers D and predicts the plans exactly."""
    base = load_hardware("cpu")
    truth = base.with_efficiency({"matmul": (0.4, 1.0), "elementwise": (1.0, 0.3), "rowwise": (1.0, 0.5)})
    recs = _synthetic(truth, n_plans=15, seed=1)
    D = 250e-6
    shards: dict[str, int] = {}
    for r in recs:
        if r["kind"] == "shard":
            shards[r["plan_digest"]] = shards.get(r["plan_digest"], 0) + 1
    for r in recs:
        if r["kind"] == "plan":
            r["measured_seconds"] += D * shards[r["plan_digest"]]
    res = refit(recs, base)
    assert res["dispatch"] == pytest.approx(D, rel=1e-3)
    assert res["after"]["mean_abs_log"] < 1e-3
    assert res["hardware"].launch_overhead_for("matmul") == pytest.approx(truth.launch_overhead_for("matmul") + D,
                                                                           rel=1e-3)


def test_status_and_summary_text_say_what_the_figures_mean():
    from optimizer.campaign.fidelity import markdown, meaning, status_lines

    pts = [{"digest": f"{i:064x}", "measured": 0.1 * (i + 1), "before": 0.01 * (i + 1), "after": 0.1 * (i + 1)}
           for i in range(4)]
    rep = {"sampling": {"plans": 4, "shards": 20, "sampling_hardware": "cpu", "points": pts, "dispatch": 1e-3,
                        "before": {"n": 4, "spearman": 1.0, "mean_abs_log": math.log(10)},
                        "after": {"n": 4, "spearman": 0.95, "mean_abs_log": 0.05}, "held_out": None,
                        "factors": {"matmul": {"compute": 0.5, "memory": 1.0, "launch": 1e-4, "compute_identified": True,
                                               "memory_identified": False, "fitted": True}}},
           "target": None, "refits": 1}
    m = meaning(rep, "h100-sxm-8")
    assert "0.950" in m and "almost exactly" in m and "not for the campaign's `h100-sxm-8`" in m
    assert "not for the campaign" not in meaning({**rep, "sampling": {**rep["sampling"], "sampling_hardware": "x"}},
                                                 "x")
    mfu = [{"digest": "a" * 64, "makespan": 2e-5, "mfu": 0.394, "model_flops": 4.3e9, "devices": 8}]
    lines = status_lines(rep, mfu, "h100-sxm-8")
    assert any("39.4%" in x for x in lines) and any("2.303 -> 0.050" in x for x in lines)
    md = "\n".join(markdown(rep, mfu, "h100-sxm-8"))
    assert "## MFU of the best plans" in md and "| `aaaaaaaaaaaa` | 20 µs | 8 | 4.3e+09 | 39.4% |" in md
    assert "## Calibrated predictions vs measurements" in md and "| after the refit (in sample) | 0.950 | 0.050 |" in md
    assert "matmul 0.5 / 1 (kept) / 100 µs" in md and "plus 1 ms per shard" in md
    assert markdown(None, [], "x") == [] and status_lines(None, [], "x") == []


def test_refit_of_alike_shards_keeps_the_launch_and_summary_says_so():
    """A small campaign's samples: GEMM shards of two sizes only, measured with heavy noise (the
    quickstart's: 0.27 and 0.54 GFLOP, 4-36 ms). The refit fits the rate and keeps the launch
    overhead of the hardware it starts from; summary.md names what it kept in one sentence."""
    from optimizer.campaign.fidelity import kept_sentence, markdown

    base = load_hardware("cpu")
    truth = base.with_efficiency({"matmul": (0.12, 1.0)})
    rng = np.random.default_rng(2)
    recs = []
    for p in range(6):
        digest = f"{p:064x}"
        total = 0.0
        for i in range(8):
            flops = 2.68e8 * (1 + (i + p) % 2)
            t = float(truth.shard_time(flops, 3.7e6, "float32", "matmul")) * float(np.exp(rng.normal(0, 0.4)))
            total += t
            recs.append({"plan_digest": digest, "kind": "shard", "op": f"op{i}", "shard": 0, "measured_seconds": t,
                         "details": {"kernel_class": "matmul", "dtype": "float32", "flops": flops, "bytes": 3.7e6}})
        recs.append({"plan_digest": digest, "kind": "plan", "measured_seconds": total, "predicted_seconds": 1.0,
                     "details": {"gap_seconds": 0.0}})
    res = refit(recs, base)
    f = res["factors"]["matmul"]
    assert f["compute_identified"] and not f["launch_identified"]
    assert f["launch"] == base.launch_overhead_for("matmul")  # 20 us, the preset's
    assert f["compute"] == pytest.approx(0.12, rel=0.25)
    sentence = kept_sentence(res["factors"], "cpu")
    assert sentence == ("The refit changed only what these samples can tell apart: it kept matmul's memory efficiency "
                        "and launch overhead at `cpu`'s values (a term that never binds, one whose fit is within two "
                        "standard errors of that value, or a fixed cost per shard where the class's shards are too "
                        "alike in size, under 4x apart, to separate it from a rate).")
    rep = {"sampling": {**{k: v for k, v in res.items() if k != "hardware"}, "sampling_hardware": "cpu"},
           "target": None, "refits": 1}
    md = "\n".join(markdown(rep, [], "h100-sxm-8"))
    assert sentence in md and "matmul 0.1" in md and "/ 20 µs (kept)" in md
