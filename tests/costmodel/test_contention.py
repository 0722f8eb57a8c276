"""Contention: compute overlapped by communication on its device is slowed by ``Hardware.contention``
(``costmodel.simulate``); closed forms by hand."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.hardware import HardwareError
from costmodel.hardware_io import load_hardware
from costmodel.presets import PRESETS
from costmodel.simulate import SimulationError, csr_from_edges, simulate

NO_EDGES = csr_from_edges(2, [], [])


def _collective_and_compute(coll: float, comp: float, s: float, comp_dev: int = 0):
    """A collective on devices 0 and 1 (both NVLink ports) and an independent compute node."""
    return simulate([2, 0], [0, comp_dev], [-1, -1], [coll, comp], *NO_EDGES, np.zeros(2), np.zeros(2), 2,
                    link=[1, 0], part_ptr=[0, 2, 2], part_dev=[0, 1], part_alloc=[0.0, 0.0], contention=s)


def test_compute_alone_is_unchanged():
    kind, dev, dst = [0, 0], [0, 1], [-1, -1]
    for s in (1.0, 1.3, 2.0):
        sch = simulate(kind, dev, dst, [1.0, 2.0], *NO_EDGES, np.zeros(2), np.zeros(2), 2, contention=s)
        assert list(sch.finish) == [1.0, 2.0] and sch.makespan == 2.0 and list(sch.busy_compute) == [1.0, 2.0]


@pytest.mark.parametrize("s", [1.0, 1.25, 1.5, 2.0])
def test_compute_fully_overlapped_by_a_collective_is_slowed_by_the_factor(s):
    sch = _collective_and_compute(coll=3.0, comp=1.0, s=s)  # the collective (rank 3) is placed first
    assert sch.start[1] == 0.0 and sch.finish[1] == pytest.approx(1.0 * s)
    assert sch.busy_compute[0] == 1.0 and sch.makespan == 3.0  # busy_compute counts the work


def test_partial_overlap_closed_form():
    # collective over [0, 1), compute of 1 s from 0 at s = 2: half its work in the window, the rest after
    sch = _collective_and_compute(coll=1.0, comp=1.0, s=2.0)
    assert sch.finish[1] == pytest.approx(1.0 + (1.0 - 1.0 / 2.0))
    # compute on a device outside the collective is not slowed
    sch = simulate([2, 0], [0, 2], [-1, -1], [3.0, 1.0], *NO_EDGES, np.zeros(2), np.zeros(3), 3, link=[1, 0],
                   part_ptr=[0, 2, 2], part_dev=[0, 1], part_alloc=[0.0, 0.0], contention=2.0)
    assert sch.finish[1] == 1.0


def test_communication_placed_after_the_compute_it_overlaps_charges_the_device():
    # compute (rank 2) placed first over [0, 2); a transfer 0 -> 1 of 1 s then overlaps it for 1 s:
    # the device's compute is pushed back by (s - 1) x 1 and the makespan pays for it
    s = 1.5
    sch = simulate([0, 1], [0, 0], [-1, 1], [2.0, 1.0], *NO_EDGES, np.zeros(2), np.zeros(2), 2, contention=s)
    assert sch.start[1] == 0.0 and sch.makespan == pytest.approx(2.0 + (s - 1.0) * 1.0)
    assert sch.busy_compute[0] == 2.0
    one = simulate([0, 1], [0, 0], [-1, 1], [2.0, 1.0], *NO_EDGES, np.zeros(2), np.zeros(2), 2)
    assert one.makespan == 2.0  # no contention: overlap is free


def test_bad_factor_refused():
    with pytest.raises(SimulationError, match="contention"):
        simulate([0], [0], [-1], [1.0], *csr_from_edges(1, [], []), np.zeros(1), np.zeros(1), 1, contention=0.5)
    with pytest.raises(HardwareError, match="contention"):
        PRESETS["h100-sxm-8"].replace(contention=0.9)


def test_hardware_field_round_trips_and_reaches_the_evaluator(tmp_path):
    from costmodel.evaluate import Evaluator
    from ir import workloads

    hw = PRESETS["h100-sxm-8"]
    assert hw.contention == pytest.approx(1.2)  # the preset's cited default (costmodel.presets)
    y = tmp_path / "hw.yaml"
    y.write_text("base: h100-sxm-8\ncontention: 1.5\n")
    assert load_hardware(y).contention == 1.5
    assert load_hardware(hw.replace(contention=1.5).to_dict()).contention == 1.5
    # ZeRO-3 training of an MLP: parameter gathers and gradient reductions overlap the compute
    from optimizer.search.baselines import baselines

    g = workloads.build("mlp", batch=2048, widths=(1024, 1024, 1024, 1024), dtype="bfloat16", mode="train",
                        optimizer="sgd")
    plan = baselines(g, 8)["zero3-8"]
    t = [Evaluator(hw.replace(contention=c))(plan).makespan for c in (1.0, 1.2, 2.0)]
    assert t[0] < t[1] < t[2] < 2.0 * t[0]
    single = baselines(g, 8)["single-device"]  # no communication: no contention
    assert Evaluator(hw.replace(contention=2.0))(single).makespan == Evaluator(hw.replace(contention=1.0))(single).makespan
