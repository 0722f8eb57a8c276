"""The numba list scheduler: hand-computed schedules, memory, errors, energy, random DAGs."""

import heapq
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodel.energy import energy_breakdown, energy_joules, schedule_energy
from costmodel.presets import PRESETS
from costmodel.simulate import SimulationError, csr_from_edges, simulate, simulate_arrays, warmup

C, T = 0, 1


def run(nodes, edges=(), n_devices=2, resident=None):
    """nodes: list of (kind, dev, dst, dur[, alloc_bytes[, lat]]); edges: list of (i, j)."""
    n = len(nodes)
    kind = np.array([nd[0] for nd in nodes], np.int8)
    dev = np.array([nd[1] for nd in nodes], np.int32)
    dst = np.array([nd[2] for nd in nodes], np.int32)
    dur = np.array([nd[3] for nd in nodes], np.float64)
    alloc = np.array([nd[4] if len(nd) > 4 else 0.0 for nd in nodes], np.float64)
    lat = np.array([nd[5] if len(nd) > 5 else 0.0 for nd in nodes], np.float64)
    e = np.array(edges, np.int64).reshape(-1, 2)
    ptr, idx = csr_from_edges(n, e[:, 0], e[:, 1])
    res = np.zeros(n_devices) if resident is None else np.asarray(resident, np.float64)
    return simulate(kind, dev, dst, dur, ptr, idx, alloc, res, n_devices, lat=lat)


def test_warmup_compiles():
    assert warmup() >= 0.0
    assert warmup() < 0.5  # second call: already compiled in this process


def test_chain_on_one_device_sums():
    s = run([(C, 0, -1, 1.0), (C, 0, -1, 2.0), (C, 0, -1, 3.0)], [(0, 1), (1, 2)], n_devices=1)
    np.testing.assert_array_equal(s.start, [0, 1, 3])
    np.testing.assert_array_equal(s.finish, [1, 3, 6])
    assert s.makespan == 6.0 and s.critical_path == 6.0
    np.testing.assert_array_equal(s.busy_compute, [6.0])
    np.testing.assert_array_equal(s.rank, [6, 5, 3])
    np.testing.assert_array_equal(s.order, [0, 1, 2])


def test_independent_nodes_on_two_devices_run_in_parallel():
    s = run([(C, 0, -1, 2.0), (C, 1, -1, 3.0)])
    np.testing.assert_array_equal(s.start, [0, 0])
    assert s.makespan == 3.0
    assert s.devices_used == 2


def test_transfer_timing_from_hardware():
    for preset, a, b, link in (("h100-sxm-8", 0, 1, "intra_link"), ("h100-sxm-64", 0, 8, "inter_link")):
        hw = PRESETS[preset]
        nbytes = 2e9
        t = float(hw.transfer_time(a, b, nbytes))
        lk = getattr(hw, link)
        assert t == pytest.approx(lk.latency + nbytes / lk.bandwidth)
        occ, lat = nbytes / lk.bandwidth, lk.latency  # port time, latency
        s = run([(C, a, -1, 1.0), (T, a, b, occ, nbytes, lat), (C, b, -1, 1.0)], [(0, 1), (1, 2)],
                n_devices=hw.n_devices)
        assert s.start[1] == 1.0 and s.finish[1] == 1.0 + occ + lat
        assert s.start[2] == 1.0 + occ + lat  # the successor starts at start + dur + lat
        assert s.makespan == pytest.approx(2.0 + t)
        # the ports are occupied for bytes / bandwidth only
        assert s.busy_egress[a] == occ and s.busy_ingress[b] == occ and s.busy_comm[a] == occ
        assert s.bytes_moved == nbytes
        assert s.rank[0] == pytest.approx(1.0 + occ + lat + 1.0, rel=1e-15) and s.critical_path == s.rank[0]


def test_latency_pipelines_transfers_from_one_sender():
    # two transfers of b bytes from device 0 (to 1 and to 2): dur = b / bw, lat = link latency.
    # The port is busy for b / bw only, so the second starts when the first's bytes are out and
    # both latencies overlap: finishes b/bw + lat and 2·b/bw + lat (not 2·(lat + b/bw)).
    b, bw, lat = 64e3, 450e9, 2.5e-6
    occ = b / bw
    s = run([(T, 0, 1, occ, b, lat), (T, 0, 2, occ, b, lat)], n_devices=3)
    np.testing.assert_array_equal(s.start, [0.0, occ])
    np.testing.assert_array_equal(s.finish, [occ + lat, occ + occ + lat])
    assert s.makespan == 2 * occ + lat < 2 * (lat + occ)
    assert s.busy_egress[0] == 2 * occ and s.busy_ingress[1] == occ and s.busy_ingress[2] == occ
    # without pipelining (the latency folded into dur) they serialize: 2·(lat + b/bw)
    s0 = run([(T, 0, 1, lat + occ, b), (T, 0, 2, lat + occ, b)], n_devices=3)
    assert s0.makespan == 2 * (lat + occ)


def test_seven_partials_into_one_receiver_pay_one_latency():
    # the reduce-scatter case: 7 transfers of b bytes into device 0 (from 1..7) serialize on its
    # ingress for b / bw each; the last lands at 7·b/bw + lat, then the accumulate runs
    b, bw, lat, acc = 64e3, 450e9, 2.5e-6, 1e-6
    occ = b / bw
    nodes = [(T, k, 0, occ, b, lat) for k in range(1, 8)] + [(C, 0, -1, acc)]
    s = run(nodes, [(k, 7) for k in range(7)], n_devices=8)
    # equal ranks (occ + lat + acc): lower index first, each starting when the ingress frees
    np.testing.assert_allclose(s.start[:7], [k * occ for k in range(7)], rtol=1e-15)
    assert s.start[7] == pytest.approx(7 * occ + lat, rel=1e-15)
    assert s.makespan == pytest.approx(7 * occ + lat + acc, rel=1e-15)
    assert s.busy_ingress[0] == pytest.approx(7 * occ, rel=1e-15)


def test_port_is_free_after_bytes_over_bandwidth():
    # transfer A 0->1 (dur 1, lat 5); transfer B 0->2 (dur 1) and C 3->1 (dur 1) need A's ports:
    # they start at 1.0 (A's bytes are out), not at 6.0 (A's data lands); a successor of A
    # (compute on 1) starts at 0 + 1 + 5 = 6
    s = run([(T, 0, 1, 1.0, 0.0, 5.0), (T, 0, 2, 1.0), (T, 3, 1, 1.0), (C, 1, -1, 1.0)], [(0, 3)], n_devices=4)
    np.testing.assert_array_equal(s.rank, [7.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(s.start, [0.0, 1.0, 1.0, 6.0])
    np.testing.assert_array_equal(s.finish, [6.0, 2.0, 2.0, 7.0])
    assert s.makespan == 7.0 and s.critical_path == 7.0
    np.testing.assert_array_equal(s.busy_egress, [2.0, 0.0, 0.0, 1.0])
    np.testing.assert_array_equal(s.busy_ingress, [0.0, 2.0, 1.0, 0.0])
    assert s.max_device_load == 2.0


def test_latency_holds_no_compute_and_default_is_zero():
    # the same rule for compute nodes: a compute node with lat frees its device after dur
    s = run([(C, 0, -1, 1.0, 0.0, 3.0), (C, 0, -1, 1.0), (C, 1, -1, 1.0)], [(0, 2)])
    np.testing.assert_array_equal(s.start, [0.0, 1.0, 4.0])
    np.testing.assert_array_equal(s.finish, [4.0, 2.0, 5.0])
    # lat omitted == all zeros, in both wrappers
    kind, dev, dst, dur = [0, 1, 0], [0, 0, 1], [-1, 1, -1], [1.0, 0.5, 1.0]
    ptr, idx = csr_from_edges(3, [0, 1], [1, 2])
    args = (kind, dev, dst, dur, ptr, idx, [8.0, 8.0, 8.0], [0.0, 0.0], 2)
    a, b = simulate(*args), simulate(*args, lat=np.zeros(3))
    np.testing.assert_array_equal(a.finish, b.finish)
    np.testing.assert_array_equal(a.finish, [1.0, 1.5, 2.5])
    c = simulate_arrays(np.array(kind, np.int8), np.array(dev, np.int32), np.array(dst, np.int32), np.array(dur),
                        ptr, idx, np.full(3, 8.0), np.zeros(2), 2)
    np.testing.assert_array_equal(c.finish, a.finish)
    d = simulate_arrays(np.array(kind, np.int8), np.array(dev, np.int32), np.array(dst, np.int32), np.array(dur),
                        ptr, idx, np.full(3, 8.0), np.zeros(2), 2, lat=np.array([0.0, 0.25, 0.0]))
    np.testing.assert_array_equal(d.finish, [1.0, 1.75, 2.75])


def test_transfers_from_one_sender_serialize_on_egress():
    s = run([(T, 0, 1, 1.0), (T, 0, 2, 2.0)], n_devices=3)
    # rank 2 > rank 1: node 1 goes first
    np.testing.assert_array_equal(s.start, [2.0, 0.0])
    assert s.makespan == 3.0
    assert s.busy_egress[0] == 3.0 and s.busy_ingress[1] == 1.0 and s.busy_ingress[2] == 2.0


def test_transfers_into_one_receiver_serialize_on_ingress():
    s = run([(T, 1, 0, 1.0), (T, 2, 0, 1.0)], n_devices=3)
    np.testing.assert_array_equal(s.start, [0.0, 1.0])  # equal rank: lower index first
    assert s.makespan == 2.0


def test_different_pairs_and_both_directions_in_parallel():
    s = run([(T, 0, 1, 1.0), (T, 2, 3, 1.0), (T, 1, 0, 1.0)], n_devices=4)
    np.testing.assert_array_equal(s.start, [0.0, 0.0, 0.0])  # full duplex: 0->1 and 1->0 overlap
    assert s.makespan == 1.0


def test_compute_and_communication_overlap_on_a_device():
    s = run([(C, 0, -1, 2.0), (T, 0, 1, 2.0)], n_devices=2)
    np.testing.assert_array_equal(s.start, [0.0, 0.0])


def test_priority_order_when_competing_for_a_device():
    # node 0 and node 1 compete for device 0; node 1 feeds a long node on device 1 -> higher rank
    s = run([(C, 0, -1, 1.0), (C, 0, -1, 1.0), (C, 1, -1, 5.0)], [(1, 2)])
    np.testing.assert_array_equal(s.rank, [1.0, 6.0, 5.0])
    np.testing.assert_array_equal(s.start, [1.0, 0.0, 1.0])
    assert s.makespan == 6.0  # lower-index-first would give 7
    # no back-filling: a high-rank node waiting for input holds its device's order
    s = run([(C, 1, -1, 4.0), (C, 0, -1, 10.0), (C, 0, -1, 1.0)], [(0, 1)])
    np.testing.assert_array_equal(s.start, [0.0, 4.0, 14.0])


def test_memory_peak_lifetimes_resident_and_free_before_alloc():
    # device 0: resident 100; A(10) -> B(20) -> C(50) all on device 0, 1 s each.
    # A lives [0, 2) (freed when B finishes), B lives [1, 3), C lives [2, end).
    # at t=2 A's free (−10) comes before C's alloc (+50): peak 100 + 20 + 50 = 170, not 180.
    s = run([(C, 0, -1, 1.0, 10.0), (C, 0, -1, 1.0, 20.0), (C, 0, -1, 1.0, 50.0)], [(0, 1), (1, 2)],
            n_devices=2, resident=[100.0, 7.0])
    np.testing.assert_array_equal(s.peak_mem, [170.0, 7.0])
    assert s.max_peak_mem == 170.0
    assert s.fits(170.0) and not s.fits(169.0) and s.fits(np.array([170.0, 7.0]))
    assert s.used.tolist() == [True, True]  # resident bytes make device 1 used


def test_memory_keep_flag():
    # A(10) -> B(20) -> C(50) as above, but A is a graph output also read by B: keep it to the end
    nodes = [(C, 0, -1, 1.0, 10.0), (C, 0, -1, 1.0, 20.0), (C, 0, -1, 1.0, 50.0)]
    e = np.array([(0, 1), (1, 2)])
    ptr, idx = csr_from_edges(3, e[:, 0], e[:, 1])
    args = ([0, 0, 0], [0, 0, 0], [-1, -1, -1], [1.0, 1.0, 1.0], ptr, idx, [10.0, 20.0, 50.0], [100.0], 1)
    assert simulate(*args).peak_mem[0] == 170.0
    assert simulate(*args, keep=[True, False, False]).peak_mem[0] == 180.0
    with pytest.raises(SimulationError, match="keep"):
        simulate(*args, keep=[True])
    assert nodes  # same example as test_memory_peak_lifetimes_resident_and_free_before_alloc


def test_memory_transfer_buffer_lives_on_destination():
    # A on dev 0 (8 B) -> transfer 0->1 (8 B on dev 1) -> B on dev 1 (4 B) ; C on dev 1 (100 B) independent
    # C runs first on device 1 (rank 5 > B's 1) over [0, 5): then B runs [5, 6).
    nodes = [(C, 0, -1, 1.0, 8.0), (T, 0, 1, 1.0, 8.0), (C, 1, -1, 1.0, 4.0), (C, 1, -1, 5.0, 100.0)]
    s = run(nodes, [(0, 1), (1, 2)], n_devices=2, resident=[1.0, 2.0])
    np.testing.assert_array_equal(s.start, [0.0, 1.0, 5.0, 0.0])
    # dev 0: A live [0, 2): 1 + 8.  dev 1: C 100 from 0 (kept: no successor), transfer buffer [1, 6), B [5, end)
    np.testing.assert_array_equal(s.peak_mem, [9.0, 2.0 + 100.0 + 8.0 + 4.0])


def test_empty_and_single_node():
    s = run([], n_devices=3, resident=[1.0, 0.0, 0.0])
    assert s.makespan == 0.0 and s.devices_used == 1 and s.critical_path == 0.0
    np.testing.assert_array_equal(s.peak_mem, [1.0, 0.0, 0.0])
    s = run([(C, 2, -1, 0.0, 5.0)], n_devices=3)
    assert s.makespan == 0.0 and s.used.tolist() == [False, False, True]
    assert s.peak_mem[2] == 5.0


def test_cycle_detected():
    with pytest.raises(SimulationError, match="cycle") as ei:
        run([(C, 0, -1, 1.0)] * 5, [(4, 0), (0, 1), (1, 2), (2, 3), (3, 1)])
    msg = str(ei.value)
    assert "3 of 5 nodes" in msg
    cyc = msg.split("one cycle: ")[1].split(" -> ")
    assert set(cyc) == {"1", "2", "3"} and cyc[0] == cyc[-1] and len(cyc) == 4
    with pytest.raises(SimulationError, match="cycle"):
        run([(C, 0, -1, 1.0)], [(0, 0)])


def test_input_validation():
    good = dict(kind=[0, 1], dev=[0, 0], dst=[-1, 1], dur=[1.0, 1.0], succ_ptr=[0, 1, 1], succ_idx=[1],
                alloc_bytes=[0.0, 0.0], resident_bytes=[0.0, 0.0], n_devices=2)
    assert simulate(**good).makespan == 2.0
    assert simulate(**good, lat=[0.0, 0.5]).makespan == 2.5
    for change, pattern in (
        (dict(dev=[0, 2]), r"dev\[1\] = 2 out of range"),
        (dict(dst=[-1, -1]), r"dst\[1\] = -1 out of range"),
        (dict(dur=[1.0, -1.0]), r"dur\[1\]"),
        (dict(dur=[1.0, np.nan]), r"dur\[1\]"),
        (dict(kind=[0, 3]), "kind"),
        (dict(succ_ptr=[0, 1]), "succ_ptr"),
        (dict(succ_ptr=[0, 2, 1]), "succ_ptr"),
        (dict(succ_idx=[5]), "succ_idx"),
        (dict(dev=[0]), "dev: length"),
        (dict(resident_bytes=[0.0]), "resident_bytes"),
        (dict(alloc_bytes=[0.0, -1.0]), "alloc_bytes"),
        (dict(n_devices=0), "n_devices"),
        (dict(dev=[0.5, 0]), "integers"),
        (dict(lat=[0.0, -1.0]), r"lat\[1\]"),
        (dict(lat=[np.inf, 0.0]), r"lat\[0\]"),
        (dict(lat=[0.0]), "lat: length"),
    ):
        with pytest.raises(SimulationError, match=pattern):
            simulate(**{**good, **change})


def test_csr_from_edges():
    ptr, idx = csr_from_edges(4, [2, 0, 2, 1], [3, 1, 0, 3])
    assert ptr.dtype == np.int64 and idx.dtype == np.int32
    np.testing.assert_array_equal(ptr, [0, 1, 2, 4, 4])
    np.testing.assert_array_equal(idx, [1, 3, 3, 0])
    with pytest.raises(SimulationError):
        csr_from_edges(2, [0], [2])


def test_energy():
    hw = PRESETS["h100-sxm-64"]
    d = hw.device
    # makespan 10 s; dev 0 computes 4 s, dev 1 computes 0 s but is used, dev 2 unused
    e = energy_breakdown(10.0, [4.0, 0.0, 0.0], [True, True, False], d, [1e9, 2e9], [1e-11, 1e-10])
    assert e.compute == pytest.approx(700 * 4)
    assert e.idle == pytest.approx(d.idle_power * (6 + 10))
    assert e.transfer == pytest.approx(1e-2 + 2e-1)
    assert energy_joules(10.0, [4.0, 0.0, 0.0], [True, True, False], d, [1e9, 2e9], [1e-11, 1e-10]) \
        == pytest.approx(e.total)
    # from a schedule: compute on 0 (1 s), 1 GB 0 -> 8 across nodes, compute on 8 (1 s); the
    # transfer holds the NICs for 1e9 / bw and lands after t = lat + 1e9 / bw: makespan 2 + t
    t = float(hw.transfer_time(0, 8, 1e9))
    kind, dev, dst = np.array([0, 1, 0]), np.array([0, 0, 8]), np.array([-1, 8, -1])
    alloc = np.array([1e9, 1e9, 1.0])
    ptr, idx = csr_from_edges(3, [0, 1], [1, 2])
    s = simulate(kind, dev, dst, [1.0, 1e9 / hw.inter_link.bandwidth, 1.0], ptr, idx, alloc, np.zeros(64), 64,
                 lat=[0.0, hw.inter_link.latency, 0.0])
    assert s.makespan == pytest.approx(2 + t)
    eb = schedule_energy(s, hw, kind, dev, dst, alloc)
    assert eb.compute == pytest.approx(2 * 700.0)
    assert eb.idle == pytest.approx(2 * d.idle_power * (2 + t - 1))
    assert eb.transfer == pytest.approx(1e9 * hw.inter_link.energy_per_byte)


# ---------------------------------------------------------------------------------------------
# random DAGs: invariants and agreement with a plain-Python reference implementation
# ---------------------------------------------------------------------------------------------


def reference(kind, dev, dst, dur, lat, succ, alloc, resident, nd):
    n = len(kind)
    preds = [[] for _ in range(n)]
    for i in range(n):
        for j in succ[i]:
            preds[j].append(i)
    # topological order by DFS, then upward rank
    order, state = [], [0] * n

    def visit(u):
        state[u] = 1
        for v in succ[u]:
            if state[v] == 0:
                visit(v)
        state[u] = 2
        order.append(u)

    for u in range(n):
        if state[u] == 0:
            visit(u)
    rank = [0.0] * n
    for u in order:  # reverse topological (post-order)
        rank[u] = dur[u] + lat[u] + max((rank[v] for v in succ[u]), default=0.0)
    left = [len(p) for p in preds]
    heap = [(-rank[i], i) for i in range(n) if left[i] == 0]
    heapq.heapify(heap)
    free = {}
    start, finish = [0.0] * n, [0.0] * n
    while heap:
        _, u = heapq.heappop(heap)
        res = [("c", dev[u])] if kind[u] == 0 else [("e", dev[u]), ("i", dst[u])]
        t = max([finish[p] for p in preds[u]] + [free.get(r, 0.0) for r in res])
        start[u], finish[u] = t, t + dur[u] + lat[u]  # data available after the latency
        for r in res:
            free[r] = t + dur[u]  # the resources only for dur
        for v in succ[u]:
            left[v] -= 1
            if left[v] == 0:
                heapq.heappush(heap, (-rank[v], v))
    # memory: brute force over allocation instants; live iff start <= t < free
    peak = list(resident)
    for d in range(nd):
        bufs = []
        for i in range(n):
            loc = dev[i] if kind[i] == 0 else dst[i]
            if loc == d and alloc[i] > 0:
                fr = max((finish[j] for j in succ[i]), default=math.inf)
                bufs.append((start[i], fr, alloc[i]))
        for t0, _, _ in bufs:
            peak[d] = max(peak[d], resident[d] + sum(b for s0, f0, b in bufs if s0 <= t0 < f0))
    return start, finish, rank, peak


@st.composite
def dags(draw):
    n = draw(st.integers(1, 30))
    nd = draw(st.integers(2, 4))
    perm = draw(st.permutations(range(n)))  # node labels not in topological order
    edges = set()
    for j in range(1, n):
        for i in draw(st.lists(st.integers(0, j - 1), max_size=3)):
            edges.add((perm[i], perm[j]))
    durs = st.one_of(st.just(0.0), st.sampled_from([0.5, 1.0, 2.0]), st.floats(0.001, 10.0))
    lats = st.one_of(st.just(0.0), st.sampled_from([0.25, 1.0, 3.0]), st.floats(0.001, 5.0))
    kind, dev, dst, dur, lat, alloc = [], [], [], [], [], []
    for _ in range(n):
        k = draw(st.integers(0, 1))
        a = draw(st.integers(0, nd - 1))
        b = (a + draw(st.integers(1, nd - 1))) % nd if k == 1 else -1
        kind.append(k), dev.append(a), dst.append(b), dur.append(draw(durs))
        lat.append(draw(lats) if k == 1 or draw(st.integers(0, 4)) == 0 else 0.0)  # mostly 0 on compute
        alloc.append(draw(st.sampled_from([0.0, 1.0, 2.0, 5.0, 100.0])))
    resident = draw(st.lists(st.sampled_from([0.0, 3.0]), min_size=nd, max_size=nd))
    return n, nd, sorted(edges), kind, dev, dst, dur, lat, alloc, resident


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_random_dags(case):
    n, nd, edges, kind, dev, dst, dur, lat, alloc, resident = case
    e = np.array(edges, np.int64).reshape(-1, 2)
    ptr, idx = csr_from_edges(n, e[:, 0], e[:, 1])
    s = simulate(kind, dev, dst, dur, ptr, idx, alloc, resident, nd, lat=lat)
    dur_a = np.array(dur)
    lat_a = np.array(lat)
    tol = 1e-9 * (1.0 + dur_a.sum() + lat_a.sum())
    # precedence: a successor starts once the data has arrived (start + dur + lat)
    for i, j in edges:
        assert s.start[j] >= s.finish[i]
    np.testing.assert_allclose(s.finish - s.start, dur_a + lat_a, rtol=1e-12, atol=1e-12)
    # no overlap on any resource, each held over [start, start + dur)
    res = {}
    for u in range(n):
        keys = [("c", dev[u])] if kind[u] == 0 else [("e", dev[u]), ("i", dst[u])]
        for key in keys:
            res.setdefault(key, []).append((s.start[u], s.start[u] + dur[u]))
    for iv in res.values():
        iv.sort()
        for (s0, f0), (s1, f1) in zip(iv, iv[1:]):
            assert s1 >= f0
    # bounds
    succ = [list(idx[ptr[i]:ptr[i + 1]]) for i in range(n)]
    ref_start, ref_finish, ref_rank, ref_peak = reference(kind, dev, dst, dur, lat, succ, alloc, resident, nd)
    crit = max(ref_rank)
    load = max(sum(f - s_ for s_, f in iv) for iv in res.values())
    assert s.makespan >= crit - tol
    assert s.makespan >= load - tol
    assert s.makespan <= dur_a.sum() + lat_a.sum() + tol
    assert s.makespan == pytest.approx(max(s.finish))
    assert s.critical_path == pytest.approx(crit)
    # same schedule as the plain-Python reference (same priority rule, same tie-break)
    np.testing.assert_allclose(s.rank, ref_rank, rtol=1e-12)
    np.testing.assert_allclose(s.start, ref_start, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.finish, ref_finish, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.peak_mem, ref_peak, rtol=1e-12)
    # accounting
    bc = np.zeros(nd)
    for u in range(n):
        if kind[u] == 0:
            bc[dev[u]] += dur[u]
    np.testing.assert_allclose(s.busy_compute, bc, rtol=1e-12, atol=1e-12)
    assert sorted(s.order.tolist()) == list(range(n))
    touched = set(dev) | {d for d, k in zip(dst, kind) if k == 1} | {d for d in range(nd) if resident[d] > 0}
    assert set(np.flatnonzero(s.used).tolist()) == touched


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(), st.randoms(use_true_random=False))
def test_a_topological_hint_changes_no_schedule(case, rnd):
    """``topo_hint`` (a lowering's program order) spares the topological pass: with a
    topological order of the DAG, with an order that is not one (the pass runs after all) and
    without, the schedule is the same, bit for bit."""
    n, nd, edges, kind, dev, dst, dur, lat, alloc, resident = case
    e = np.array(edges, np.int64).reshape(-1, 2)
    ptr, idx = csr_from_edges(n, e[:, 0], e[:, 1])
    args = (np.array(kind, np.int8), np.array(dev, np.int32), np.array(dst, np.int32), np.array(dur), ptr, idx,
            np.array(alloc), np.array(resident, np.float64), nd)
    plain = simulate_arrays(*args, lat=np.array(lat))
    # a random topological order (Kahn's with a random choice among the ready nodes)
    left = np.bincount(idx, minlength=n)
    ready = [i for i in range(n) if left[i] == 0]
    topo = []
    while ready:
        u = ready.pop(rnd.randrange(len(ready)))
        topo.append(u)
        for v in idx[ptr[u]:ptr[u + 1]]:
            left[v] -= 1
            if left[v] == 0:
                ready.append(int(v))
    shuffled = list(range(n))
    rnd.shuffle(shuffled)
    for hint in (topo, shuffled, topo[::-1]):
        s = simulate_arrays(*args, lat=np.array(lat), topo_hint=np.array(hint, np.int32))
        for name in ("start", "finish", "rank", "peak_mem", "order", "busy_compute", "busy_egress"):
            np.testing.assert_array_equal(getattr(s, name), getattr(plain, name), err_msg=name)
        assert s.makespan == plain.makespan
    # control edges forward in the topological order (acyclic), as the lookahead's are
    pairs = {(topo[i], topo[j]) for i, j in (sorted(rnd.sample(range(n), 2)) for _ in range(n if n > 1 else 0))}
    cptr, cidx = csr_from_edges(n, [a for a, _ in sorted(pairs)], [b for _, b in sorted(pairs)])
    plain = simulate_arrays(*args, lat=np.array(lat), ctl_ptr=cptr, ctl_idx=cidx)
    for hint in (topo, shuffled):
        s = simulate_arrays(*args, lat=np.array(lat), ctl_ptr=cptr, ctl_idx=cidx, topo_hint=np.array(hint, np.int32))
        for name in ("start", "finish", "rank", "peak_mem", "order"):
            np.testing.assert_array_equal(getattr(s, name), getattr(plain, name), err_msg=name)


def test_a_gate_ranks_as_high_as_what_it_gates():
    """A control edge ``0 -> 1`` lets node 1 start only once node 0 has: node 0 (a loss value,
    whose result nothing reads) is a gate of the chain ``1 -> 2``, so it takes the chain's rank
    and runs before the fillers 3-5 that outrank it by their own work. Ranked by its data
    successors alone (none: its own 1 s), it ran after them and the chain's tail on device 1
    started at 8 s instead of 2 s (makespan 18 s against 12 s)."""
    kind = np.zeros(6, np.int8)
    dev = np.array([0, 0, 1, 0, 0, 0], np.int32)
    dur = np.array([1.0, 1.0, 10.0, 2.0, 2.0, 2.0])
    ptr, idx = csr_from_edges(6, [1], [2])
    cptr, cidx = csr_from_edges(6, [0], [1])
    args = (kind, dev, np.full(6, -1, np.int32), dur, ptr, idx, np.zeros(6), np.zeros(2), 2)
    for hint in (None, np.arange(6, dtype=np.int32), np.array([1, 0, 2, 3, 4, 5], np.int32)):  # the last: Kahn's
        s = simulate_arrays(*args, ctl_ptr=cptr, ctl_idx=cidx, topo_hint=hint)
        np.testing.assert_array_equal(s.rank, [11.0, 11.0, 10.0, 2.0, 2.0, 2.0])
        np.testing.assert_array_equal(s.start, [0.0, 1.0, 2.0, 2.0, 4.0, 6.0])
        assert s.makespan == 12.0 and s.critical_path == 11.0


def test_a_cycle_through_control_edges_is_found_with_a_hint():
    """The data edges in the hint's order, control edges closing a cycle: the list scheduler
    stalls, and the caller hears of the cycle as from the topological pass."""
    kind = np.zeros(3, np.int8)
    dev = np.zeros(3, np.int32)
    ptr, idx = csr_from_edges(3, [0, 1], [1, 2])  # 0 -> 1 -> 2
    cptr, cidx = csr_from_edges(3, [2], [1])  # 1 may start only once 2 has: a cycle
    args = (kind, dev, np.full(3, -1, np.int32), np.ones(3), ptr, idx, np.zeros(3), np.zeros(1), 1)
    hint = np.arange(3, dtype=np.int32)
    assert simulate_arrays(*args, ctl_ptr=cptr, ctl_idx=cidx, cycle_ok=True, topo_hint=hint) is None
    assert simulate_arrays(*args, ctl_ptr=cptr, ctl_idx=cidx, cycle_ok=True) is None
    for h in (hint, None):  # the message names the cycle, through the control edge
        with pytest.raises(SimulationError, match=r"2 of 3 nodes cannot be ordered\); one cycle: (1 -> 2 -> 1|2 -> 1 -> 2)$"):
            simulate_arrays(*args, ctl_ptr=cptr, ctl_idx=cidx, topo_hint=h)
    ok = simulate_arrays(*args, topo_hint=hint)
    np.testing.assert_array_equal(ok.start, [0, 1, 2])


def test_large_random_dag_schedules_every_node():
    """10k nodes on 64 devices: every node scheduled once, after its predecessors (timing lives in
    scripts/bench_costmodel.py, never in tests)."""
    rng = np.random.default_rng(1)
    n, nd = 10_000, 64
    j = np.repeat(np.arange(1, n), 2)
    i = j - 1 - rng.integers(0, np.minimum(j, 50))
    ptr, idx = csr_from_edges(n, i, j)
    kind = (rng.random(n) < 0.3).astype(np.int8)
    dev = rng.integers(0, nd, n).astype(np.int32)
    dst = np.where(kind == 1, (dev + 1 + rng.integers(0, nd - 1, n)) % nd, -1).astype(np.int32)
    lat = np.where(kind == 1, rng.random(n), 0.0)
    s = simulate(kind, dev, dst, rng.random(n), ptr, idx.astype(np.int32), rng.random(n) * 1e6, np.zeros(nd), nd,
                 lat=lat)
    assert sorted(s.order.tolist()) == list(range(n))
    assert np.all(s.start[j] >= s.finish[i] - 1e-12)


def _acc_case(acc_flags):
    """Three microbatch partials (100 B each, 1 s apart on device 0) summed by an accumulate node
    (100 B) on device 0; a fourth partial made on device 1 arrives by a transfer."""
    nodes = [(C, 0, -1, 1.0, 100.0), (C, 0, -1, 1.0, 100.0), (C, 0, -1, 1.0, 100.0),
             (C, 1, -1, 1.0, 100.0), (T, 1, 0, 1.0, 100.0), (C, 0, -1, 1.0, 100.0)]
    edges = [(0, 1), (1, 2), (0, 5), (1, 5), (2, 5), (3, 4), (4, 5)]
    n = len(nodes)
    kind = np.array([x[0] for x in nodes], np.int8)
    dev = np.array([x[1] for x in nodes], np.int32)
    dst = np.array([x[2] for x in nodes], np.int32)
    dur = np.array([x[3] for x in nodes])
    alloc = np.array([x[4] for x in nodes])
    e = np.array(edges)
    ptr, idx = csr_from_edges(n, e[:, 0], e[:, 1])
    return simulate(kind, dev, dst, dur, ptr, idx, alloc, np.zeros(2), 2, acc=acc_flags)


def test_partials_are_accumulated_in_place():
    """Without ``acc`` every partial lives until the accumulate ends: device 0 holds the three
    local partials, the received one and the sum at t = 3 (500 B). With it, a partial read only
    by the sum, on the sum's device, is added as it is made: node 2 lives over [2, 3), the
    received partial over [1, 2), and the sum is held from the first of them (t = 1). Nodes 0
    and 1 also feed the chain 0 -> 1 -> 2, so they are held until the sum ends, as before:
    400 B over [1, 3) (nodes 0 and 1, the sum, and the received partial or node 2)."""
    base = _acc_case(None)
    assert base.peak_mem[0] == 500.0
    acc = np.array([0, 0, 0, 0, 0, 1], bool)
    s = _acc_case(acc)
    np.testing.assert_array_equal(s.start, base.start)  # memory only: the schedule is the same
    assert s.peak_mem[0] == 400.0
    assert s.peak_mem[1] == 100.0  # the partial made on device 1 is read by its transfer, as before


def test_acc_flags_must_match_the_nodes():
    with pytest.raises(SimulationError, match="acc: length"):
        _acc_case(np.zeros(3, bool))


@pytest.mark.parametrize("n", [0, 1, 2, 31, 33, 1000, 30000])
def test_radix_argsort_is_numpys_stable_argsort(n):
    """The simulator's sort (three passes over the high digits, then runs equal there put in
    order by their low bits) equals a stable argsort, on times with ties, with long runs that
    differ only in low bits, on descending keys (priorities) and on arbitrary integers."""
    from costmodel.simulate import _radix_argsort

    rng = np.random.default_rng(n)
    t = rng.random(n)
    cases = [t.view(np.uint64), np.round(t, 2).view(np.uint64),
             np.where(rng.random(n) < 0.5, t, 0.5).view(np.uint64),
             (0.25 + rng.integers(0, 1000, n) * 1e-15).view(np.uint64),  # equal in bits 33-63
             ~t.view(np.uint64), rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)]
    for keys in cases:
        assert np.array_equal(_radix_argsort(keys), np.argsort(keys, kind="stable"))


@pytest.mark.parametrize("n", [0, 1, 2, 7, 9, 1000, 30000])
def test_stable_argsort_with_few_distinct_keys_is_numpys_stable_argsort(n):
    """The hashed counting sort (few distinct keys: a symmetric schedule's times and ranks) and
    its fallback to the radix sort (more than one key in eight distinct, found part way through)
    both equal a stable argsort: repeated times, repeated descending ranks, keys that collide in
    the hash's high bits, zeros, and distinct keys; so does the sort of runs of equal keys the
    simulator's priorities use, ascending and descending (``flip``)."""
    from costmodel.simulate import _argsort_runs, _hashed_argsort

    rng = np.random.default_rng(n)
    times = rng.random(max(n // 20, 1))
    few = times[rng.integers(0, times.shape[0], n)]  # at most one key in twenty distinct
    cases = [few.view(np.uint64), ~few.view(np.uint64), np.zeros(n, np.uint64),
             (np.uint64(1) << np.uint64(33)) * rng.integers(0, 8, n).astype(np.uint64),  # equal low bits
             np.where(np.arange(n) < n // 2, 0.5, rng.random(n)).view(np.uint64),  # distinct from the middle on
             rng.random(n).view(np.uint64)]
    for keys in cases:
        assert np.array_equal(_hashed_argsort(keys, n // 8 + 1, np.uint64(0)), np.argsort(keys, kind="stable"))
        for flip in (np.uint64(0), ~np.uint64(0)):
            assert np.array_equal(_argsort_runs(keys, flip), np.argsort(keys ^ flip, kind="stable"))


def test_a_collectives_buffer_lives_until_the_readers_on_its_device_end():
    """A collective (node 0) gives 100 bytes to devices 0 and 1; its reader on device 0 ends at
    1 s, the one on device 1 at 5 s; a 50-byte buffer made on device 0 at 1-2 s (node 3, after
    node 1) overlaps the collective's buffer there only if that lives until the other device's
    reader ends: device 0 peaks at 100 bytes, not 150. A participant without a reader of its own
    (device 2) keeps the buffer until the last reader ends."""
    kind, dev, dst = [2, 0, 0, 0], [0, 0, 1, 0], [-1, -1, -1, -1]
    dur = [0.0, 1.0, 5.0, 1.0]
    ptr, idx = csr_from_edges(4, [0, 0, 1], [1, 2, 3])
    s = simulate(kind, dev, dst, dur, ptr, idx, [0.0, 0.0, 0.0, 50.0], np.zeros(3), 3, link=[1, 0, 0, 0],
                 part_ptr=[0, 3, 3, 3, 3], part_dev=[0, 1, 2], part_alloc=[100.0, 100.0, 100.0])
    assert list(s.finish) == [0.0, 1.0, 5.0, 2.0]
    assert list(s.peak_mem) == [100.0, 100.0, 100.0]
    # the same buffer on device 0 read until 2 s: both live at once
    ptr, idx = csr_from_edges(4, [0, 0, 1, 0], [1, 2, 3, 3])
    s = simulate(kind, dev, dst, dur, ptr, idx, [0.0, 0.0, 0.0, 50.0], np.zeros(3), 3, link=[1, 0, 0, 0],
                 part_ptr=[0, 3, 3, 3, 3], part_dev=[0, 1, 2], part_alloc=[100.0, 100.0, 100.0])
    assert s.peak_mem[0] == 150.0


def test_microbatch_partials_are_summed_into_an_accumulating_collective():
    """Two microbatch partials on each of devices 0 and 1 (100 B, 1 s each: 0-1 and 1-2 s) read by
    one reduce-scatter (node 4, 2-3 s, 40 B received on each device) into accumulates on both
    (nodes 5, 6: 10 B, 3-4 s). As an accumulating collective (``acc``), each partial is added
    into the collective's buffer as it is made (Megatron-LM's main_grad): a device holds one
    partial and the 40 B buffer (from the first partial's start) at once, 140 B. Without it,
    both partials live until the reduction ends, with its buffer and the sums from its start:
    250 B. On a device that is not a participant, a partial keeps its buffer either way."""
    kind = [0, 0, 0, 0, 2, 0, 0]
    dev = [0, 0, 1, 1, 0, 0, 1]
    dst = [-1] * 7
    dur = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    ptr, idx = csr_from_edges(7, [0, 1, 2, 3, 4, 4], [4, 4, 4, 4, 5, 6])
    alloc = [100.0, 100.0, 100.0, 100.0, 0.0, 10.0, 10.0]
    peaks = {}
    for summed in (True, False):
        acc = [False, False, False, False, summed, True, True]
        s = simulate(kind, dev, dst, dur, ptr, idx, alloc, np.zeros(2), 2, link=[0, 0, 0, 0, 1, 0, 0],
                     part_ptr=[0, 0, 0, 0, 0, 2, 2, 2], part_dev=[0, 1], part_alloc=[40.0, 40.0], acc=acc)
        assert list(s.start) == [0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 3.0]  # memory only: the same schedule
        peaks[summed] = list(s.peak_mem)
    assert peaks == {True: [140.0, 140.0], False: [250.0, 250.0]}
    # a participant list without device 1: its partials are not added in place there
    s = simulate(kind, dev, dst, dur, ptr, idx, alloc, np.zeros(2), 2, link=[0, 0, 0, 0, 1, 0, 0],
                 part_ptr=[0, 0, 0, 0, 0, 1, 1, 1], part_dev=[0], part_alloc=[40.0],
                 acc=[False, False, False, False, True, True, True])
    assert list(s.peak_mem) == [140.0, 210.0]


def test_a_reduction_collective_holds_no_buffer_past_its_run():
    """A collective (node 0, 0-1 s, NVLink) whose readers all accumulate (a reduce-scatter into
    nodes 1 and 2, 1-3 s) adds its chunks into their outputs as they arrive, as a point-to-point
    partial into an accumulate does: its 100 bytes on device 0 are gone when it ends, so the 50
    bytes a transfer (node 3) brings to device 0 once the ports are free (1-2 s) meet only the
    accumulator's 10. Readers that are not accumulates keep it until they end: 160 bytes."""
    kind, dev, dst = [2, 0, 0, 1], [0, 0, 1, 1], [-1, -1, -1, 0]
    ptr, idx = csr_from_edges(4, [0, 0], [1, 2])
    for acc, peak in (([False, True, True, False], 110.0), ([False] * 4, 160.0)):
        s = simulate(kind, dev, dst, [1.0, 2.0, 2.0, 1.0], ptr, idx, [0.0, 10.0, 10.0, 50.0], np.zeros(2), 2,
                     link=[1, 0, 0, 0], part_ptr=[0, 2, 2, 2, 2], part_dev=[0, 1], part_alloc=[100.0, 100.0],
                     acc=acc)
        assert list(s.start) == [0.0, 1.0, 1.0, 1.0]
        assert s.peak_mem[0] == peak, (acc, s.peak_mem)
