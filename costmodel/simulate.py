"""Numba list scheduler: simulates a lowered plan (a DAG of compute and transfer nodes).

Array contract (what the lowering must produce)
===============================================

A plan is lowered to ``n`` nodes numbered ``0 .. n-1`` and ``m`` edges. Pass NumPy arrays; the
wrapper :func:`simulate` converts dtypes (no copy when they already match) and validates them
unless ``check=False``.

=================  ===================  =========================================================
array              dtype / shape        meaning
=================  ===================  =========================================================
``kind``           int8[n]              0 = compute (a shard), 1 = transfer (a copy between devices),
                                        2 = collective (see ``part_*``)
``dev``            int32[n]             compute: the device that runs it; transfer: the SOURCE device
``dst``            int32[n]             transfer: the DESTINATION device; compute: ignored, use -1
``dur``            float64[n]           OCCUPANCY in seconds, already computed by the caller: how
                                        long the node holds its resources. Compute = roofline +
                                        launch overhead (:meth:`Hardware.shard_time`); transfer =
                                        bytes / bandwidth of the link it crosses (the port time, NOT
                                        the latency). Finite, >= 0.
``lat``            float64[n], opt.     keyword-only LATENCY in seconds: added after the occupancy
                                        before the node's output is available, without holding any
                                        resource. Transfer = the link's latency (software + switch
                                        hops); compute = 0. Finite, >= 0; default: all zeros (then
                                        ``dur`` is the whole time, the contract before latencies
                                        were pipelined).
``succ_ptr``       int64[n+1]           CSR row pointers: successors of node ``i`` are
``succ_idx``       int32[m]             ``succ_idx[succ_ptr[i]:succ_ptr[i+1]]``. An edge ``i -> j``
                                        means j cannot start before i has finished, i.e. before
                                        ``start[i] + dur[i] + lat[i]`` (data dependence).
                                        ``succ_ptr[0] == 0``, non-decreasing, ``succ_ptr[n] ==
                                        m``. Duplicate edges are harmless; a cycle (self-loops
                                        included) is an error. :func:`csr_from_edges` builds these
                                        from an edge list.
``alloc_bytes``    float64[n]           bytes of the buffer the node PRODUCES: for a compute node it
                                        lives on ``dev[i]`` (its output box), for a transfer on
                                        ``dst[i]`` (the received box; this is also the number of
                                        bytes moved, summed into ``Schedule.bytes_moved``).
``resident_bytes`` float64[n_devices]   bytes resident on each device for the whole run (graph
                                        inputs and weights placed where their readers need them).
``n_devices``      int                  number of devices; every ``dev`` (and ``dst`` of transfers)
                                        is in ``0 .. n_devices-1``.
``keep``           bool[n], optional    keyword-only; True = never free this node's buffer even
                                        though it has successors (a graph output that is also
                                        read by other shards). Default: all False.
``acc``            bool[n], optional    keyword-only; True = an accumulate node: a buffer whose
                                        every successor is an ``acc`` node on the buffer's own
                                        device (for a collective: on its participants; for an
                                        ``acc`` collective it feeds: the buffer's device one of
                                        its participants) is added into them as it is produced
                                        (freed when its node finishes), and the accumulator's
                                        buffer is held from the start of its first such input
                                        (gradient accumulation in place). Default: all False.
                                        Any other collective's buffer on a participant lives
                                        until the readers there end.
``link``           int8[n], optional    keyword-only; which ports a node uses. Transfer: 0 = the
                                        intra-node port (NVLink), 1 = the inter-node port (NIC);
                                        collective: bit mask, 1 = NVLink ports, 2 = NIC ports.
                                        Default: all 0 (one port pair per device, the contract
                                        before NVLink and NIC were separate).
``part_ptr``       int64[n+1], opt.     keyword-only CSR of each collective's participants:
``part_dev``       int32[k]             devices ``part_dev[part_ptr[i]:part_ptr[i+1]]`` and the
``part_alloc``     float64[k]           bytes each receives (its buffer); empty for other nodes.
=================  ===================  =========================================================

How a graph maps onto this (the lowering's job, stated here so both sides agree): one compute
node per shard; when a consumer shard reads a box produced by a shard on the SAME device, an edge
producer -> consumer; on a DIFFERENT device, a transfer node (dev = producer's device, dst =
consumer's device, alloc_bytes = bytes of the intersecting box, dur = bytes / link bandwidth,
lat = link latency) with edges producer -> transfer -> consumer. Graph inputs and parameters are
not nodes: their bytes go into ``resident_bytes`` of every device that reads them, and reading
them costs no transfer time (DESIGN.md section 4) -- except loop-carried state (a training step's
parameters and optimizer states), which is resident only at its home and read elsewhere through
transfers (or collectives) without predecessors (``costmodel.lowering``).

Resources and timing model
--------------------------
Every device has five independent resources: its *compute* (one shard at a time), and an
*egress* and an *ingress* port on each of its two links, NVLink inside the node and the NIC
across nodes (one transfer at a time each; both links can run at once). A compute node occupies
``compute[dev]``; a transfer occupies ``egress[dev]`` and ``ingress[dst]`` of its link. A
*collective* (one NCCL call, see ``costmodel.collectives``) occupies the egress and ingress ports
of every participant on the links in its mask for its whole duration, starting when all of them
are free (all ranks of a collective progress together). Compute and communication of one device
overlap, at a price:

Contention (keyword ``contention``, a factor ``s >= 1``, default 1 = none; the lowering passes
``Hardware.contention``): communication uses SMs and HBM bandwidth of the devices it runs on
(NCCL kernels occupy SMs), so a compute node that runs while its device takes part in a transfer
or collective progresses at ``1/s`` of its speed for the overlap. A compute node placed at ``t``
with ``dur`` seconds of work, on a device whose last communication runs over ``[cs, ce)``, takes
``w0 + r·s`` if the window covers the rest ``r = dur - w0`` of its work (``w0 = max(cs - t, 0)``,
the work done before the window opens), else ``w0 + (ce - a) + (r - (ce - a)/s)`` with ``a = t +
w0``: fully overlapped compute is slowed by exactly ``s``, compute alone is unchanged.
Communication placed after compute it overlaps (the list scheduler places nodes in priority
order, not time order) charges ``(s - 1) x overlap`` to the device instead: its later compute
starts that much later, and the makespan is at least the device's last compute end; the overlapped
node's own ``finish`` is not moved (its successors may be placed already). ``busy_compute``
stays the sum of ``dur`` (the work; the slowdown shows in the times and the makespan).

Links pipeline: a node holds its resources for ``dur`` only, from ``start`` to ``start + dur``;
its output is available to its successors at ``finish = start + dur + lat``. For a transfer,
the bytes leave the sender's port and enter the receiver's port over ``bytes / bandwidth``, and
the latency (software, switch hops) delays their arrival without blocking the ports: a second
transfer from the same sender starts at ``start + dur`` of the first, so two back-to-back
transfers of ``b`` bytes finish at ``b/bw + lat`` and ``2·b/bw + lat`` (not ``2·(lat + b/bw)``).
The same rule applies to every node, so a compute node with ``lat > 0`` frees its device after
``dur`` (the lowering always gives compute nodes ``lat = 0``).

Scheduling: non-preemptive static list scheduling. Priority = upward rank
``rank[i] = max(dur[i] + lat[i] + max(rank[j] for j in succ(i)), max(rank[c] for c in ctl(i)))``
(0 for no successor), computed over a topological order of both kinds of edges. A control edge
``i -> c`` lets ``c`` start only once ``i`` has started, so a gate ranks at least as high as what
it gates (HEFT's upward rank over every precedence, the control edge costing no time): without
it a node whose result nothing reads soon (the loss value) ranks low, is listed late, and holds
back the high-rank work its device's lookahead window gates behind it (the llama2-7b Megatron
3D expert on 64 GPUs, its gradient partials summed in place: 329 ms with data-only ranks, 204
with these; docs/benchmarks.md, thirtieth session). Starting from the sources, the scheduler
repeatedly takes the *ready* node (all predecessors already scheduled) with the highest rank,
ties to the lower index, and starts it at ``start = max(finish of all predecessors, free time
of each resource it needs)``;
the resources are then busy until ``start + dur`` and the node finishes at
``start + dur + lat``. Each resource therefore runs its nodes in priority order, without
back-filling gaps. Every node starts no later than the latest finish of the nodes scheduled
before it, so ``makespan <= sum(dur + lat)``; and ``makespan >= critical_path`` (longest path
of ``dur + lat``) and ``>= max_device_load`` (largest sum of ``dur`` on one resource).

Memory: the buffer of node ``i`` (``alloc_bytes[i]`` on ``dev[i]`` for compute, ``dst[i]`` for a
transfer, ``part_alloc`` on each participant for a collective) is allocated at ``start[i]`` (a transfer's receive buffer too, although the data lands
up to ``lat`` later) and freed when the last of its successors finishes (its ``finish``); a
node without successors (a graph output), or with ``keep[i]``, keeps its buffer to the end. The
buffers a node reads are thus live while it runs. ``peak_mem[d] = resident_bytes[d] + max over
time of the live buffers on d``, computed by an event sweep in which, at equal times, frees are
applied before allocations.

Outputs (:class:`Schedule`): ``start``, ``finish`` (float64[n], ``finish = start + dur + lat``),
``makespan`` (max finish, 0 for an empty DAG), ``peak_mem`` (float64[n_devices]),
``busy_compute`` / ``busy_egress`` / ``busy_ingress`` (float64[n_devices], sums of ``dur``: the
time each resource is occupied, latencies excluded), ``busy_comm = busy_egress +
busy_ingress``, ``used`` (bool[n_devices]: any node on it, as compute, source or destination, or
resident bytes > 0), ``rank`` (float64[n]), ``order`` (int32[n], nodes in the order they were
scheduled), ``critical_path`` (max rank: a lower bound on the makespan), ``bytes_moved``.

Cost: O((n + m) log n) in compiled functions, no Python objects inside. Measured on the
2-vCPU development VM: ~0.07 ms for 1,000 nodes, ~1.2 ms for 10,000 nodes with 20,000 edges and
64 devices (about 0.4 ms of it the memory sweep); ~3.4 ms for the 49,000-node Llama-2 7B plan on
64 GPUs (102,000 data and 46,000 control edges, 1,400 collectives, contention on): ~0.35 ms the
ranks, ~0.2 ms the priorities, ~1.6 ms the list scheduling, ~1.3 ms the memory sweep, plus page
faults when the allocator hands freed memory back to the system between calls (up to ~1.5 ms
there; it depends on the process's heap). :func:`simulate` adds ~0.1 ms of conversion and
validation per 10,000 nodes; :func:`simulate_arrays` skips it. numba compiles on the first call
in each process (a few seconds cold, ~0.3-1 s from the on-disk cache): call :func:`warmup` once
in each worker process.

Errors: :class:`SimulationError` (a ``ValueError``) for malformed input and for cycles.

"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros

__all__ = [
    "COMPUTE",
    "TRANSFER",
    "SimulationError",
    "Schedule",
    "simulate",
    "simulate_arrays",
    "csr_from_edges",
    "warmup",
]

COMPUTE = 0
TRANSFER = 1


class SimulationError(ValueError):
    """Malformed simulator input (bad shapes, dtypes, ranges) or a cycle in the DAG."""


# ---------------------------------------------------------------------------------------------
# compiled core
# ---------------------------------------------------------------------------------------------


# Ready set: a 64-ary hierarchical bitset over priority positions 0..n-1 (level 0 = one bit per
# position, level l+1 = one bit per non-zero word of level l). Insert and pop-min cost one word
# operation per level (3 levels up to 262,144 nodes); about twice as fast as a binary heap here.
# Pop-min searches upwards from a lower bound on the members (the last position popped, or a
# lower one inserted since): the scheduler pops positions in nearly increasing order.


@njit(cache=True, nogil=True, inline='always')
def _ctz(x):
    """Index of the lowest set bit of a non-zero uint64 (LLVM's cttz: one instruction; a de
    Bruijn table lookup made the list scheduling ~10% slower)."""
    return trailing_zeros(x)


@njit(cache=True, nogil=True)
def _bitset_layout(n):
    """Word offsets of each level in one flat uint64 array (``off[l]:off[l+1]``), and #levels."""
    n_lev = 1
    w = (n + 63) >> 6
    while w > 1:
        w = (w + 63) >> 6
        n_lev += 1
    off = np.empty(n_lev + 1, np.int64)
    off[0] = 0
    w = (n + 63) >> 6
    for lev in range(n_lev):
        off[lev + 1] = off[lev] + max(w, 1)
        w = (w + 63) >> 6
    return off, n_lev


@njit(cache=True, nogil=True)
def _bitset_insert(bits, off, n_lev, p):
    for lev in range(n_lev):
        w = p >> 6
        old = bits[off[lev] + w]
        bits[off[lev] + w] = old | (np.uint64(1) << np.uint64(p & 63))
        if old != 0:  # the levels above already know this word is non-empty
            break
        p = w


@njit(cache=True, nogil=True)
def _radix_argsort(keys):
    """Stable argsort (int32 permutation) of uint64 keys: LSD radix sort, 11-bit digits, passes
    whose digit is the same for all keys skipped. Non-negative float64 values sort like their
    bit patterns (``t.view(np.uint64)``); bitwise NOT of those gives descending order. Several
    times faster than numba's np.argsort at the sizes seen here.

    Only the three high digits (bits 33-63) are passes over all keys; runs of keys equal there
    (equal times, mostly) are then put in order by their low 33 bits, by insertion for a short
    run and by three radix passes over the run for a long one: the same stable order as six
    passes over everything, at about half the work."""
    n = keys.shape[0]
    mask = np.uint64(2047)
    counts = np.zeros((6, 2048), np.int64)
    for i in range(n):
        k = keys[i]
        for p in range(3, 6):
            counts[p, (k >> np.uint64(11 * p)) & mask] += 1
    idx = np.arange(n).astype(np.int32)
    tmp = np.empty(n, np.int32)
    pos = np.empty(2048, np.int64)
    for p in range(3, 6):
        sh = np.uint64(11 * p)
        if n == 0 or counts[p, (keys[0] >> sh) & mask] == n:
            continue
        acc = 0
        for b in range(2048):
            pos[b] = acc
            acc += counts[p, b]
        for i in range(n):
            j = idx[i]
            b = (keys[j] >> sh) & mask
            tmp[pos[b]] = j
            pos[b] += 1
        idx, tmp = tmp, idx
    high = np.uint64(33)
    low = np.uint64((1 << 33) - 1)
    a = 0
    while a < n:
        top = keys[idx[a]] >> high
        e = a + 1
        while e < n and keys[idx[e]] >> high == top:
            e += 1
        if e - a > 1:
            if e - a <= 32:  # insertion, stable (only strictly greater keys move)
                for i in range(a + 1, e):
                    j = idx[i]
                    kl = keys[j] & low
                    m = i - 1
                    while m >= a and keys[idx[m]] & low > kl:
                        idx[m + 1] = idx[m]
                        m -= 1
                    idx[m + 1] = j
            else:
                _radix_run(keys, idx, tmp, a, e)
        a = e
    return idx


@njit(cache=True, nogil=True)
def _hashed_argsort(keys, limit, flip):
    """Stable argsort (int32 permutation) of ``keys ^ flip`` (uint64; ``flip = ~0``: descending,
    without a copy of the keys), as :func:`_radix_argsort`, faster when at most ``limit`` keys are
    distinct: a schedule of identical shards (data-parallel replicas, tensor-parallel ranks,
    equal layers) repeats the same times and ranks on every device (Llama-2 7B on 64 GPUs: 2,600
    distinct times among 116,000 memory events, 570 distinct ranks among 55,000 nodes). The
    simulator sorts runs of equal keys with it (:func:`_argsort_runs`, :func:`_memory_sweep`).
    The distinct keys are numbered by an open-addressing hash
    table as they come (a key equal to the one before skips the table), sorted among
    themselves, and the keys placed by a counting sort on their number (stable). With more than
    ``limit`` distinct keys, the radix sort runs instead (the table pass stops there)."""
    n = keys.shape[0]
    size = 64
    while size < 2 * limit:
        size *= 2
    mask = np.uint64(size - 1)
    table_key = np.empty(size, np.uint64)
    table_id = np.full(size, -1, np.int32)
    distinct = np.empty(limit, np.uint64)
    cls = np.empty(n, np.int32)
    count = np.zeros(limit, np.int64)
    d = 0
    golden = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing (Knuth, TAOCP 6.4): high bits mix all bits
    last_k = np.uint64(0)
    last_c = -1
    for i in range(n):
        k = keys[i] ^ flip
        if last_c < 0 or k != last_k:
            h = ((k * golden) >> np.uint64(32)) & mask
            while True:
                last_c = table_id[h]
                if last_c < 0:
                    if d == limit:
                        return _radix_argsort(keys ^ flip)
                    last_c = d
                    table_id[h] = d
                    table_key[h] = k
                    distinct[d] = k
                    d += 1
                    break
                if table_key[h] == k:
                    break
                h = (h + np.uint64(1)) & mask
            last_k = k
        cls[i] = last_c
        count[last_c] += 1
    pos = np.empty(d, np.int64)  # first output slot of each distinct key, in key order
    acc = 0
    for c in _radix_argsort(distinct[:d]):
        pos[c] = acc
        acc += count[c]
    out = np.empty(n, np.int32)
    for i in range(n):
        c = cls[i]
        out[pos[c]] = i
        pos[c] += 1
    return out


@njit(cache=True, nogil=True)
def _argsort_runs(keys, flip):
    """:func:`_hashed_argsort` of ``keys ^ flip`` (any number of distinct keys) when neighbours
    mostly share their key (the ranks of the nodes of replicated shards:
    19 in 20 nodes have the rank of the one before on the 49k-node Llama-2 7B plan): the runs of
    equal keys are sorted (stable), then each run's indices written in sequence."""
    n = keys.shape[0]
    run_k = np.empty(n, np.uint64)
    run_a = np.empty(n + 1, np.int32)  # a run's first index
    nr = 0
    for i in range(n):
        k = keys[i] ^ flip
        if nr == 0 or k != run_k[nr - 1]:
            run_k[nr] = k
            run_a[nr] = i
            nr += 1
    run_a[nr] = n
    out = np.empty(n, np.int32)
    q = 0
    for r in _hashed_argsort(run_k[:nr], nr // 2 + 1, np.uint64(0)):
        for i in range(run_a[r], run_a[r + 1]):
            out[q] = i
            q += 1
    return out


@njit(cache=True, nogil=True)
def _radix_run(keys, idx, tmp, a, e):
    """Stable LSD passes over the low digits (0-2) of ``idx[a:e]``, in place."""
    mask = np.uint64(2047)
    pos = np.empty(2048, np.int64)
    src = idx[a:e].copy()
    dst = tmp[a:e]
    for p in range(3):
        sh = np.uint64(11 * p)
        pos[:] = 0
        for i in range(e - a):
            pos[(keys[src[i]] >> sh) & mask] += 1
        if pos[(keys[src[0]] >> sh) & mask] == e - a:
            continue
        acc = 0
        for b in range(2048):
            c = pos[b]
            pos[b] = acc
            acc += c
        for i in range(e - a):
            j = src[i]
            b = (keys[j] >> sh) & mask
            dst[pos[b]] = j
            pos[b] += 1
        src, dst = dst.copy(), src
    idx[a:e] = src


@njit(cache=True, nogil=True, inline='always')
def _contended(t, du, cs, ce, s):
    """Duration of a compute node starting at ``t`` with ``du`` seconds of work alone, on a device
    whose communication runs over ``[cs, ce)``: inside that window it progresses at ``1/s``.
    Both outcomes are computed and one selected (no branches: whether the window overlaps is
    unpredictable, and a mispredicted branch costs more than the division)."""
    a = cs if cs > t else t
    w0 = a - t  # work done before the communication starts
    rest = du - w0
    x = (ce - a) / s
    slowed = w0 + rest * s if x >= rest else w0 + (ce - a) + (rest - x)  # inside the window, or past it
    return du if w0 >= du or ce <= a else slowed


@njit(cache=True, nogil=True, inline='always')
def _charge_comm(q, t, o, comm_start, comm_end, compute_free, s):
    """Communication over ``[t, o)`` on device ``q``: remember it for the compute placed later, and
    slow down the compute already placed on ``q`` that it overlaps (up to ``compute_free[q]``) by
    pushing the device's compute back by ``(s - 1) x overlap`` (that compute's own finish stays:
    its successors may already be placed; later compute on ``q`` and the makespan pay for it).
    Requires ``o > t``. Written with selects instead of branches (unpredictable ones)."""
    ce = comm_end[q]
    cs = comm_start[q]
    comm_start[q] = t if t > ce else cs  # a new interval (t > ce implies o > ce)
    comm_end[q] = o if o > ce else ce
    cf = compute_free[q]
    slowed = cf + (s - 1.0) * ((o if o < cf else cf) - t)
    compute_free[q] = slowed if cf > t else cf


@njit(cache=True, nogil=True)
def _kahn_rank(n, succ_ptr, succ_idx, ctl_ptr, ctl_idx, topo, rank, dur, lat):
    """Kahn's topological order of the data and control edges into ``topo``, then the upward
    ranks along it. Returns (status, ordered): status 1 when a cycle leaves nodes unordered
    (``topo[:ordered]`` holds the ordered ones)."""
    deg = np.zeros(n, np.int32)
    for e in range(succ_idx.shape[0]):
        deg[succ_idx[e]] += 1
    for e in range(ctl_idx.shape[0]):  # control edges order the schedule too (a cycle through them is one)
        deg[ctl_idx[e]] += 1
    tail = 0
    for i in range(n):
        if deg[i] == 0:
            topo[tail] = i
            tail += 1
    head = 0
    while head < tail:
        u = topo[head]
        head += 1
        for e in range(succ_ptr[u], succ_ptr[u + 1]):
            v = succ_idx[e]
            deg[v] -= 1
            if deg[v] == 0:
                topo[tail] = v
                tail += 1
        for e in range(ctl_ptr[u], ctl_ptr[u + 1]):
            v = ctl_idx[e]
            deg[v] -= 1
            if deg[v] == 0:
                topo[tail] = v
                tail += 1
    if tail < n:
        return 1, tail
    for k in range(n - 1, -1, -1):
        u = topo[k]
        best = 0.0
        for e in range(succ_ptr[u], succ_ptr[u + 1]):
            r = rank[succ_idx[e]]
            if r > best:
                best = r
        r = dur[u] + lat[u] + best
        for e in range(ctl_ptr[u], ctl_ptr[u + 1]):  # a gate ranks at least as high as what it gates
            r = max(r, rank[ctl_idx[e]])
        rank[u] = r
    return 0, n


@njit(cache=True, nogil=True)
def _hint_rank(topo_hint, succ_ptr, succ_idx, ctl_ptr, ctl_idx, rank, dur, lat):
    """The upward ranks along ``topo_hint``; False (``rank`` then partly written, -1 where not)
    as soon as a data or control edge points backwards in it. The first two successors and the
    first control successor are read without branches (most nodes have one or two: a loop's exit
    would often be mispredicted); a missing one reads some node's rank and ignores it."""
    n = rank.shape[0]
    sidx = succ_idx if succ_idx.shape[0] > 0 else np.zeros(1, np.int32)
    cidx = ctl_idx if ctl_idx.shape[0] > 0 else np.zeros(1, np.int32)
    last_s = sidx.shape[0] - 1
    last_c = cidx.shape[0] - 1
    for i in range(n):
        rank[i] = -1.0  # not yet ranked (a rank is >= 0)
    for k in range(n - 1, -1, -1):
        u = topo_hint[k]
        a = succ_ptr[u]
        b = succ_ptr[u + 1]
        r0 = rank[sidx[min(a, last_s)]]
        r1 = rank[sidx[min(a + 1, last_s)]]
        r0 = r0 if b > a else 0.0
        r1 = r1 if b > a + 1 else 0.0
        best = max(max(r0, r1), 0.0)
        low = min(r0, r1)  # < 0: a successor before u in the hint, not topological
        for e in range(a + 2, b):
            r = rank[sidx[e]]
            best = max(best, r)
            low = min(low, r)
        a = ctl_ptr[u]  # control successors: a gate ranks at least as high as what it gates
        b = ctl_ptr[u + 1]
        r0 = rank[cidx[min(a, last_c)]]
        r0 = r0 if b > a else 0.0
        low = min(low, r0)
        gate = r0
        for e in range(a + 1, b):
            r = rank[cidx[e]]
            low = min(low, r)
            gate = max(gate, r)
        if low < 0.0:
            return False
        rank[u] = max(dur[u] + lat[u] + best, gate)
    return True


@njit(cache=True, nogil=True)
def _list_schedule(prio, succ_ptr, ctl_ptr, heads, m, deg, kind, dev, dst, dur, lat, link, part_ptr,
                   part_dev, contention, start, finish, order, busy_compute, busy_egress, busy_ingress, used, ready):
    """The list scheduling (module docstring): ``prio[p]`` is the node of priority position p,
    ``heads`` the edges' heads as positions (the ``m`` data edges', then the control edges'),
    ``deg`` and ``ready`` (zeros) the in-degrees and ready times by position; the loop indexes
    its per-node state by position, one indirection less on its critical path. Writes the
    outputs; returns (makespan, nodes scheduled: fewer than n on a cycle)."""
    n = prio.shape[0]
    n_devices = busy_compute.shape[0]
    prio_u = prio.view(np.uint32)  # unsigned indices: no wraparound for negative ones
    dev_u = dev.view(np.uint32)
    dst_u = dst.view(np.uint32)
    compute_free = np.zeros(n_devices, np.float64)
    egress_free = np.zeros(2 * n_devices, np.float64)  # port 2*d: NVLink, 2*d+1: NIC
    ingress_free = np.zeros(2 * n_devices, np.float64)
    # contention: the last communication interval each device takes part in (see _contended)
    comm_start = np.zeros(n_devices, np.float64)
    comm_end = np.zeros(n_devices, np.float64)
    off, n_lev = _bitset_layout(n)
    ready_set = np.zeros(off[n_lev], np.uint64)  # priority positions of the ready nodes
    n_ready = 0
    lo = n  # no ready position is below lo
    for p in range(n):
        if deg[p] == 0:
            _bitset_insert(ready_set, off, n_lev, p)
            n_ready += 1
            lo = min(lo, p)
    makespan = 0.0
    k = 0
    while n_ready > 0:
        # Pop the smallest ready position, none being below lo: search upwards from lo (the
        # minimum is mostly in the word of lo or close after it: one or two words read instead of
        # one per level from the top), then descend to the smallest member found there. (The
        # ready set's operations are written out in this loop: numba counts references to the
        # arrays passed to a function on every call, even an inlined one.)
        q = lo
        lev = 0
        while True:
            w = q >> 6
            x = ready_set[off[lev] + w] & (~np.uint64(0) << np.uint64(q & 63))  # members >= q in its word
            if x != 0:
                break
            lev += 1
            q = w + 1  # the words after w, one level up (a member lies there: the set holds one >= lo)
        p = (w << 6) + _ctz(x)
        while lev > 0:
            lev -= 1
            p = (p << 6) + _ctz(ready_set[off[lev] + p])
        q = p
        for lev in range(n_lev):  # remove p; a word that empties clears its bit one level up
            w = q >> 6
            x = ready_set[off[lev] + w] & ~(np.uint64(1) << np.uint64(q & 63))
            ready_set[off[lev] + w] = x
            if x != 0:
                break
            q = w
        lo = p
        n_ready -= 1
        u = prio_u[p]
        d = dev_u[u]
        t = ready[p]
        if kind[u] == 0:
            if compute_free[d] > t:
                t = compute_free[d]
            du = dur[u]
            if contention > 1.0:  # (du itself when the last communication ended by t)
                du = _contended(t, du, comm_start[d], comm_end[d], contention)
            o = t + du  # the resources are held until o; the output is available at f
            compute_free[d] = o
            busy_compute[d] += dur[u]  # the work (the slowdown shows in start/finish and the makespan)
            used[d] = True
        elif kind[u] == 1:
            r = dst_u[u]
            c = link[u]
            if egress_free[2 * d + c] > t:
                t = egress_free[2 * d + c]
            if ingress_free[2 * r + c] > t:
                t = ingress_free[2 * r + c]
            o = t + dur[u]
            egress_free[2 * d + c] = o
            ingress_free[2 * r + c] = o
            busy_egress[d] += dur[u]
            busy_ingress[r] += dur[u]
            used[d] = True
            used[r] = True
            if contention > 1.0 and o > t:
                _charge_comm(d, t, o, comm_start, comm_end, compute_free, contention)
                _charge_comm(r, t, o, comm_start, comm_end, compute_free, contention)
        else:  # a collective: every participant's ports on its links, together
            mask = link[u]
            for j in range(part_ptr[u], part_ptr[u + 1]):
                q = part_dev[j]
                for c in range(2):
                    if (mask >> c) & 1:
                        if egress_free[2 * q + c] > t:
                            t = egress_free[2 * q + c]
                        if ingress_free[2 * q + c] > t:
                            t = ingress_free[2 * q + c]
            o = t + dur[u]
            for j in range(part_ptr[u], part_ptr[u + 1]):
                q = part_dev[j]
                for c in range(2):
                    if (mask >> c) & 1:
                        egress_free[2 * q + c] = o
                        ingress_free[2 * q + c] = o
                busy_egress[q] += dur[u]
                busy_ingress[q] += dur[u]
                used[q] = True
                if contention > 1.0 and o > t:
                    _charge_comm(q, t, o, comm_start, comm_end, compute_free, contention)
        f = o + lat[u]
        start[u] = t
        finish[u] = f
        if f > makespan:
            makespan = f
        order[k] = u
        k += 1
        # Release the successors: the data edges' heads (ready once u has finished, at f), then
        # the control edges' (issue order: once u has started, at t), both runs of ``heads``.
        # One that becomes ready is inserted into the ready set's bottom word without a branch
        # (z: 0 or 1; whether a node becomes ready is unpredictable), into the words above only
        # when that word was empty.
        a = succ_ptr[u]
        n_data = succ_ptr[u + 1] - a
        c = m + ctl_ptr[u] - n_data  # heads[c + j]: the control edges, for j >= n_data
        for j in range(n_data + ctl_ptr[u + 1] - ctl_ptr[u]):
            data = j < n_data
            v = heads[a + j if data else c + j]
            ready[v] = max(ready[v], f if data else t)
            dv = deg[v] - 1
            deg[v] = dv
            z = dv == 0
            w = v >> 6
            old = ready_set[w]
            ready_set[w] = old | (np.uint64(z) << np.uint64(v & 63))
            if z and old == 0:  # a word that was empty: mark it one level up
                q = w
                for lev in range(1, n_lev):
                    w = q >> 6
                    old = ready_set[off[lev] + w]
                    ready_set[off[lev] + w] = old | (np.uint64(1) << np.uint64(q & 63))
                    if old != 0:
                        break
                    q = w
            n_ready += z
            lo = v if z and v < lo else lo
    if contention > 1.0:  # slowdown charged to compute that had already been placed (see _charge_comm)
        for q in range(n_devices):
            if compute_free[q] > makespan:
                makespan = compute_free[q]
    return makespan, k


@njit(cache=True, nogil=True, inline='always')
def _add_event(t, c, ok, ev, run_t, run_a, base, ne, nr):
    """Appends event ``c`` (a buffer, see :func:`_memory_sweep`) at time ``t`` to the ``ne``
    events from ``base`` on in ``ev`` if ``ok`` (written anyway, without branches), starting a
    new run (``run_t``: time, ``run_a``: first event; ``nr`` runs from ``base`` on) when t
    differs from the last run's time (by value: event times are never NaN, nor -0.0). Returns
    the new (ne, nr)."""
    ev[base + ne] = c
    new = ok & ((nr == 0) | (t != run_t[base + nr - 1]))  # (reads ``run_t[-1]`` when nr == base == 0)
    run_t[base + nr] = t
    run_a[base + nr] = base + ne
    return ne + ok, nr + new


@njit(cache=True, nogil=True)
def _memory_sweep(ev, run_t, run_a, nf, n_free_runs, a0, na, n_alloc_runs, kind, dev, dst, alloc_bytes,
                  part_dev, part_alloc, peak_mem):
    """Applies the memory events in time order, at equal times frees before allocations and
    each kind in its order in ``ev`` (the order of a stable sort of the frees followed by the
    allocations), and raises ``peak_mem`` (the resident bytes on entry) to the live bytes after
    each allocation. The bytes are added in exactly that order, so the peaks do not depend on
    how the order is found. Events (see :func:`_add_event`): frees ``ev[:nf]`` in runs
    ``[0, n_free_runs)``, allocations ``ev[a0:a0 + na]`` in runs ``[a0, a0 + n_alloc_runs)``;
    an event is a buffer: node ``c`` (``alloc_bytes[c]`` on ``dev[c]``, a transfer's on
    ``dst[c]``) for ``c < n``, else participant ``c - n`` (``part_alloc``, ``part_dev``)."""
    n = kind.shape[0]
    nr = n_free_runs + n_alloc_runs
    keys = np.empty(nr, np.uint64)  # free runs first: a stable sort puts them before allocations
    keys[:n_free_runs] = run_t[:n_free_runs].view(np.uint64)
    keys[n_free_runs:] = run_t[a0:a0 + n_alloc_runs].view(np.uint64)
    perm = _hashed_argsort(keys, nr // 2 + 1, np.uint64(0))  # ~2,000 distinct times among 9,400 runs
    live = peak_mem.copy()
    for q in range(nr):
        r = perm[q]
        alloc = r >= n_free_runs
        if alloc:
            r += a0 - n_free_runs
            end = run_a[r + 1] if r + 1 < a0 + n_alloc_runs else a0 + na
        else:
            end = run_a[r + 1] if r + 1 < n_free_runs else nf
        for j in range(run_a[r], end):
            c = ev[j]
            if c < n:
                b = alloc_bytes[c]
                d = dev[c] if kind[c] == 0 else dst[c]
            else:
                b = part_alloc[c - n]
                d = part_dev[c - n]
            if alloc:
                live[d] += b
                if live[d] > peak_mem[d]:
                    peak_mem[d] = live[d]
            else:
                live[d] -= b  # (bit for bit live + (-b): IEEE subtraction)


@njit(cache=True, nogil=True)
def _memory_peaks(kind, dev, dst, alloc_bytes, keep, acc, succ_ptr, succ_idx, part_ptr, part_dev, part_alloc,
                  start, finish, acc_start, into, ev, peak_mem):
    """Raises ``peak_mem`` (the resident bytes on entry) to each device's peak of live buffers
    (module docstring), given the schedule's ``start`` and ``finish``. Scratch (memory the
    caller no longer needs: less fresh memory to touch): ``acc_start`` float64[n], ``into``
    bool[n], ``ev`` int32[2 (n + len(part_dev))] at least.

    In-place accumulation: a buffer whose every reader is an accumulate node (``acc``) on the
    buffer's own device is added into that accumulator as it is produced (Megatron-LM's
    ``main_grad``, gradient accumulation across microbatches), so it lives only while it is
    produced, and each accumulator's buffer from the start of its first such input on. So does a
    collective whose readers all accumulate (a reduce-scatter: NCCL reduces the chunks into the
    output as they arrive). Another collective's buffer on a participant lives until the readers
    on that participant end.

    Events, each kind in node (then participant) order: frees when the buffer's last reader
    ends, allocations at its start, at most one of each per node or participant (so no counting
    pass): ``ev[:nf]`` and ``ev[ub:ub + na]`` hold which buffer (a node i < n, or a participant
    n + j; the bytes and device are looked up in the sweep: less memory to write). Neighbouring
    nodes mostly share their times (9 events in 10 on the 49k-node Llama-2 7B plan have the time
    of the one before): the events are grouped into runs of equal times as they come, and the
    sweep sorts runs, not events."""
    n = kind.shape[0]
    acc_start[:] = start
    into[:] = False
    for i in range(n if acc.any() else 0):  # (most plans accumulate nothing)
        if succ_ptr[i + 1] == succ_ptr[i] or keep[i]:
            continue
        loc = dev[i] if kind[i] == 0 else dst[i]
        ok = True
        for e in range(succ_ptr[i], succ_ptr[i + 1]):
            v = succ_idx[e]
            # a collective's readers are on its participants: a reduction (NCCL sums into the
            # output as chunks arrive) holds no receive buffer beyond its own run; a shard read by
            # an accumulating collective (microbatches' partials summed in place, then reduced)
            # is added into that collective's buffer on its device as it is produced
            if not acc[v]:
                ok = False
                break
            if kind[i] != 2:
                if kind[v] == 2:
                    found = False
                    for j in range(part_ptr[v], part_ptr[v + 1]):
                        if part_dev[j] == loc:
                            found = True
                            break
                    if not found:
                        ok = False
                        break
                elif dev[v] != loc:
                    ok = False
                    break
        if ok:
            into[i] = True
            for e in range(succ_ptr[i], succ_ptr[i + 1]):
                v = succ_idx[e]
                if start[i] < acc_start[v]:
                    acc_start[v] = start[i]
    # Events, each kind in node (then participant) order: frees when the buffer's last reader
    # ends, allocations at its start, at most one of each per node or participant (so no
    # counting pass): ``ev[:nf]`` and ``ev[ub:ub + na]`` hold which buffer (a node i < n, or a
    # participant n + j; the bytes and device are looked up in the sweep: less memory to
    # write). Neighbouring nodes mostly share their times (9 events in 10 on the 49k-node Llama-2
    # 7B plan have the time of the one before): the events are grouped into runs of equal times
    # as they come, and the sweep sorts runs, not events.
    ub = n + part_dev.shape[0]
    run_t = np.empty(2 * ub, np.float64)  # runs: free runs from 0, allocation runs from ub on
    run_a = np.empty(2 * ub, np.int32)  # a run's first event
    nf = 0
    na = 0
    n_free_runs = 0
    n_alloc_runs = 0
    # a collective's buffer on each participant lives until the readers on that device end
    dev_tf = np.full(peak_mem.shape[0], -1.0)
    for i in range(n):
        a = succ_ptr[i]
        b = succ_ptr[i + 1]
        frees = (b > a) & (not keep[i])
        if kind[i] != 2:  # without branches on the bytes (mispredicted: one node in five has none)
            tf = 0.0
            for e in range(a, b):
                tf = max(tf, finish[succ_idx[e]])
            tf = finish[i] if into[i] else tf  # an accumulated input lives while it is produced
            has = alloc_bytes[i] > 0.0
            na, n_alloc_runs = _add_event(acc_start[i], i, has, ev, run_t, run_a, ub, na, n_alloc_runs)
            nf, n_free_runs = _add_event(tf, i, has & frees, ev, run_t, run_a, 0, nf, n_free_runs)
            continue
        tf = 0.0
        if into[i]:
            tf = finish[i]
        elif frees:
            for e in range(succ_ptr[i], succ_ptr[i + 1]):
                fs = finish[succ_idx[e]]
                tf = max(tf, fs)
                q = dev[succ_idx[e]]
                dev_tf[q] = max(dev_tf[q], fs)
        for j in range(part_ptr[i], part_ptr[i + 1]):
            has = part_alloc[j] > 0.0
            na, n_alloc_runs = _add_event(acc_start[i], n + j, has, ev, run_t, run_a, ub, na, n_alloc_runs)
            # a participant without a reader of its own keeps it until the last reader ends
            loc = part_dev[j]
            t = dev_tf[loc] if dev_tf[loc] >= 0.0 else tf
            nf, n_free_runs = _add_event(t, n + j, has and frees, ev, run_t, run_a, 0, nf, n_free_runs)
        if frees:
            for e in range(succ_ptr[i], succ_ptr[i + 1]):
                dev_tf[dev[succ_idx[e]]] = -1.0
    _memory_sweep(ev, run_t, run_a, nf, n_free_runs, ub, na, n_alloc_runs, kind, dev, dst, alloc_bytes,
                  part_dev, part_alloc, peak_mem)


@njit(cache=True, nogil=True)
def _cycle(succ_ptr, succ_idx, ctl_ptr, ctl_idx, dur, lat, resident_bytes, topo_hint, start, finish, rank, order):
    """The outputs for a graph with a cycle (``_simulate_core``'s status 1): zero times and
    loads, the resident bytes as peaks, the nodes Kahn's pass orders (``order[:n_topo]``), and
    the ranks as left by the checks: those along a hint (checking every edge, control edges too)
    up to its first backward edge, -1 before it; zeros without a hint."""
    n = rank.shape[0]
    n_devices = resident_bytes.shape[0]
    if topo_hint.shape[0] == n:
        _hint_rank(topo_hint, succ_ptr, succ_idx, ctl_ptr, ctl_idx, rank, dur, lat)
    else:
        rank[:] = 0.0
    tail = _kahn_rank(n, succ_ptr, succ_idx, ctl_ptr, ctl_idx, order, rank, dur, lat)[1]
    start[:] = 0.0
    finish[:] = 0.0
    zeros = np.zeros(n_devices, np.float64)
    return (1, start, finish, 0.0, resident_bytes.copy(), zeros, zeros.copy(), zeros.copy(), resident_bytes > 0.0,
            rank, order, tail)


@njit(cache=True, nogil=True)
def _simulate_core(kind, dev, dst, dur, lat, succ_ptr, succ_idx, alloc_bytes, resident_bytes, n_devices, keep, link,
                   part_ptr, part_dev, part_alloc, ctl_ptr, ctl_idx, contention, acc, topo_hint):
    """Returns (status, start, finish, makespan, peak_mem, busy_compute, busy_egress,
    busy_ingress, used, rank, order, n_topo). status 0 = ok, 1 = cycle (then ``order[:n_topo]``
    holds the nodes that could be ordered; the others lie on or behind a cycle).

    ``topo_hint`` (int32[n], or empty): a permutation of the nodes, probably a topological order
    (a lowering's program order, ``Lowered.topo_hint``). When every data and control edge points
    forward in it, the ranks are computed along it without Kahn's pass; otherwise (a pipeline's
    control edges often point backwards in program order) Kahn's pass runs, as without a hint,
    and finds any cycle before the list scheduling starts. Either way the outputs on a cycle are
    those of :func:`_cycle`."""
    n = kind.shape[0]
    m = succ_idx.shape[0]
    mc = ctl_idx.shape[0]
    start = np.empty(n, np.float64)  # (every element written, but on a cycle: zeros then)
    finish = np.empty(n, np.float64)
    rank = np.empty(n, np.float64)
    order = np.empty(n, np.int32)
    peak_mem = resident_bytes.copy()
    busy_compute = np.zeros(n_devices, np.float64)
    busy_egress = np.zeros(n_devices, np.float64)
    busy_ingress = np.zeros(n_devices, np.float64)
    used = resident_bytes > 0.0

    # --- upward rank along the hint, when every edge points forward in it ------------------
    with_hint = topo_hint.shape[0] == n
    if not (with_hint and _hint_rank(topo_hint, succ_ptr, succ_idx, ctl_ptr, ctl_idx, rank, dur, lat)):
        if _kahn_rank(n, succ_ptr, succ_idx, ctl_ptr, ctl_idx, order, rank, dur, lat)[0] != 0:
            return _cycle(succ_ptr, succ_idx, ctl_ptr, ctl_idx, dur, lat, resident_bytes, topo_hint, start, finish,
                          rank, order)

    # --- priority: position in (rank descending, index ascending) order ---------------------
    # prio[p] = node with the p-th highest priority (descending: the ranks' bits complemented)
    prio = _argsort_runs(rank.view(np.uint64), ~np.uint64(0))
    pos = order  # (the output's buffer, written by the list scheduling only: less memory to touch)
    for p in range(n):
        pos[prio[p]] = p
    # the edges' heads as positions, and the in-degrees by position
    deg = np.zeros(n, np.int32)
    # (one buffer for these and, later, the memory events)
    edges = np.empty(max(m + mc, 2 * (n + part_dev.shape[0])), np.uint32)
    succ_pos = edges[:m]
    for e in range(m):
        v = pos[succ_idx[e]]
        succ_pos[e] = v
        deg[v] += 1
    ctl_pos = edges[m:m + mc]
    for e in range(mc):  # control edges order the schedule too
        v = pos[ctl_idx[e]]
        ctl_pos[e] = v
        deg[v] += 1

    # --- list scheduling ------------------------------------------------------------------
    ready = np.zeros(n, np.float64)  # by position: max finish (data available) of the predecessors
    # scheduled so far
    makespan, k = _list_schedule(prio, succ_ptr, ctl_ptr, edges, m, deg, kind, dev, dst, dur, lat, link,
                                 part_ptr, part_dev, contention, start, finish, order, busy_compute, busy_egress,
                                 busy_ingress, used, ready)
    if k < n:  # stalled: a cycle through control edges
        return _cycle(succ_ptr, succ_idx, ctl_ptr, ctl_idx, dur, lat, resident_bytes, topo_hint, start, finish, rank,
                      order)

    # --- memory: event sweep --------------------------------------------------------------
    _memory_peaks(kind, dev, dst, alloc_bytes, keep, acc, succ_ptr, succ_idx, part_ptr, part_dev, part_alloc,
                  start, finish, ready, deg.view(np.bool_)[:n], edges.view(np.int32), peak_mem)
    return (0, start, finish, makespan, peak_mem, busy_compute, busy_egress, busy_ingress, used,
            rank, order, n)


# ---------------------------------------------------------------------------------------------
# Python wrapper
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Schedule:
    """Result of :func:`simulate`; arrays are owned by this object (do not mutate)."""

    start: np.ndarray  # float64[n]
    finish: np.ndarray  # float64[n]
    makespan: float
    peak_mem: np.ndarray  # float64[n_devices], resident included
    busy_compute: np.ndarray  # float64[n_devices], sum of dur of its compute nodes
    busy_egress: np.ndarray  # float64[n_devices], sum of dur (port occupancy) of the transfers it sends
    busy_ingress: np.ndarray  # float64[n_devices], sum of dur of the transfers it receives
    used: np.ndarray  # bool[n_devices]
    rank: np.ndarray  # float64[n], upward rank (priority)
    order: np.ndarray  # int32[n], scheduling order
    bytes_moved: float  # sum of alloc_bytes over transfer nodes

    @property
    def busy_comm(self) -> np.ndarray:
        """float64[n_devices]: egress + ingress occupancy (latencies not included)."""
        return self.busy_egress + self.busy_ingress

    @property
    def max_peak_mem(self) -> float:
        return float(self.peak_mem.max()) if self.peak_mem.size else 0.0

    @property
    def devices_used(self) -> int:
        return int(np.count_nonzero(self.used))

    @property
    def critical_path(self) -> float:
        """Longest path (sum of ``dur + lat`` along data edges; a control edge adds no time), a
        lower bound on the makespan."""
        return float(self.rank.max()) if self.rank.size else 0.0

    @property
    def max_device_load(self) -> float:
        """Largest occupancy (sum of ``dur``) of any single resource, another lower bound on the
        makespan."""
        if not self.busy_compute.size:
            return 0.0
        return float(max(self.busy_compute.max(), self.busy_egress.max(), self.busy_ingress.max()))

    def fits(self, mem_capacity: float | np.ndarray) -> bool:
        """Feasibility: every device's peak memory within its capacity."""
        return bool(np.all(self.peak_mem <= np.asarray(mem_capacity, dtype=np.float64)))


def _as(a, dtype, name: str) -> np.ndarray:
    try:
        arr = np.asarray(a)
    except Exception as e:  # pragma: no cover - exotic inputs
        raise SimulationError(f"{name}: cannot convert to an array: {e}") from None
    if arr.ndim != 1:
        raise SimulationError(f"{name}: expected a 1-d array, got shape {arr.shape}")
    if arr.dtype != dtype:
        if np.issubdtype(dtype, np.integer):
            if arr.size and not np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_:
                if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
                    raise SimulationError(f"{name}: expected integers, got {arr.dtype}")
            info = np.iinfo(dtype)
            if arr.size and (arr.min() < info.min or arr.max() > info.max):
                raise SimulationError(f"{name}: values out of range for {np.dtype(dtype).name}")
        arr = arr.astype(dtype)
    return np.ascontiguousarray(arr)


def _validate(kind, dev, dst, dur, lat, succ_ptr, succ_idx, alloc_bytes, resident_bytes, n_devices) -> None:
    n = kind.shape[0]
    for name, a in (("dev", dev), ("dst", dst), ("dur", dur), ("lat", lat), ("alloc_bytes", alloc_bytes)):
        if a.shape[0] != n:
            raise SimulationError(f"{name}: length {a.shape[0]} != n = {n} (length of kind)")
    if succ_ptr.shape[0] != n + 1:
        raise SimulationError(f"succ_ptr: length {succ_ptr.shape[0]} != n + 1 = {n + 1}")
    if resident_bytes.shape[0] != n_devices:
        raise SimulationError(f"resident_bytes: length {resident_bytes.shape[0]} != n_devices = {n_devices}")
    if succ_ptr[0] != 0 or succ_ptr[-1] != succ_idx.shape[0] or np.any(np.diff(succ_ptr) < 0):
        raise SimulationError("succ_ptr: must start at 0, be non-decreasing and end at len(succ_idx)")
    if succ_idx.size and (succ_idx.min() < 0 or succ_idx.max() >= n):
        raise SimulationError(f"succ_idx: node index out of range 0..{n - 1}")
    if n == 0:
        return
    if np.any((kind < 0) | (kind > 2)):
        raise SimulationError("kind: must be 0 (compute), 1 (transfer) or 2 (collective)")
    if dev.min() < 0 or dev.max() >= n_devices:
        i = int(np.flatnonzero((dev < 0) | (dev >= n_devices))[0])
        raise SimulationError(f"dev[{i}] = {int(dev[i])} out of range 0..{n_devices - 1}")
    tr = kind == 1
    bad = tr & ((dst < 0) | (dst >= n_devices))
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise SimulationError(f"dst[{i}] = {int(dst[i])} out of range 0..{n_devices - 1} for transfer node {i}")
    if not np.all(np.isfinite(dur)) or np.any(dur < 0):
        i = int(np.flatnonzero(~np.isfinite(dur) | (dur < 0))[0])
        raise SimulationError(f"dur[{i}] = {dur[i]!r}: durations must be finite and >= 0")
    if not np.all(np.isfinite(lat)) or np.any(lat < 0):
        i = int(np.flatnonzero(~np.isfinite(lat) | (lat < 0))[0])
        raise SimulationError(f"lat[{i}] = {lat[i]!r}: latencies must be finite and >= 0")
    if not np.all(np.isfinite(alloc_bytes)) or np.any(alloc_bytes < 0):
        raise SimulationError("alloc_bytes: must be finite and >= 0")
    if not np.all(np.isfinite(resident_bytes)) or np.any(resident_bytes < 0):
        raise SimulationError("resident_bytes: must be finite and >= 0")


def _find_cycle(n: int, succ_ptr: np.ndarray, succ_idx: np.ndarray, ordered: np.ndarray,
                ctl_ptr: np.ndarray | None = None, ctl_idx: np.ndarray | None = None) -> list[int]:
    """A cycle among the nodes that could not be ordered, over the data and control edges
    (error path only)."""
    bad = np.ones(n, dtype=bool)
    bad[ordered] = False
    src = np.repeat(np.arange(n, dtype=np.int64), np.diff(succ_ptr))
    dst = succ_idx.astype(np.int64)
    if ctl_ptr is not None and ctl_idx is not None and ctl_idx.size:
        src = np.concatenate([src, np.repeat(np.arange(n, dtype=np.int64), np.diff(ctl_ptr))])
        dst = np.concatenate([dst, ctl_idx.astype(np.int64)])
    keep = bad[src] & bad[dst]
    pred = np.full(n, -1, dtype=np.int64)
    pred[dst[keep]] = src[keep]  # every unordered node has an unordered predecessor
    u = int(np.flatnonzero(bad)[0])
    seen: dict[int, int] = {}
    path: list[int] = []
    while u not in seen:
        seen[u] = len(path)
        path.append(u)
        u = int(pred[u])
    cyc = path[seen[u]:][::-1]
    return cyc + [cyc[0]]


def simulate(kind, dev, dst, dur, succ_ptr, succ_idx, alloc_bytes, resident_bytes, n_devices: int,
             *, lat=None, keep=None, link=None, part_ptr=None, part_dev=None, part_alloc=None,
             ctl_ptr=None, ctl_idx=None, contention: float = 1.0, acc=None, check: bool = True) -> Schedule:
    """Simulate a lowered plan; see the module docstring for the array contract (``lat``:
    float64[n] latencies, default zeros; ``link``, ``part_*``: ports and collectives).

    Raises :class:`SimulationError` for malformed input (when ``check``) and for a cycle
    (always; the message names the nodes on one cycle).
    """
    n_devices = int(n_devices)
    if n_devices < 1:
        raise SimulationError(f"n_devices must be >= 1, got {n_devices}")
    kind = _as(kind, np.int8, "kind")
    dev = _as(dev, np.int32, "dev")
    dst = _as(dst, np.int32, "dst")
    dur = _as(dur, np.float64, "dur")
    succ_ptr = _as(succ_ptr, np.int64, "succ_ptr")
    succ_idx = _as(succ_idx, np.int32, "succ_idx")
    alloc_bytes = _as(alloc_bytes, np.float64, "alloc_bytes")
    resident_bytes = _as(resident_bytes, np.float64, "resident_bytes")
    lat = np.zeros(kind.shape[0], np.float64) if lat is None else _as(lat, np.float64, "lat")
    if keep is not None:
        keep = _as(keep, np.bool_, "keep")
        if keep.shape[0] != kind.shape[0]:
            raise SimulationError(f"keep: length {keep.shape[0]} != n = {kind.shape[0]} (length of kind)")
    n = kind.shape[0]
    if acc is not None:
        acc = _as(acc, np.bool_, "acc")
        if acc.shape[0] != n:
            raise SimulationError(f"acc: length {acc.shape[0]} != n = {n} (length of kind)")
    link = np.zeros(n, np.int8) if link is None else _as(link, np.int8, "link")
    part_ptr = np.zeros(n + 1, np.int64) if part_ptr is None else _as(part_ptr, np.int64, "part_ptr")
    part_dev = np.zeros(0, np.int32) if part_dev is None else _as(part_dev, np.int32, "part_dev")
    part_alloc = np.zeros(0, np.float64) if part_alloc is None else _as(part_alloc, np.float64, "part_alloc")
    if check:
        _validate(kind, dev, dst, dur, lat, succ_ptr, succ_idx, alloc_bytes, resident_bytes, n_devices)
        _validate_ports(kind, link, part_ptr, part_dev, part_alloc, n_devices)
    contention = float(contention)
    if check and not (np.isfinite(contention) and contention >= 1.0):
        raise SimulationError(f"contention: a slowdown factor >= 1 (1 = none), got {contention!r}")
    if ctl_ptr is not None:
        ctl_ptr, ctl_idx = _as(ctl_ptr, np.int64, "ctl_ptr"), _as(ctl_idx, np.int32, "ctl_idx")
        if check and (ctl_ptr.shape[0] != n + 1 or ctl_ptr[-1] != ctl_idx.shape[0] or (
                ctl_idx.size and (ctl_idx.min() < 0 or ctl_idx.max() >= n))):
            raise SimulationError("ctl_ptr/ctl_idx: a CSR of control successors over the n nodes")
    return simulate_arrays(kind, dev, dst, dur, succ_ptr, succ_idx, alloc_bytes, resident_bytes, n_devices,
                           lat=lat, keep=keep, link=link, part_ptr=part_ptr, part_dev=part_dev, part_alloc=part_alloc,
                           ctl_ptr=ctl_ptr, ctl_idx=ctl_idx, contention=contention, acc=acc)


def _validate_ports(kind, link, part_ptr, part_dev, part_alloc, n_devices) -> None:
    n = kind.shape[0]
    if link.shape[0] != n:
        raise SimulationError(f"link: length {link.shape[0]} != n = {n} (length of kind)")
    if part_ptr.shape[0] != n + 1 or part_ptr[0] != 0 or part_ptr[-1] != part_dev.shape[0] or np.any(
            np.diff(part_ptr) < 0):
        raise SimulationError("part_ptr: must have n + 1 entries, start at 0, be non-decreasing and end at "
                              "len(part_dev)")
    if part_alloc.shape[0] != part_dev.shape[0]:
        raise SimulationError("part_alloc: must have one entry per part_dev entry")
    if part_dev.size and (part_dev.min() < 0 or part_dev.max() >= n_devices):
        raise SimulationError(f"part_dev: device out of range 0..{n_devices - 1}")
    if not np.all(np.isfinite(part_alloc)) or np.any(part_alloc < 0):
        raise SimulationError("part_alloc: must be finite and >= 0")
    tr = kind == 1
    if np.any(tr & ((link < 0) | (link > 1))):
        raise SimulationError("link: a transfer uses port 0 (NVLink) or 1 (NIC)")
    co = kind == 2
    if np.any(co & ((link < 1) | (link > 3))):
        raise SimulationError("link: a collective's mask is 1 (NVLink), 2 (NIC) or 3 (both)")
    if np.any(co & (np.diff(part_ptr) == 0)):
        raise SimulationError("part_ptr: a collective needs at least one participant")


def simulate_arrays(kind, dev, dst, dur, succ_ptr, succ_idx, alloc_bytes, resident_bytes,
                    n_devices: int, *, lat=None, keep=None, link=None, part_ptr=None, part_dev=None,
                    part_alloc=None, ctl_ptr=None, ctl_idx=None, contention: float = 1.0, acc=None,
                    cycle_ok: bool = False, topo_hint=None) -> Schedule | None:
    """Fast path: arrays already of the contract's dtypes (``lat``: float64[n] or None for zeros;
    ``keep``: bool[n] or None), contiguous and valid. Unchecked: out-of-range indices or
    negative/NaN durations or latencies here are undefined behaviour (wrong results or a crash).
    Still raises on a cycle, or with ``cycle_ok`` returns None (a caller with other control edges
    to try: ``costmodel.lookahead.lookahead_tiers``). ``topo_hint``: int32[n], a permutation of the
    nodes that is probably a topological order of the data and control edges
    (``Lowered.topo_hint``), which spares the simulator its own topological pass; checked, and
    ignored where it is not one."""
    if lat is None:
        lat = np.zeros(kind.shape[0], np.float64)
    if keep is None:
        keep = np.zeros(kind.shape[0], np.bool_)
    if link is None:
        link = np.zeros(kind.shape[0], np.int8)
    if part_ptr is None:
        part_ptr, part_dev, part_alloc = np.zeros(kind.shape[0] + 1, np.int64), _NO_DEV, _NO_ALLOC
    if ctl_ptr is None:
        ctl_ptr, ctl_idx = np.zeros(kind.shape[0] + 1, np.int64), _NO_DEV
    if acc is None:
        acc = np.zeros(kind.shape[0], np.bool_)
    (status, start, finish, makespan, peak_mem, busy_c, busy_e, busy_i, used, rank, order,
     n_topo) = _simulate_core(kind, dev, dst, dur, lat, succ_ptr, succ_idx, alloc_bytes, resident_bytes,
                              int(n_devices), keep, link, part_ptr, part_dev, part_alloc, ctl_ptr, ctl_idx,
                              float(contention), acc, _NO_DEV if topo_hint is None else topo_hint)
    if status != 0:
        if cycle_ok:
            return None
        cyc = _find_cycle(kind.shape[0], succ_ptr, succ_idx, order[:n_topo], ctl_ptr, ctl_idx)
        raise SimulationError(
            f"the task graph has a cycle ({kind.shape[0] - n_topo} of {kind.shape[0]} nodes cannot be "
            f"ordered); one cycle: {' -> '.join(map(str, cyc))}")
    moved = float(alloc_bytes[kind != 0].sum()) if kind.size else 0.0
    return Schedule(start=start, finish=finish, makespan=float(makespan), peak_mem=peak_mem,
                    busy_compute=busy_c, busy_egress=busy_e, busy_ingress=busy_i, used=used,
                    rank=rank, order=order, bytes_moved=moved)


_NO_DEV = np.zeros(0, np.int32)
_NO_ALLOC = np.zeros(0, np.float64)


def csr_from_edges(n: int, src, dst) -> tuple[np.ndarray, np.ndarray]:
    """(succ_ptr int64[n+1], succ_idx int32[m]) from edge arrays ``src[k] -> dst[k]``.
    Successors keep the input order of their edges."""
    s = np.asarray(src, dtype=np.int64).ravel()
    t = np.asarray(dst, dtype=np.int64).ravel()
    if s.shape != t.shape:
        raise SimulationError(f"edge arrays differ in length: {s.shape[0]} != {t.shape[0]}")
    if s.size and (min(s.min(), t.min()) < 0 or max(s.max(), t.max()) >= n):
        raise SimulationError(f"edge endpoint out of range 0..{n - 1}")
    perm = np.argsort(s, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(s, minlength=n), out=ptr[1:])
    return ptr, t[perm].astype(np.int32)


def warmup() -> float:
    """Compile (or load from the cache) the simulator in this process; returns seconds spent."""
    t0 = time.perf_counter()
    kind = np.array([0, 1, 0], np.int8)
    dev = np.array([0, 0, 1], np.int32)
    dst = np.array([-1, 1, -1], np.int32)
    dur = np.array([1.0, 0.5, 1.0])
    ptr, idx = csr_from_edges(3, [0, 1], [1, 2])
    simulate_arrays(kind, dev, dst, dur, ptr, idx, np.array([8.0, 8.0, 8.0]), np.array([1.0, 0.0]), 2,
                    lat=np.array([0.0, 0.25, 0.0]))
    return time.perf_counter() - t0
