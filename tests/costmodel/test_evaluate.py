"""Objectives against hand-computed values from the h100-sxm-8 preset's figures.

Figures used (costmodel/presets.py): float32 peak P = 66.9e12 FLOP/s, HBM B = 3.35e12 B/s,
launch L = 5 us, NVLink 450e9 B/s per direction and 2.5 us latency, 40 pJ/B, active 700 W,
idle 75 W, 80 GB per device. Shard time = max(FLOPs / P, bytes / B) + L; a transfer holds the
sender's and the receiver's NVLink ports for bytes / bandwidth and its data arrives
latency + bytes / bandwidth after it starts (the latency is pipelined: it holds no port).
"""

from __future__ import annotations

import numpy as np
import pytest

from costmodel import Evaluator, evaluate
from costmodel.energy import schedule_energy
from costmodel.presets import PRESETS
from ir import workloads
from ir.folding import fold_constants
from ir.builder import GraphBuilder
from ir.rewrites import random_walk, retile, split_reduction

HW = PRESETS["h100-sxm-8"]
P, B, L = 66.9e12, 3.35e12, 5e-6
LAT, BW, EPB = 2.5e-6, 450e9, 40e-12
ACTIVE, IDLE = 700.0, 75.0


def test_preset_figures_used_here():
    assert HW.peak_flops("float32") == P and HW.device.mem_bandwidth == B and HW.device.launch_overhead == L
    assert (HW.intra_link.latency, HW.intra_link.bandwidth, HW.intra_link.energy_per_byte) == (LAT, BW, EPB)
    assert (HW.device.active_power, HW.device.idle_power, HW.device.mem_capacity) == (ACTIVE, IDLE, 80e9)


def roof(flops, nbytes):
    return max(flops / P, nbytes / B) + L


def matmul_graph(M, K, N):
    b = GraphBuilder()
    b.matmul(b.input("x", (M, K)), b.parameter("W", (K, N)), name="mm")
    return b.build()


def test_one_matmul_on_one_device():
    M, K, N = 512, 1024, 2048
    e = evaluate(matmul_graph(M, K, N), HW, curves=None)  # the flat roofline of the closed form
    flops = 2.0 * M * K * N  # 2.1e9 FLOP -> 32 us at 66.9 TFLOP/s
    nbytes = 4.0 * (M * K + K * N + M * N)  # 14.7 MB -> 4.4 us at 3.35 TB/s: compute-bound
    t = max(flops / P, nbytes / B) + L
    assert flops / P > nbytes / B
    assert e.makespan == pytest.approx(t, rel=1e-12)
    assert e.energy == pytest.approx(ACTIVE * t, rel=1e-12)  # one device, busy the whole time
    assert e.peak_memory == 4.0 * (M * K + K * N) + 4.0 * M * N  # x and W resident + the output
    assert e.devices == 1 and e.bytes_moved == 0 and e.feasible
    # lower bound: the work spread over 8 devices (4.0 us) plus one launch (the busiest device runs
    # at least one shard), or the one launch the chain of ops needs
    lb = max(max(flops / P, 4.0 * (M * K + K * N + M * N) / B) / 8 + L, L)
    assert e.lower_bound == pytest.approx(lb, rel=1e-12)
    assert e.gap == pytest.approx(t / lb, rel=1e-12)
    b = e.breakdown()
    assert b.ops == [{"op": "mm", "shards": 1, "flops": flops, "compute_s": pytest.approx(t), "transfers": 0,
                      "in_bytes": 0.0, "in_s": 0.0, "in_latency_s": 0.0, "devices": [0], "start": 0.0,
                      "finish": pytest.approx(t)}]
    assert b.devices[0]["compute_s"] == pytest.approx(t) and b.devices[0]["idle_s"] == pytest.approx(0.0, abs=1e-18)
    assert not any(d["used"] for d in b.devices[1:])


def chain_graph(M, K, N):
    b = GraphBuilder()
    y = b.matmul(b.input("x", (M, K)), b.parameter("W", (K, N)), name="mm")
    b.relu(y, name="act")
    return b.build()


def test_split_matmul_over_two_devices_with_a_known_transfer():
    M, K, N = 1024, 1024, 1024
    # mm rows 0:512 on device 0, rows 512:1024 on device 1; relu whole on device 0
    g = retile(chain_graph(M, K, N), "mm", [2, 1], [0, 1])
    e = evaluate(g, HW, curves=None)  # the flat roofline of the closed form
    t1 = roof(2.0 * (M // 2) * K * N, 4.0 * ((M // 2) * K + K * N + (M // 2) * N))
    xfer = 4.0 * (M // 2) * N  # device 1's half of y, 2 MB
    occ = xfer / BW  # port time
    T = LAT + occ  # the data lands T after the transfer starts
    t2 = roof(1.0 * M * N, 4.0 * 2 * M * N)  # relu: 1 FLOP per element, reads and writes M*N floats
    ms = t1 + T + t2
    assert e.makespan == pytest.approx(ms, rel=1e-12)
    assert e.bytes_moved == xfer
    busy0, busy1 = t1 + t2, t1
    energy = ACTIVE * (busy0 + busy1) + IDLE * ((ms - busy0) + (ms - busy1)) + EPB * xfer
    assert e.energy == pytest.approx(energy, rel=1e-12)
    resident = 4.0 * ((M // 2) * K + K * N)  # each device: its rows of x and all of W
    # device 0 at relu time: its half of y, the received half, relu's output
    np.testing.assert_allclose(e.peak_memory_per_device[:2],
                               [resident + 4.0 * (M // 2) * N * 2 + 4.0 * M * N, resident + 4.0 * (M // 2) * N])
    assert e.devices == 2
    b = e.breakdown()
    d0, d1 = b.devices[0], b.devices[1]
    assert d0["compute_s"] == pytest.approx(busy0) and d1["compute_s"] == pytest.approx(busy1)
    # ports are occupied for bytes / bandwidth only
    assert d1["egress_s"] == occ and d0["ingress_s"] == occ and d1["comm_s"] == occ
    assert d0["idle_s"] == pytest.approx(ms - busy0) and d1["idle_s"] == pytest.approx(ms - busy1)
    ops = {o["op"]: o for o in b.ops}
    assert ops["mm"]["shards"] == 2 and ops["mm"]["compute_s"] == pytest.approx(2 * t1)
    assert ops["mm"]["flops"] == 2.0 * M * K * N and ops["mm"]["devices"] == [0, 1]
    assert ops["act"]["in_bytes"] == xfer and ops["act"]["in_s"] == occ and ops["act"]["transfers"] == 1
    assert ops["act"]["in_latency_s"] == LAT and ops["mm"]["in_latency_s"] == 0.0
    assert ops["act"]["start"] == pytest.approx(t1 + T) and ops["act"]["finish"] == pytest.approx(ms)


def test_halo_exchange_for_a_split_conv2d():
    C, Co, H, W = 16, 32, 64, 64
    b = GraphBuilder()
    r = b.relu(b.input("x", (1, C, H, W)), name="act")
    b.conv2d(r, b.parameter("w", (Co, C, 3, 3)), name="conv", padding=1)
    g = b.build()
    g = retile(g, "act", [1, 1, 2, 1], [0, 1])  # rows 0:32 on device 0, 32:64 on device 1
    g = retile(g, "conv", [1, 1, 2, 1], [0, 1])  # output rows likewise
    e = evaluate(g, HW, curves=None)  # the flat roofline of the closed form
    low = e.lowered
    tr = np.nonzero(low.kind == 1)[0]
    halo = 4.0 * C * 1 * W  # one row of every channel
    assert sorted(zip(low.dev[tr].tolist(), low.dst[tr].tolist())) == [(0, 1), (1, 0)]
    np.testing.assert_array_equal(low.alloc[tr], [halo, halo])
    assert e.bytes_moved == 2 * halo
    t_act = roof(C * (H // 2) * W, 4.0 * 2 * C * (H // 2) * W)
    T = LAT + halo / BW  # both directions at once (different ports): each lands after LAT + halo / BW
    # conv shard: (H/2 + 1) input rows (one halo row, one padding row clipped away), all weights
    t_conv = roof(2.0 * C * 9 * Co * (H // 2) * W, 4.0 * (C * (H // 2 + 1) * W + Co * C * 9 + Co * (H // 2) * W))
    assert e.makespan == pytest.approx(t_act + T + t_conv, rel=1e-12)


def test_reduction_split_accumulate_pulls_the_partials():
    M, K, N = 256, 4096, 256
    g = split_reduction(matmul_graph(M, K, N), "mm", 2)
    g = retile(g, "mm", [2, 1, 1], [0, 1])  # block kb of the reduction on device kb
    g = retile(g, "mm.acc", [1, 1], [0])
    e = evaluate(g, HW, collectives=False, curves=None)  # point to point (as a NCCL reduce: test_collectives.py)
    low = e.lowered
    tr = np.nonzero(low.kind == 1)[0]
    assert len(tr) == 1 and (low.dev[tr[0]], low.dst[tr[0]]) == (1, 0)
    assert low.alloc[tr[0]] == 4.0 * M * N  # partial block 1
    t_p = roof(2.0 * M * (K // 2) * N, 4.0 * (M * (K // 2) + (K // 2) * N + M * N))
    T = LAT + 4.0 * M * N / BW  # one transfer: it lands after latency + bytes / bandwidth
    t_acc = roof(1.0 * M * N, 4.0 * (2 * M * N + M * N))  # 1 add per output, reads 2 partials
    assert e.makespan == pytest.approx(t_p + T + t_acc, rel=1e-12)
    ops = {o["op"]: o for o in e.breakdown().ops}
    assert ops["mm.acc"]["in_bytes"] == 4.0 * M * N and ops["mm"]["in_bytes"] == 0


def test_partials_into_one_device_pipeline_their_latency():
    # 4 reduction blocks on devices 0..3, accumulated on device 0: the 3 remote partials (M·N
    # floats each) queue on device 0's NVLink ingress for 4MN / BW each; their latencies overlap,
    # so the last lands at t_p + 3·(4MN / BW) + LAT (it was t_p + 3·(LAT + 4MN / BW) when the
    # latency held the port)
    M, K, N = 256, 4096, 256
    g = split_reduction(matmul_graph(M, K, N), "mm", 4)
    g = retile(g, "mm", [4, 1, 1], [0, 1, 2, 3])
    g = retile(g, "mm.acc", [1, 1], [0])
    e = evaluate(g, HW, collectives=False, curves=None)  # point to point (as a NCCL reduce: test_collectives.py)
    low = e.lowered
    tr = np.nonzero(low.kind == 1)[0]
    assert sorted(low.dev[tr].tolist()) == [1, 2, 3] and set(low.dst[tr].tolist()) == {0}
    occ = 4.0 * M * N / BW
    np.testing.assert_array_equal(low.dur[tr], occ)
    np.testing.assert_array_equal(low.lat[tr], LAT)
    t_p = roof(2.0 * M * (K // 4) * N, 4.0 * (M * (K // 4) + (K // 4) * N + M * N))
    t_acc = roof(3.0 * M * N, 4.0 * (4 * M * N + M * N))  # 3 adds per output, reads 4 partials
    assert e.makespan == pytest.approx(t_p + 3 * occ + LAT + t_acc, rel=1e-12)
    b = e.breakdown()
    assert b.devices[0]["ingress_s"] == pytest.approx(3 * occ, rel=1e-15)
    assert [b.devices[d]["egress_s"] for d in (1, 2, 3)] == [occ] * 3
    ops = {o["op"]: o for o in b.ops}
    assert ops["mm.acc"]["in_s"] == pytest.approx(3 * occ, rel=1e-15)
    assert ops["mm.acc"]["in_latency_s"] == pytest.approx(3 * LAT, rel=1e-15)
    assert ops["mm.acc"]["start"] == pytest.approx(t_p + 3 * occ + LAT, rel=1e-12)


def test_plan_exceeding_80_gb_is_infeasible():
    K = N = 150_000  # W: 150k x 150k float32 = 90 GB
    g = matmul_graph(8, K, N)
    e = evaluate(g, HW, curves=None)  # the flat roofline of the closed form
    assert e.peak_memory > 80e9 and not e.feasible
    g2 = retile(g, "mm", [1, 2], [0, 1])  # W split by columns: 45 GB per device
    e2 = evaluate(g2, HW, curves=None)  # the flat roofline of the closed form
    assert e2.peak_memory < 80e9 and e2.feasible
    assert e2.peak_memory_per_device[0] == pytest.approx(4.0 * (8 * K + K * N // 2 + 8 * N // 2))


def random_plans(name, params, n_dev, count, steps, seed):
    rng = np.random.default_rng(seed)
    g0 = workloads.build(name, **params)
    for _ in range(count):
        yield random_walk(g0, rng, n_dev, steps)


@pytest.mark.parametrize("name,params", [
    ("mlp", dict(batch=64, widths=(256, 1024, 256))),
    ("transformer", dict(batch=2, seq=64, d_model=128, heads=4, d_ff=256)),
    ("convnet", dict(batch=2, channels=(3, 16, 16), size=32)),
])
@pytest.mark.parametrize("collectives", [False, True])
def test_bound_energy_breakdown_consistency(name, params, collectives):
    ev = Evaluator(HW, collectives=collectives)
    for g in random_plans(name, params, 8, 15, 10, seed=3):
        e = ev(g, keep=True)
        assert 0 < e.lower_bound <= e.makespan * (1 + 1e-12)
        assert e.lower_bound == ev.lower_bound(g)  # the facts the evaluator keeps, recomputed
        low, s = e.lowered, e.schedule
        if not collectives:
            assert e.energy == schedule_energy(s, HW, low.kind, low.dev, low.dst, low.alloc).total
        b = e.breakdown()
        assert sum(o["compute_s"] for o in b.ops) == pytest.approx(sum(d["compute_s"] for d in b.devices))
        assert sum(o["in_bytes"] for o in b.ops) == pytest.approx(e.bytes_moved)
        # port seconds: every transfer counted once per op, once on its sender and once on its receiver
        nc = low.n_compute
        ranks = np.diff(low.part_ptr)[nc:]  # a collective holds the ports of each participant
        held = np.where(low.kind[nc:] == 2, ranks, 1)
        assert 2 * float((low.dur[nc:] * held).sum()) == pytest.approx(sum(d["comm_s"] for d in b.devices))
        assert sum(o["in_s"] for o in b.ops) == pytest.approx(float(low.dur[nc:].sum()))
        assert collectives or np.all(held == 1)
        nc = low.n_compute
        assert sum(o["in_latency_s"] for o in b.ops) == pytest.approx(float(low.lat[nc:].sum()))
        # communication holds its ports for dur; compute overlapped by it is slowed (HW.contention)
        assert np.all(s.finish[nc:] == s.start[nc:] + low.dur[nc:] + low.lat[nc:])
        assert np.all(s.finish[:nc] >= s.start[:nc] + low.dur[:nc] + low.lat[:nc])
        assert np.all(s.finish[:nc] <= s.start[:nc] + HW.contention * low.dur[:nc] + low.lat[:nc] + 1e-15)
        assert sum(o["shards"] for o in b.ops) == fold_constants(g).n_shards  # a merged weight's concat: at load
        assert sum(d["used"] for d in b.devices) == e.devices
        assert max(d["peak_memory"] for d in b.devices) == e.peak_memory
        js = e.to_json()
        assert js["gap"] == e.gap and len(js["peak_memory_per_device"]) == 8


def test_without_keep_there_is_no_breakdown():
    e = Evaluator(HW)(matmul_graph(8, 8, 8))
    assert e.lowered is None
    with pytest.raises(ValueError, match="keep=True"):
        e.breakdown()
