"""Fidelity fixes of issue 13: fused ops costed stage by stage on the executor's hardware, plan
times robust to other processes, the executor's gap between shards measured instead of fitted."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.evaluate import serial_prediction
from costmodel.hardware import Hardware, HardwareError
from costmodel.hardware_io import load_hardware
from costmodel.lowering import Lowerer
from ir import workloads
from ir.rewrites import fuse, split

B, D_IN, D_H = 64, 128, 256  # linear 64x128 -> 256, then gelu on 64x256


@pytest.fixture(scope="module")
def fused_plan():
    g = workloads.build("mlp", batch=B, widths=(D_IN, D_H, 32), activation="gelu")
    g = fuse(g, "fc1", "act1")
    (name,) = [n for n, o in g.ops.items() if o.kernel == "fused"]
    return split(g, name, 0, 2), name


def _cpu() -> Hardware:
    # distinct factors per class, so that charging a stage at the wrong class shows
    return load_hardware("cpu").with_efficiency({"matmul": (0.3, 0.2), "elementwise": (0.01, 0.5)},
                                                launch_overhead_by_class={"matmul": 7e-5, "elementwise": 3e-5})


def test_staged_fused_op_is_the_sum_of_its_stages(fused_plan):
    g, name = fused_plan
    hw = _cpu()
    staged = hw.replace(staged_fusion=True)
    low1, low2 = Lowerer(hw).lower(g), Lowerer(staged).lower(g)
    i = low1.op_names.index(name)
    sl = slice(int(low1.op_offsets[i]), int(low1.op_offsets[i + 1]))
    # by hand, per shard (32 rows): linear 2·32·128·256 FLOPs (+ bias adds), reads x 32x128, W
    # 128x256, b 256, writes 32x256, all fp32; gelu: 8 FLOPs per cell, reads and writes 32x256
    rows, cells = B // 2, B // 2 * D_H
    gelu_flops = 8.0 * cells
    lin_flops = float(low1.flops[sl][0]) - gelu_flops
    lin_bytes = 4.0 * (rows * D_IN + D_IN * D_H + D_H + cells)
    one = max((lin_flops + gelu_flops) / (150e9 * 0.3), lin_bytes / (25e9 * 0.2)) + 7e-5
    lin = max(lin_flops / (150e9 * 0.3), lin_bytes / (25e9 * 0.2)) + 7e-5
    gelu = max(gelu_flops / (150e9 * 0.01), 8.0 * cells / (25e9 * 0.5)) + 3e-5
    assert float(low1.nbytes[sl][0]) == pytest.approx(lin_bytes)
    np.testing.assert_allclose(low1.dur[sl], one, rtol=1e-9)       # one GEMM-class kernel
    np.testing.assert_allclose(low2.dur[sl], lin + gelu, rtol=1e-9)  # two kernels, one after another
    assert gelu > 0.3 * lin  # the epilogue is not negligible on a CPU: the fix matters
    # unfused ops are not touched
    other = [k for k in range(len(low1.op_names)) if k != i]
    for k in other:
        s = slice(int(low1.op_offsets[k]), int(low1.op_offsets[k + 1]))
        np.testing.assert_array_equal(low1.dur[s], low2.dur[s])
    assert serial_prediction(g, staged) > serial_prediction(g, hw)


def test_staged_fusion_round_trips_and_rejects_bad_input():
    hw = load_hardware("cpu").replace(staged_fusion=True)
    assert Hardware.from_dict(hw.to_dict()) == hw
    assert "staged_fusion" not in load_hardware("cpu").to_dict()
    with pytest.raises(HardwareError, match="staged_fusion: true or false"):
        load_hardware("cpu").replace(staged_fusion="yes")


def test_fused_shard_records_carry_their_stages_and_predict_as_the_lowering(fused_plan):
    from optimizer.realrun.measurement import executed_hardware, stage_work
    from optimizer.realrun.online import calibration_records, predict_plans

    g, name = fused_plan
    hw = executed_hardware(_cpu())
    work = stage_work(g, g.ops[name])
    assert [s[0] for s in work[0]] == ["matmul", "elementwise"] and len(work) == 2
    low = Lowerer(hw).lower(g)
    i = low.op_names.index(name)
    off = int(low.op_offsets[i])
    shards = [{"details": {"kernel_class": "matmul", "dtype": "float32", "flops": float(low.flops[off + k]),
                           "bytes": float(low.nbytes[off + k]), "stages": work[k]}, "measured_seconds": 1e-3}
              for k in range(2)]
    pred = predict_plans([{"shards": shards}], hw)[0]
    assert pred == pytest.approx(float(low.dur[off:off + 2].sum()), rel=1e-9)
    assert calibration_records([{"shards": shards}]) == []  # a sum of two classes: not a per-class point


def test_dispatch_is_the_measured_gap_when_plans_carry_it():
    from optimizer.realrun.online import _fit_dispatch

    hw = load_hardware("cpu")
    shard = {"details": {"kernel_class": "elementwise", "dtype": "float32", "flops": 1e3, "bytes": 1e4}}
    points = [{"shards": [shard] * 10, "measured": 5e-3, "gap": 2e-4},
              {"shards": [shard] * 30, "measured": 9e-3, "gap": 6e-4}]
    cal, d = _fit_dispatch(points, hw, np.array([5e-3, 9e-3]))
    assert d == pytest.approx(8e-4 / 40)
    assert cal.launch_overhead_for("elementwise") == pytest.approx(hw.launch_overhead_for("elementwise") + d)
    # without measured gaps it is still fitted on the plan times
    _, d2 = _fit_dispatch([{k: v for k, v in p.items() if k != "gap"} for p in points], hw, np.array([5e-3, 9e-3]))
    assert d2 > 0 and d2 != pytest.approx(d)


@pytest.mark.parametrize("statistic", ["median", "min"])
def test_plan_time_is_robust_to_time_slices_taken_between_items(statistic):
    from ir.rewrites import place
    from optimizer.realrun.measurement import measure_plan

    g = workloads.build("mlp", batch=8, widths=(16, 32, 16), activation="gelu")
    g = place(split(g, "fc1", 0, 2), "fc1", [0, 1])  # two devices: a transfer to time as well
    recs = measure_plan(g, "cpu", repeats=3, statistic=statistic)
    plan = recs[-1]
    d = plan["details"]
    items = [r for r in recs if r["kind"] in ("shard", "transfer")]
    assert d["statistic"] == statistic and any(r["kind"] == "transfer" for r in items)
    assert plan["measured_seconds"] == pytest.approx(
        sum(r["measured_seconds"] for r in items) + max(d["gap_seconds"], 0.0))
    assert d["wall_median_seconds"] > 0 and plan["verified"]
