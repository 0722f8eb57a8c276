"""Collectives (``costmodel.collectives``): NCCL's times against closed forms, their recognition
in the lowering, and the separate NVLink and NIC ports of the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel import Evaluator
from costmodel.collectives import BUS_EFFICIENCY, classify, collective_time
from costmodel.lowering import Lowerer
from costmodel.presets import PRESETS
from ir.builder import GraphBuilder
from ir.rewrites import place, retile, split, split_reduction
from tests.costmodel.test_state import F4, K, N, rename, step

HW8, HW64 = PRESETS["h100-sxm-8"], PRESETS["h100-sxm-64"]
GiB = 2.0**30
BNV = HW8.intra_link.bandwidth * BUS_EFFICIENCY["intra"]  # 360 GB/s
BIB = HW64.inter_link.bandwidth * BUS_EFFICIENCY["inter"]  # 45 GB/s
LNV, LIB = HW8.intra_link.latency, HW64.inter_link.latency


def test_one_gib_all_reduce_on_8_h100_over_nvlink():
    c = collective_time("all_reduce", GiB, 8, HW8)
    closed = 2 * 7 / 8 * GiB / BNV + 2 * 7 * LNV  # ring: reduce-scatter + all-gather
    assert c.seconds == pytest.approx(closed, rel=1e-12)
    assert 4e-3 <= c.seconds <= 6e-3 and c.algorithm == "ring"


def test_one_gib_all_reduce_on_64_h100_in_8_nodes_is_hierarchical():
    c = collective_time("all_reduce", GiB, [8] * 8, HW64)
    hier = 2 * (7 / 8 * GiB / BNV + 7 / 8 * (GiB / 8) / BIB) + 2 * (7 * LNV + 7 * LIB)
    ring = 2 * 63 / 64 * GiB / min(BNV, 8 * BIB) + 2 * (56 * LNV + 8 * LIB)
    assert c.seconds == pytest.approx(min(hier, ring), rel=1e-12)
    assert c.seconds < 12e-3
    # a flat ring over one NIC per step (what point-to-point transfers amount to) takes ~62 ms
    flat = 2 * 63 / 64 * GiB / HW64.inter_link.bandwidth
    assert flat > 40e-3 > 3 * c.seconds


def test_reduce_scatter_all_gather_broadcast_closed_forms():
    S = 64e6
    assert collective_time("reduce_scatter", S, 4, HW8).seconds == pytest.approx(3 / 4 * S / BNV + 3 * LNV)
    assert collective_time("all_gather", S, 4, HW8).seconds == pytest.approx(3 / 4 * S / BNV + 3 * LNV)
    assert collective_time("broadcast", S, 4, HW8).seconds == pytest.approx(S / BNV + 3 * LNV)
    assert collective_time("reduce", S, 4, HW8).seconds == pytest.approx(S / BNV + 3 * LNV)
    assert collective_time("all_gather", S, 1, HW8).seconds == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("all_to_all", S, 4, HW8)


def test_classify():
    a = np.array
    # 3 devices each sending the same box to the 2 others: an all-gather
    src, dst, shard = a([0, 0, 1, 1, 2, 2]), a([1, 2, 0, 2, 0, 1]), a([0, 0, 1, 1, 2, 2])
    assert classify(False, src, dst, np.full(6, 8.0), shard) == "all_gather"
    assert classify(True, src, dst, np.full(6, 8.0), shard) == "reduce_scatter"
    # different boxes to different devices: an all-to-all stays point to point
    assert classify(False, src, dst, a([8.0, 4, 8, 4, 8, 4]), shard) is None
    # two devices: point to point
    assert classify(False, a([0, 0]), a([1, 1]), a([8.0, 8.0]), a([0, 1])) is None
    assert classify(False, a([0, 0]), a([1, 2]), a([8.0, 8.0]), a([0, 0])) == "broadcast"
    assert classify(True, a([1, 2, 3]), a([0, 0, 0]), a([8.0, 8.0, 8.0]), a([1, 2, 3])) == "reduce"


def test_state_gather_is_one_collective_node():
    g = place(split(step(), "mm", 0, 4), "mm", [0, 1, 2, 3])
    g = place(split(g, "upd", 0, 4), "upd", [0, 1, 2, 3])
    low = Lowerer(HW8, collectives=True).lower(g)
    nc = low.n_compute
    assert low.kind[nc:].tolist() == [2]
    S = K * N * F4
    assert low.dur[nc] == pytest.approx(3 / 4 * S / BNV, rel=1e-12)
    assert low.lat[nc] == pytest.approx(3 * LNV, rel=1e-12)
    assert low.alloc[nc] == 3 * S  # the bytes the point-to-point form moves
    assert low.part_dev.tolist() == [0, 1, 2, 3] and np.all(low.part_alloc == 3 / 4 * S)
    assert low.link[nc] == 1  # NVLink only
    ev = Evaluator(HW8)(g, keep=True)
    s = ev.schedule
    mm = low.op_offsets[list(low.op_names).index("mm")]
    assert s.start[nc] == 0.0 and np.all(s.start[mm:mm + 4] >= s.finish[nc])
    # every participant's ports are held for the collective's duration
    assert np.allclose(s.busy_egress[:4], low.dur[nc]) and np.allclose(s.busy_ingress[:4], low.dur[nc])


def test_partials_into_one_device_are_a_nccl_reduce():
    M, Kr, Nr = 256, 4096, 256
    b = GraphBuilder()
    b.matmul(b.input("x", (M, Kr)), b.parameter("W", (Kr, Nr)), name="mm")
    g = split_reduction(b.build(), "mm", 4)
    g = retile(g, "mm", [4, 1, 1], [0, 1, 2, 3])
    g = retile(g, "mm.acc", [1, 1], [0])
    e = Evaluator(HW8, curves=None)(g, keep=True)  # the flat roofline of the closed form
    low = e.lowered
    nc = low.n_compute
    assert low.kind[nc:].tolist() == [2]
    S = 4.0 * M * Nr
    P, B, L = HW8.peak_flops("float32"), HW8.device.mem_bandwidth, HW8.device.launch_overhead
    t_p = max(2.0 * M * (Kr // 4) * Nr / P, 4.0 * (M * (Kr // 4) + (Kr // 4) * Nr + M * Nr) / B) + L
    t_acc = max(3.0 * M * Nr / P, 4.0 * (4 * M * Nr + M * Nr) / B) + L
    assert e.makespan == pytest.approx(t_p + S / BNV + 3 * LNV + t_acc, rel=1e-12)
    # point to point the 3 partials queue on device 0's port: 3·S/bw + one latency
    p2p = Evaluator(HW8, collectives=False, curves=None)(g)
    assert p2p.makespan == pytest.approx(t_p + 3 * S / HW8.intra_link.bandwidth + LNV + t_acc, rel=1e-12)


def test_data_parallel_gradient_all_reduce_across_nodes():
    """A weight gradient reduced over 64 devices (reduce-scatter) and read back by all of them
    (all-gather): hierarchical NCCL beats sending every byte over the NICs."""
    Kw, Nw, T = 1024, 1024, 64 * 16
    b = GraphBuilder()
    b.matmul(b.input("xT", (Kw, T)), b.input("dy", (T, Nw)), name="dW")
    g = split_reduction(b.build(), "dW", 64)
    g = retile(g, "dW", [64, 1, 1], list(range(64)))
    g = retile(g, "dW.acc", [64, 1], list(range(64)))
    ev = Evaluator(HW64)(g, keep=True)
    low = ev.lowered
    nc = low.n_compute
    assert low.kind[nc:].tolist() == [2] and low.link[nc] == 3  # NVLink and NIC
    S = 4.0 * Kw * Nw
    rs = collective_time("reduce_scatter", S, [8] * 8, HW64)
    assert low.dur[nc] == pytest.approx(rs.bandwidth_s, rel=1e-12)
    p2p = Evaluator(HW64, collectives=False)(g)
    assert ev.makespan < p2p.makespan


def test_nvlink_and_nic_ports_run_at_once():
    hw = HW8.replace(name="2x2", n_nodes=2, devices_per_node=2)
    b = GraphBuilder()
    y = b.relu(b.input("x", (1024, 1024)), name="a")
    b.relu(y, name="b1")
    b.relu(y, name="b2")
    g = place(place(b.build(), "b1", [1]), "b2", [2])  # device 0 sends to 1 (NVLink) and 2 (NIC)
    e = Evaluator(hw, collectives=False)(g, keep=True)  # as one broadcast, it would hold both
    low, s = e.lowered, e.schedule
    nc = low.n_compute
    assert sorted(low.link[nc:].tolist()) == [0, 1]
    assert np.all(s.start[nc:] == s.start[nc])  # both leave device 0 at the same time
