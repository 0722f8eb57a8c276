"""Bounded lookahead: devices issue work in program order, at most ``window`` nodes ahead.

The list scheduler (``costmodel.simulate``) starts any ready node as soon as its resources are
free, in upward-rank order. Real runtimes issue kernels and collectives in *program order* on a
few streams and prefetch only a little ahead (FSDP gathers a layer or two ahead; activation
recomputation runs when the backward reaches the block). Without a bound, the simulated schedule
gathers every sharded parameter at time 0 and recomputes activations as soon as their inputs
exist, which holds all of them in memory at once: the memory objective then misjudges exactly
the plans (ZeRO/FSDP, recomputation) that exist to save memory.

``lookahead_edges`` gives control edges (a CSR the simulator takes beside the data edges, as
``ctl_ptr``/``ctl_idx``: they gate when a node may start and never extend a buffer's life) so
that, on each device,

- a compute node cannot start before the compute node ``window`` places earlier in that
  device's program order has started;
- a transfer or collective with no predecessors (a loop-carried state read away from its home:
  the FSDP all-gather) cannot start before the compute node ``window`` places before its first
  reader (the reader earliest in program order, on that reader's device).

Program order is the graph's op order (the order a program builds its ops and rewrites insert
them: ``ir.rewrites.recompute`` places a recomputed op just before its first backward reader),
made topological by always taking the earliest op that is ready; within an op, shard order.
Edges only point forward in that order, so no cycle can appear. ``window=0`` disables it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np

from ir.graph import Graph

DEFAULT_WINDOW = 16  # compute nodes per device: about a transformer sub-layer's forward or backward

_ORDER_CACHE: OrderedDict = OrderedDict()
_ORDER_CACHE_CAP = 64


def program_positions(g: Graph) -> dict[str, int]:
    """Op -> position in program order (op order, repaired to be topological)."""
    key = tuple(g.ops)  # op names in order: the rewrites that change data flow change names too
    hit = _ORDER_CACHE.get(key)
    if hit is not None:
        _ORDER_CACHE.move_to_end(key)
        return hit
    index = {n: i for i, n in enumerate(g.ops)}
    producers = g.producers
    preds = {n: {producers[t] for _, t in o.inputs if t in producers} for n, o in g.ops.items()}
    succ: dict[str, list[str]] = {n: [] for n in g.ops}
    indeg = {}
    for n, ps in preds.items():
        indeg[n] = len(ps)
        for p in ps:
            succ[p].append(n)
    heap = [index[n] for n, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    names = list(g.ops)
    pos: dict[str, int] = {}
    while heap:
        n = names[heapq.heappop(heap)]
        pos[n] = len(pos)
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                heapq.heappush(heap, index[m])
    _ORDER_CACHE[key] = pos
    if len(_ORDER_CACHE) > _ORDER_CACHE_CAP:
        _ORDER_CACHE.popitem(last=False)
    return pos


def lookahead_edges(low, g: Graph, window: int = DEFAULT_WINDOW) -> tuple[np.ndarray, np.ndarray] | None:
    """``(ctl_ptr, ctl_idx)``: the control edges of the lookahead (see module doc), or None."""
    if window <= 0:
        return None
    pos = program_positions(g)
    nc = low.n_compute
    offs = np.asarray(low.op_offsets)
    op_pos = np.array([pos[n] for n in low.op_names], np.int64)
    counts = np.diff(offs)
    node_pos = np.repeat(op_pos, counts)  # program position of each compute node's op
    dev = np.asarray(low.dev[:nc], np.int64)
    order = np.lexsort((np.arange(nc), node_pos, dev))  # by device, then program order
    dev_sorted = dev[order]
    starts = np.searchsorted(dev_sorted, np.arange(low.n_devices + 1))
    rank = np.empty(nc, np.int64)  # rank of a compute node within its device's program order
    rank[order] = np.arange(nc) - starts[dev_sorted]
    src, dst = [], []
    same = np.nonzero(rank[order] >= window)[0]
    if same.size:
        src.append(order[same - window])
        dst.append(order[same])
    # Transfers without predecessors: gated by the node `window` places before their first reader.
    n = low.kind.shape[0]
    ptr, idx = low.succ_ptr, low.succ_idx
    indeg = np.bincount(idx, minlength=n)
    free = np.nonzero(indeg[nc:] == 0)[0] + nc  # point-to-point and collective (kind 2) gathers
    if free.size:
        counts = ptr[free + 1] - ptr[free]
        t_of = np.repeat(free, counts)
        lo = np.repeat(ptr[free], counts)
        within = np.arange(t_of.size) - np.repeat(np.cumsum(counts) - counts, counts)
        v = np.asarray(idx)[lo + within].astype(np.int64)
        keep = v < nc
        t_of, v = t_of[keep], v[keep]
        if t_of.size:
            o = np.lexsort((node_pos[v], t_of))  # per transfer, its reader earliest in program order first
            t_sorted, v_sorted = t_of[o], v[o]
            first = np.ones(t_sorted.size, bool)
            first[1:] = t_sorted[1:] != t_sorted[:-1]
            t_first, reader = t_sorted[first], v_sorted[first]
            r = rank[reader] - window
            ok = r >= 0
            if ok.any():
                src.append(order[starts[dev[reader[ok]]] + r[ok]])
                dst.append(t_first[ok])
    if not src:
        return None
    s_new = np.concatenate(src)
    d_new = np.concatenate(dst)
    o = np.argsort(s_new, kind="stable")
    ctl_ptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(s_new, minlength=n), out=ctl_ptr[1:])
    return ctl_ptr, d_new[o].astype(np.int32)
