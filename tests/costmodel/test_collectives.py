"""Collectives (``costmodel.collectives``): NCCL's times against closed forms, their recognition
in the lowering, and the separate NVLink and NIC ports of the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel import Evaluator
from costmodel.collectives import BUS_EFFICIENCY, all_to_all_time, classify, collective_time
from costmodel.lowering import Lowerer
from costmodel.presets import PRESETS
from ir.builder import GraphBuilder
from ir.rewrites import place, retile, split, split_reduction
from ir.graph import next_name
from tests.costmodel.test_state import F4, K, M, N, rename, step

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
    ring = 2 * 63 / 64 * GiB / min(BNV, 8 * BIB) + 2 * (56 * LNV + 7 * LIB)  # NCCL: N-1 NIC steps
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
        collective_time("all_to_one", S, 4, HW8)
    with pytest.raises(ValueError, match="all_to_all_time"):
        collective_time("all_to_all", S, 4, HW8)


def test_all_to_all_lasts_as_long_as_its_busiest_port():
    """At the line rate, like the point-to-point transfers it groups (not NCCL's ring ``B``)."""
    a = np.array
    nv, ib = HW8.intra_link.bandwidth, HW64.inter_link.bandwidth
    # one node: device 0 sends 3 MB in all, device 2 receives 4 MB in all: the busiest port
    src, dst, nb = a([0, 0, 1, 2, 3]), a([1, 2, 2, 0, 2]), a([1e6, 2e6, 1e6, 5e5, 1e6])
    c = all_to_all_time(src, dst, nb, HW8)
    assert (c.kind, c.algorithm, c.ranks, c.nodes) == ("all_to_all", "pairwise", 4, 1)
    assert c.bandwidth_s == pytest.approx(4e6 / nv, rel=1e-12) and c.latency_s == LNV
    assert c.nbytes == 5.5e6
    # across nodes: NVLink and the NIC run at once; the slower of the two busiest ports sets it
    src, dst, nb = a([0, 0, 9, 0]), a([1, 8, 0, 2]), a([8e6, 1e6, 2e6, 1e6])  # 0's NVLink out: 9 MB
    c = all_to_all_time(src, dst, nb, HW64)
    assert c.nodes == 2 and c.latency_s == LIB
    assert c.bandwidth_s == pytest.approx(max(9e6 / nv, 2e6 / ib), rel=1e-12) == 2e6 / ib
    assert all_to_all_time(a([0]), a([1]), a([0.0]), HW8).seconds == 0.0


def test_a_reshuffle_between_layouts_is_one_all_to_all():
    """Rows in 4 blocks on devices 0-3 read in 3 blocks (86, 85, 85 rows) on devices 1-3: each
    device sends a different slice to the next (64, 42 and 21 rows). One collective node instead
    of the point-to-point transfers, costed from what those carry, every participant's ports held
    while it runs; its readers start when it ends."""
    b = GraphBuilder()
    b.relu(b.relu(b.input("x", (256, 768)), name="a"), name="b")
    g = place(split(b.build(), "a", 0, 4), "a", [0, 1, 2, 3])
    g = retile(g, "b", [3, 1], [1, 2, 3])
    assert (g.ops["b"].shards.hi - g.ops["b"].shards.lo)[:, 0].tolist() == [86, 85, 85]
    p2p = Lowerer(HW8, collectives=False).lower(g)
    nc = p2p.n_compute
    row = 768 * 4
    assert p2p.dst[nc:].tolist() == [1, 2, 3] and p2p.alloc[nc:].tolist() == [64 * row, 42 * row, 21 * row]
    low = Lowerer(HW8, collectives=True).lower(g)
    c = low.n_compute
    assert low.kind[c:].tolist() == [2] and low.link[c] == 1
    assert low.dur[c] == pytest.approx(64 * row / HW8.intra_link.bandwidth, rel=1e-12) and low.lat[c] == LNV
    assert low.alloc[c] == 127 * row
    assert low.part_dev.tolist() == [0, 1, 2, 3] and low.part_alloc.tolist() == [0, 64 * row, 42 * row, 21 * row]
    e = Evaluator(HW8, curves=None)(g, keep=True)
    s = e.schedule
    assert np.allclose(s.busy_egress[:4], low.dur[c]) and np.allclose(s.busy_ingress[:4], low.dur[c])
    b_nodes = np.arange(low.op_offsets[1], low.op_offsets[2])
    assert np.all(s.start[b_nodes] == s.finish[c])
    # point to point: the same bytes in the same time (as the all-to-all, only the 42- and 21-row
    # readers wait longer)
    pe = Evaluator(HW8, collectives=False, curves=None)(g)
    assert e.makespan == pytest.approx(pe.makespan, rel=1e-12)


def test_rows_to_columns_is_an_all_to_all_not_an_all_gather():
    """Rows in 4 blocks on devices 0-3 read in 4 column blocks on the same devices: every device
    sends each other one a 64 x 64 block, all of one size but each a different block. Sizes alone
    called it an all-gather (a ring at the bus efficiency over the whole tensor); it is an
    all-to-all: each device sends 3 blocks and receives 3, its busiest port lasts 3 blocks /
    NVLink's line rate. A replicated read (every device reads all rows) stays an all-gather."""
    b = GraphBuilder()
    b.relu(b.relu(b.input("x", (256, 256)), name="a"), name="b")
    g = place(split(b.build(), "a", 0, 4), "a", [0, 1, 2, 3])
    g = retile(g, "b", [1, 4], [0, 1, 2, 3])
    low = Lowerer(HW8, collectives=True).lower(g)
    c = low.n_compute
    block = 64 * 64 * 4  # float32
    assert low.kind[c:].tolist() == [2] and low.alloc[c] == 12 * block
    assert low.dur[c] == pytest.approx(3 * block / HW8.intra_link.bandwidth, rel=1e-12) and low.lat[c] == LNV
    assert low.part_dev.tolist() == [0, 1, 2, 3] and low.part_alloc.tolist() == [3 * block] * 4
    # every device reads every row: each sends its whole block to the 3 others, a ring all-gather
    b3 = GraphBuilder()
    b3.matmul(b3.relu(b3.input("x", (256, 256)), name="a"), b3.input("w", (256, 64)), name="b")
    g3 = place(split(b3.build(), "a", 0, 4), "a", [0, 1, 2, 3])
    g3 = retile(g3, "b", [1, 4], [0, 1, 2, 3])  # b's 4 column blocks each read every row of a
    low3 = Lowerer(HW8, collectives=True).lower(g3)
    c3 = low3.n_compute
    S = 256 * 256 * 4
    assert low3.kind[c3:].tolist() == [2]
    assert low3.dur[c3] == pytest.approx(3 / 4 * S / BNV, rel=1e-12) and low3.lat[c3] == pytest.approx(3 * LNV)
    # one device's rows read in 4 blocks on devices 0-3: a scatter (each peer a different block),
    # not a broadcast of one block: the source's egress carries all three
    g4 = retile(b.build(), "b", [4, 1], [0, 1, 2, 3])  # a: one shard on device 0
    low4 = Lowerer(HW8, collectives=True).lower(g4)
    c4 = low4.n_compute
    assert low4.kind[c4:].tolist() == [2] and low4.alloc[c4] == 3 * S / 4
    assert low4.dur[c4] == pytest.approx(3 * S / 4 / HW8.intra_link.bandwidth, rel=1e-12)


def test_classify():
    a = np.array
    # 3 devices each sending the same box to the 2 others: an all-gather
    src, dst, shard = a([0, 0, 1, 1, 2, 2]), a([1, 2, 0, 2, 0, 1]), a([0, 0, 1, 1, 2, 2])
    assert classify(False, src, dst, np.full(6, 8.0), shard) == "all_gather"
    assert classify(True, src, dst, np.full(6, 8.0), shard) == "reduce_scatter"
    # different boxes to different devices: an all-to-all
    assert classify(False, src, dst, a([8.0, 4, 8, 4, 8, 4]), shard) == "all_to_all"
    assert classify(False, src, dst, np.full(6, 8.0), a([0, 1, 1, 2, 2, 3])) == "all_to_all"  # shards 0 and 3 sent once
    # equal sizes, but each source sends different boxes: an all-to-all; the same box: all-gather
    assert classify(False, src, dst, np.full(6, 8.0), shard, a([1.0, 2, 3, 4, 5, 6])) == "all_to_all"
    assert classify(False, src, dst, np.full(6, 8.0), shard, a([1.0, 1, 2, 2, 3, 3])) == "all_gather"
    # one source: the same box to each is a broadcast, a different one a scatter (an all-to-all)
    assert classify(False, a([0, 0]), a([1, 2]), a([8.0, 8.0]), a([0, 0]), a([5.0, 5.0])) == "broadcast"
    assert classify(False, a([0, 0]), a([1, 2]), a([8.0, 8.0]), a([0, 0]), a([5.0, 6.0])) == "all_to_all"
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


def _microbatched_reads(cast: bool):
    """``W`` (a loop-carried state, its update split over devices 0-3) read by ``mm`` in two
    microbatches on each of devices 0-3, directly or through its cast (made from states only);
    ``mm``'s output read by ``act`` in two microbatches on each of devices 4-7."""
    b = GraphBuilder()
    x, W, d = b.input("x", (M, K), "bfloat16" if cast else None), b.parameter("W", (K, N)), b.input("d", (K, N))
    w = b.op("cast", "cast", {"x": W}, dtype="bfloat16") if cast else W
    b.matmul(x, w, name="mm")
    b.op("relu", "act", {"x": "mm.out"})
    b.sub(W, d, name="upd")
    g = rename(b.build(), "upd.out", next_name("W"), "output")
    if cast:
        g = place(split(g, "cast", 0, 4), "cast", [0, 1, 2, 3])
    g = place(split(g, "mm", 0, 8), "mm", [0, 0, 1, 1, 2, 2, 3, 3])
    g = place(split(g, "act", 0, 8), "act", [4, 4, 5, 5, 6, 6, 7, 7])
    return place(split(g, "upd", 0, 4), "upd", [0, 1, 2, 3])


@pytest.mark.parametrize("cast", [False, True])
def test_what_holds_no_batch_is_gathered_once_for_every_microbatch(cast):
    """A state (or its cast) read by several microbatches on a device is gathered by one
    collective that feeds them all (the data is the same for every microbatch); a producer of
    batch rows read by microbatches stays point to point (one collective would make every
    microbatch wait for all of them and serialise a pipeline)."""
    g = _microbatched_reads(cast)
    low = Lowerer(HW8, collectives=True).lower(g)
    nc = low.n_compute
    names = list(low.op_names)
    off = low.op_offsets
    mm = np.arange(off[names.index("mm")], off[names.index("mm") + 1])
    coll = [i for i in range(nc, len(low.kind)) if low.kind[i] == 2]
    assert len(coll) == 1
    c = coll[0]
    assert low.part_dev[low.part_ptr[c]:low.part_ptr[c + 1]].tolist() == [0, 1, 2, 3]
    assert sorted(low.succ_idx[low.succ_ptr[c]:low.succ_ptr[c + 1]].tolist()) == mm.tolist()
    # mm's output (batch rows, two shards per device) goes to devices 4-7 point to point
    src = np.array(names)[low.transfer_src_op]
    assert set(src[low.kind[nc:] == 1]) == {"mm"} and set(src[low.kind[nc:] == 2]) == {"cast" if cast else "upd"}
    # batch rows made on devices 4-7 (one shard each) and read whole by two shards on each of
    # devices 0-3: an all-gather, kept point to point (made from an input, not from states)
    b = GraphBuilder()
    b.op("relu", "pre", {"x": b.input("x", (M, K))})
    b.matmul(b.input("y", (M, M)), "pre.out", name="mm2")
    h0 = place(split(b.build(), "pre", 0, 4), "pre", [4, 5, 6, 7])
    h = place(split(h0, "mm2", 0, 8), "mm2", [0, 0, 1, 1, 2, 2, 3, 3])
    low2 = Lowerer(HW8, collectives=True).lower(h)
    assert np.all(low2.kind[low2.n_compute:] == 1) and low2.n_transfer == 16
    one = place(split(h0, "mm2", 0, 4), "mm2", [0, 1, 2, 3])  # one reader shard per device: a collective
    assert Lowerer(HW8, collectives=True).lower(one).kind[-1] == 2
    # a shard moved beside another (device 2 holds two of the 4 shards: fewer than two a device) is
    # no microbatch: still one collective
    moved = Lowerer(HW8, collectives=True).lower(place(split(h0, "mm2", 0, 4), "mm2", [0, 1, 2, 2]))
    assert moved.kind[moved.n_compute:].tolist() == [2]
    assert moved.part_dev.tolist() == [0, 1, 2, 4, 5, 6, 7]
    e = Evaluator(HW8)(g)
    assert e.feasible and np.isfinite(e.makespan)


def test_each_data_parallel_replica_reduces_on_its_own():
    """Tensor x data parallel: the partials of a split reduction summed inside each of 8 nodes
    (rows of the batch on node ``r``, the reduction split over its 8 GPUs, the sum scattered
    over them) are 8 independent reduce-scatters, each over NVLink inside its node at the ring's
    closed form, not one 64-rank collective across the nodes (which would hold every NIC)."""
    M, Kr, Nr = 1024, 4096, 1024
    b = GraphBuilder()
    b.matmul(b.input("x", (M, Kr)), b.parameter("W", (Kr, Nr)), name="mm")
    g = split_reduction(b.build(), "mm", 8)
    g = retile(g, "mm", [8, 8, 1], [8 * r + p for p in range(8) for r in range(8)])  # partial p of rows r
    g = retile(g, "mm.acc", [8, 8], [8 * r + j for r in range(8) for j in range(8)])
    low = Lowerer(HW64, collectives=True).lower(g)
    nc = low.n_compute
    coll = np.arange(nc, len(low.kind))
    assert np.all(low.kind[coll] == 2) and coll.shape[0] == 8
    S = 4.0 * (M // 8) * Nr  # one replica's sum, float32
    for r, c in enumerate(coll):
        assert sorted(low.part_dev[low.part_ptr[c]:low.part_ptr[c + 1]].tolist()) == list(range(8 * r, 8 * r + 8))
        assert low.link[c] == 1  # NVLink only: no NIC port held
        assert low.dur[c] == pytest.approx(7 / 8 * S / BNV, rel=1e-12)
        assert low.lat[c] == pytest.approx(7 * LNV, rel=1e-12)
        # edges: the replica's 8 partials in, its 8 sums out
        preds = [u for u in range(nc) if c in low.succ_idx[low.succ_ptr[u]:low.succ_ptr[u + 1]]]
        assert sorted(low.dev[preds].tolist()) == list(range(8 * r, 8 * r + 8))
        outs = low.succ_idx[low.succ_ptr[c]:low.succ_ptr[c + 1]]
        assert sorted(low.dev[outs].tolist()) == list(range(8 * r, 8 * r + 8))
    e = Evaluator(HW64)(g)
    assert e.feasible


def test_microbatches_partials_are_summed_in_place_on_their_own_devices_then_reduced_once():
    """A Megatron 3D plan (tiny llama on 64 GPUs: 4 stages of TP8 x DP2, 8 microbatches): each
    device's weight-gradient partials of its 8 microbatches are summed in one buffer on that
    device as they come (Megatron-LM's main_grad; the first level of ``two_level`` placed on the
    partials' own pieces, ``hierarchical.own_boxes``), so no partial crosses a link, and only
    the sums are reduced among the devices: the bytes moved do not grow with the microbatches.
    Before, the first level was cut over rows while tensor parallelism cuts some weights over
    columns, so every microbatch's partial went in part to the device's tensor-parallel peers
    (26.74 MB moved here, 25.54 MB now)."""
    from ir import workloads
    from optimizer.search.baselines import megatron_3d

    step = workloads.build("llama", layers=4, d_model=64, heads=8, kv_heads=8, d_ff=128, vocab=64, seq=16,
                           batch=16, mode="train")
    plan = megatron_3d(step, 64, pp=4)
    first = [name for name, o in plan.ops.items() if o.kernel == "accumulate" and o.params.get("split")]
    # 9 gradients a layer (7 weights, 2 norms), the embedding's, the head's, the final norm's, the loss
    assert len(first) == 40
    low = Lowerer(HW64, collectives=True).lower(plan)
    nc, n = low.n_compute, low.kind.shape[0]
    names = list(low.op_names)
    index = {name: i for i, name in enumerate(names)}
    offsets = np.asarray(low.op_offsets)
    preds: dict[int, list[int]] = {}
    for u in range(n):
        for v in low.succ_idx[low.succ_ptr[u]:low.succ_ptr[u + 1]]:
            preds.setdefault(int(v), []).append(u)
    for name in first:
        producer = plan.producers[plan.ops[name].inputs[0][1]]
        carried = [c for c in range(nc, n) if names[low.transfer_src_op[c - nc]] == producer
                   and names[low.transfer_op[c - nc]] == name]
        assert carried == [], name  # no partial crosses a link
        i = index[name]
        for u in range(offsets[i], offsets[i + 1]):
            assert low.acc[u]  # summed in place
            src = preds[u]
            assert len(src) == 8 and all(x < nc and low.dev[x] == low.dev[u] for x in src), name
    moved = {}
    for m in (2, 4):
        lm = Lowerer(HW64, collectives=True).lower(megatron_3d(step, 64, pp=4, m=m))
        moved[m] = lm.alloc[lm.n_compute:].sum()
    assert moved[2] == moved[4] == pytest.approx(low.alloc[nc:].sum(), rel=1e-12)
    assert low.alloc[nc:].sum() == pytest.approx(25_535_716.0, rel=1e-9)


def test_shard_exchanges_split_microbatches_and_refuse_mixed_partials():
    """``_kernels.shard_exchanges``: two microbatches' partials on devices 0-2, each reduced into
    its own microbatch's accumulate shards on the same devices, are two exchanges (over devices
    they would be one); partials of both microbatches reduced into one shard per device (an
    accumulation across microbatches) are refused (-1: the lowering sums each device's
    microbatches in place and reduces per exchange of devices instead)."""
    from costmodel._kernels import shard_exchanges

    # producer shard p = 3·j + d (microbatch j on device d); reader shard 3·j + e on device e
    p_dev = np.array([0, 1, 2, 0, 1, 2], np.int64)
    local, trans, reads = [], [], []
    for j in range(2):
        for d in range(3):
            for e in range(3):
                if d == e:
                    local.append((3 * j + d, 0, 3 * j + e))
                else:
                    reads.append((len(trans), 0, 3 * j + e))
                    trans.append((3 * j + d, e, 0))
    rows = np.array(local + trans + reads, np.int64)
    ex, n = shard_exchanges(rows, len(local), len(trans), 6, np.array([6], np.int64), p_dev, 8)
    assert n == 2
    assert ex.tolist() == [0] * 6 + [1] * 6  # the first six transfers are microbatch 0's
    # one accumulate shard per device for both microbatches: reader shard e
    rows2 = rows.copy()
    rows2[:, 2] = np.where(np.arange(len(rows)) < len(local), rows[:, 2] % 3, rows[:, 2])
    rows2[len(local) + len(trans):, 2] %= 3
    ex2, n2 = shard_exchanges(rows2, len(local), len(trans), 6, np.array([3], np.int64), p_dev, 8)
    assert n2 == -1


def test_each_microbatch_reduces_in_its_own_collective():
    """A Megatron 3D plan (tiny llama on 64 GPUs: tensor parallelism over each node's 8 GPUs x 2
    data-parallel replicas x 4 stages, 8 microbatches): each microbatch's tensor-parallel
    reduction of ``o_proj`` is one collective among its replica's 8 devices, fed by that
    microbatch's partials and feeding that microbatch's accumulate shards only (16 per layer:
    8 microbatches x 2 replicas; they were 56 point-to-point transfers each); the sends between
    the stages stay point to point."""
    from costmodel.lookahead import _microbatch_of_nodes, pipeline_units
    from ir import workloads
    from optimizer.search.baselines import megatron_3d

    step = workloads.build("llama", layers=4, d_model=64, heads=8, kv_heads=8, d_ff=128, vocab=64, seq=16,
                           batch=16, mode="train")
    plan = megatron_3d(step, 64, pp=4)
    low = Lowerer(HW64, collectives=True).lower(plan)
    nc, n = low.n_compute, low.kind.shape[0]
    mb = _microbatch_of_nodes(low, plan)
    names = np.array(low.op_names)
    preds: dict[int, list[int]] = {}
    for i in range(nc):
        for v in low.succ_idx[low.succ_ptr[i]:low.succ_ptr[i + 1]]:
            preds.setdefault(int(v), []).append(i)
    coll = [c for c in range(nc, n) if low.kind[c] == 2 and names[low.transfer_src_op[c - nc]] == "l0.o_proj"]
    assert len(coll) == 16
    seen = set()
    for c in coll:
        readers = low.succ_idx[low.succ_ptr[c]:low.succ_ptr[c + 1]]
        ranks = low.part_dev[low.part_ptr[c]:low.part_ptr[c + 1]]
        j = set(mb[readers].tolist() + mb[preds[c]].tolist())
        assert len(j) == 1 and min(j) >= 0  # one microbatch's partials and readers
        assert set(names[np.searchsorted(low.op_offsets, readers, side="right") - 1]) == {"l0.o_proj.acc"}
        assert len(ranks) == 8 and len(set(ranks // 8)) == 1  # one node: the tensor-parallel group
        seen.add((min(j), int(ranks[0]) // 8))
    assert len(seen) == 16
    stage = pipeline_units(low, plan).stage
    t = np.arange(nc, n)[low.kind[nc:] == 1]
    assert (stage[low.dev[t]] != stage[low.dst[t]]).any()  # the pipeline's sends
    e = Evaluator(HW64)(plan)
    assert e.feasible and np.isfinite(e.makespan)


@pytest.mark.parametrize("readers, n", [([4, 5, 6, 7], 8), ([2, 3, 4, 5], 6)])
def test_a_gather_to_devices_holding_none_of_it_is_not_faster_than_their_ports(readers, n):
    """Rows of ``a`` in 4 blocks on devices 0-3, every row read by ``b`` on devices that hold
    none (or some) of them: each of those receives the whole tensor ``S``, so a ring all-gather
    lasts at least ``S / B``. The buffer was taken as (bytes moved) / (n - 1), which for sources
    that are not readers is below ``S`` (4S/7 on 8 ranks): the collective ran at 0.5 S / B, a
    device receiving 1 MiB at 720 GB/s over a 450 GB/s link. As a ring over ``n`` ranks each
    receiving ``(n-1)/n`` of the buffer, the buffer is ``n/(n-1)`` x the most a rank receives."""
    b = GraphBuilder()
    b.matmul(b.relu(b.input("x", (256, 256)), name="a"), b.input("w", (256, 64)), name="b")
    g = place(split(b.build(), "a", 0, 4), "a", [0, 1, 2, 3])
    g = retile(g, "b", [1, 4], readers)
    low = Lowerer(HW8, collectives=True).lower(g)
    c = low.n_compute
    S = 256 * 256 * 4
    assert low.kind[c:].tolist() == [2]
    assert low.part_alloc.max() == S  # a reader on a device without rows receives all of them
    assert low.dur[c] == pytest.approx(S / BNV, rel=1e-12)  # (n-1)/n x n/(n-1) S over B
    assert low.lat[c] == pytest.approx((n - 1) * LNV, rel=1e-12)
    # the same for partials reduced onto devices that computed none of them
    b2 = GraphBuilder()
    b2.matmul(b2.input("x", (256, 1024)), b2.parameter("W", (1024, 256)), name="mm")
    g2 = split_reduction(b2.build(), "mm", 4)
    g2 = retile(g2, "mm", [4, 1, 1], [0, 1, 2, 3])
    g2 = retile(g2, "mm.acc", [4, 1], readers)
    low2 = Lowerer(HW8, collectives=True).lower(g2)
    c2 = low2.n_compute
    assert low2.kind[c2:].tolist() == [2]
    recv = low2.part_alloc.max()  # 4 partials (or 3 sent) of a quarter of the output
    assert low2.dur[c2] == pytest.approx(n / (n - 1) * recv * (n - 1) / n / BNV, rel=1e-12)
    assert low2.dur[c2] >= recv / BNV * (1 - 1e-12)


@pytest.mark.parametrize("counts", [[2, 1], [8, 4], [1, 8], [8, 8, 2]])
def test_uneven_nodes_nic_time_is_set_by_the_node_with_fewest_ranks(counts):
    """An all-gather of ``S`` over nodes holding different numbers of ranks: the node with the
    fewest ranks ``g_min`` receives the others' ``(n - g_min)/n · S`` over its ``g_min`` NICs, so
    neither algorithm can beat ``(n - g_min)/n · S / (g_min · B_nic)``. Both took ``g`` = the most
    ranks on a node for the NIC term too (on 2 + 1 ranks, the lone rank on its node received
    2/3 S over one NIC in 1.7 µs: 96 GB/s on a 50 GB/s NIC). With equal counts nothing changes."""
    S = 64e6
    n, gmin, gmax = sum(counts), min(counts), max(counts)
    for kind, passes in (("all_gather", 1), ("reduce_scatter", 1), ("all_reduce", 2)):
        c = collective_time(kind, S, counts, HW64)
        floor = passes * (n - gmin) / n * S / (gmin * BIB)
        assert c.bandwidth_s >= floor * (1 - 1e-12)
        ring = passes * (n - 1) / n * S / min(BNV, gmin * BIB)
        hier = passes * ((gmax - 1) / gmax * S / BNV + (n - gmin) / n * S / (gmin * BIB))
        assert c.bandwidth_s == pytest.approx(min(ring, hier), rel=1e-12)
    # equal counts: the closed forms of the module docstring, as before
    c = collective_time("all_gather", S, [4, 4], HW64)
    assert c.bandwidth_s == pytest.approx(min(7 / 8 * S / min(BNV, 4 * BIB), 3 / 4 * S / BNV + 1 / 2 * S / 4 / BIB),
                                          rel=1e-12)
