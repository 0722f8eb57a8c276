"""Bounded lookahead and pipeline schedules: devices issue work in program order, at most
``window`` nodes ahead; microbatched plans follow a GPipe or 1F1B order per device, and their
point-to-point transfers between stages follow it on each port (``_port_order_edges``).

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
  reader (the reader earliest in program order, on that reader's device);
- a compute node of an op fed by sources only (a weight's cast to bf16, which programs build
  before the first layer, and so the all-gather of its output) leaves the window's order and
  cannot start before the node ``window`` places before its op's first reader, on its own
  device: weights are fetched a layer or so ahead, as FSDP does, not the whole model at once.

Program order is the graph's op order (the order a program builds its ops and rewrites insert
them: ``ir.rewrites.recompute`` places a recomputed op just before its first backward reader),
made topological by always taking the earliest op that is ready; within an op, shard order.
Edges only point forward in that order, so no cycle can appear. ``window=0`` disables it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from itertools import compress, repeat
from operator import is_, is_not

import numpy as np
from numba import njit

from ir.graph import Graph
from ir.layers import LAYER_RE
from ir.rewrites.recompute import SUFFIX as RE
from ir.unique import distinct

DEFAULT_WINDOW = 16  # compute nodes per device: about a transformer sub-layer's forward or backward

_CACHE_CAP = 64


def program_positions(g: Graph) -> dict[str, int]:
    """Op -> position in program order (``Graph.topo_order``: op order, repaired to be topological)."""
    return {n: i for i, n in enumerate(g.topo_order)}


class _StructInfo:
    """What the lookahead needs of a lowering structure (``low.op_names`` is the structure's own
    tuple, shared by every plan lowered with it): ops' program positions and phases, and the
    batch column of each op per set of split-reduction params (``_batch_cols``)."""

    __slots__ = ("names", "op_pos", "_phase", "batch", "barrier_memo", "split_ops", "fetch_reader", "_flow",
                 "_out_group", "split_last", "mb_last", "_layer")

    def __init__(self, low, g: Graph) -> None:
        names = low.op_names
        self.names = names  # kept alive, so its id is not reused while cached
        # the lowering numbers ops in program order (``Graph.topo_order``)
        self.op_pos = np.arange(len(names), dtype=np.int64)
        self._phase = None
        self.batch: dict = {}
        self.barrier_memo: dict = {}
        self.split_last: tuple | None = None  # (split ops of the last plan, its batch columns)
        self._layer = None
        self.mb_last: _MbFacts | None = None  # the last plan's microbatch facts
        # ops with split params: within a structure always the same ones (splitting a reduction
        # adds an accumulate op, a new structure), only their params may change
        self.split_ops = [names[i] for i in np.nonzero(low.op_split)[0].tolist()]
        self.fetch_reader = fetch_readers(low.flow, low.op_reads > 0)
        self._flow = low.flow
        g_prod, _rptr, _rop, g_state = low.flow
        self._out_group = np.full(len(names), -1, np.int64)  # per op: the group of its output, or -1
        plain = np.nonzero(g_state == 0)[0]
        self._out_group[g_prod[plain]] = plain

    def readers(self, i: int) -> list[int]:
        """Positions of the readers of op ``i``'s output (from the lowering's data flow)."""
        _g_prod, rptr, rop, _g_state = self._flow
        gi = self._out_group[i]
        return rop[rptr[gi]:rptr[gi + 1]].tolist() if gi >= 0 else []

    def op_phase(self, g: Graph) -> np.ndarray:
        """1 per op of the backward, else 0 (only pipelines need it: found on first use). The
        backward starts at ``loss.grad`` (``ir.autodiff.step``) and at the recomputed forward
        ops (``<op>.re``, ``ir.rewrites.recompute``: they run when the backward needs them, so a
        pipeline places them in its backward units), and holds every op computed from them."""
        if self._phase is None:
            ops, k = g.ops, len(RE)
            seed = np.zeros(len(self.names), np.bool_)
            maybe = np.fromiter(map(_SEED_NAME.__getitem__, self.names), np.bool_, len(self.names))
            for i in np.nonzero(maybe)[0].tolist():
                n = self.names[i]
                seed[i] = n == "loss.grad" or n.startswith("loss.grad.") or (n.endswith(RE) and n[:-k] in ops)
            _g_prod, rptr, rop, _g_state = self._flow
            self._phase = _phase_kernel(seed, self._out_group, rptr, rop)
        return self._phase

    @property
    def op_layer(self) -> np.ndarray:
        """The layer number in each op's name (``l<k>.…``, ``l<k>_…``), -1 for ops outside the
        layers (found on first use: only pipelines need it)."""
        if self._layer is None:
            self._layer = np.fromiter((int(m.group(1)) if (m := LAYER_RE.match(n)) else -1 for n in self.names),
                                      np.int64, len(self.names))
        return self._layer

    def barriers(self, tag: np.ndarray) -> tuple[bool, bool, np.ndarray]:
        """``_barrier_kernel`` over this structure's data flow."""
        _g_prod, rptr, rop, _g_state = self._flow
        return _barrier_kernel(tag, self._out_group, rptr, rop)


class _SeedNames(dict):
    """Op name -> whether it may seed the backward (``loss.grad…``, ``….re``), memoised: op names
    are shared by every plan of a search, and testing each name of each new structure took
    ~0.4 ms of a gpt-2 step's structural moves."""

    def __missing__(self, name: str) -> bool:
        if len(self) > 200_000:
            self.clear()
        v = self[name] = name.startswith("loss.grad") or name.endswith(RE)
        return v


_SEED_NAME = _SeedNames()


@njit(cache=True, nogil=True)
def _phase_kernel(seed, out_group, rptr, rop):
    """int64 per op: 1 if a seed or computed from one (program order: readers follow producers)."""
    phase = seed.astype(np.int64)
    for u in range(seed.shape[0]):
        if phase[u] and out_group[u] >= 0:
            gi = out_group[u]
            for e in range(rptr[gi], rptr[gi + 1]):
                phase[rop[e]] = 1
    return phase


@njit(cache=True, nogil=True)
def _barrier_kernel(tag, out_group, rptr, rop):
    """``(within, across, after)`` for ops tagged with their phase (``tag``: 0 forward, 1
    backward, -1 not microbatched): ``within``, an untagged op lies between tagged ops of one
    phase (no pipeline order is possible: it needs every microbatch); ``across``, one lies
    between the forward and the backward (1F1B impossible: the backward of microbatch 0 waits
    for every forward); ``after``, per op, untagged and computed from tagged ops (gradient
    accumulation, the optimizer step: they run after the pipeline drains, as in Megatron-LM).
    One pass in program order, pushing to readers the phases that reach them through untagged
    ops only (``mask``) and those of their tagged producers (``direct``)."""
    n = tag.shape[0]
    mask = np.zeros(n, np.int64)
    direct = np.zeros(n, np.int64)
    after = np.zeros(n, np.bool_)
    within = False
    across = False
    for u in range(n):
        gi = out_group[u]
        if tag[u] >= 0:
            bit = 1 << tag[u]
            if mask[u] & bit:
                within = True
            if tag[u] == 1 and mask[u] & 1:
                across = True
            if gi >= 0:
                for e in range(rptr[gi], rptr[gi + 1]):
                    direct[rop[e]] |= bit
        else:
            r = mask[u] | direct[u]
            if r:
                after[u] = True
                if gi >= 0:
                    for e in range(rptr[gi], rptr[gi + 1]):
                        mask[rop[e]] |= r
    return within, across, after


def fetch_readers(flow: tuple, has_inputs: np.ndarray | list[bool]) -> np.ndarray:
    """Per op (``op_names`` order): for an op fed by sources only (a weight's cast, an embedding
    lookup), the program position of its output's first reader; else -1. From the lowering's
    data flow (``Lowered.flow``), vectorised: an op that reads something but no produced tensor
    (it reads no ordinary group), with the first reader of its output's group."""
    g_prod, rptr, rop, g_state = flow
    out = np.full(len(has_inputs), -1, np.int64)
    ordinary = np.nonzero(g_state == 0)[0]
    if not ordinary.size:
        return out
    counts = np.diff(rptr)
    fed = np.zeros(len(has_inputs), np.bool_)
    fed[rop[np.repeat(g_state == 0, counts)]] = True
    first = np.minimum.reduceat(rop, rptr[:-1])[ordinary]  # (every group has a reader)
    prod = g_prod[ordinary]
    ok = np.asarray(has_inputs, np.bool_)[prod] & ~fed[prod]
    out[prod[ok]] = first[ok]
    return out


_STRUCT_INFO: OrderedDict = OrderedDict()


def _struct_info(low, g: Graph) -> _StructInfo:
    names = low.op_names
    key = (id(names), low.program)
    hit = _STRUCT_INFO.get(key)
    if hit is not None and hit.names is names:
        _STRUCT_INFO.move_to_end(key)
        return hit
    info = _STRUCT_INFO[key] = _StructInfo(low, g)
    if len(_STRUCT_INFO) > _CACHE_CAP:
        _STRUCT_INFO.popitem(last=False)
    return info


def _batch_cols(low, g: Graph, info: _StructInfo) -> _BatchCols:
    """Index dim of each op (``low.op_names`` order) the batch runs through, -1 where none
    (``ir.rewrites.pipeline.batch_dims``), with the ops that have one. Within one structure and
    program only the split params of split reductions can change it (which reduction is split),
    so those key it; split ops that are the last plan's (the same objects) need no key at all."""
    gops = g.ops
    split = list(map(gops.__getitem__, info.split_ops))
    last = info.split_last
    if last is not None and not any(map(is_not, split, last[0])):
        return last[1]
    key = tuple([o.params_key for o in split])
    bc = info.batch.get(key)
    if bc is None:
        dims = {n: b[1] for n, b in _batch_flow(low, g, info)[0].items() if b[0] == "dim"}
        cols = np.fromiter(map(dims.get, info.names, repeat(-1)), np.int64, len(info.names))
        bc = _BatchCols(cols, info.names)
        if len(info.batch) > 16:
            info.batch.clear()
        info.batch[key] = bc
    info.split_last = (split, bc)
    return bc


class _BatchCols:
    """Batch columns of a structure's ops (``cols``), and the ops that have one: their positions
    (``sel``), names and columns."""

    __slots__ = ("cols", "sel", "names", "sel_cols")

    def __init__(self, cols: np.ndarray, names: tuple[str, ...]) -> None:
        self.cols = cols
        self.sel = np.nonzero(cols >= 0)[0]
        self.names = [names[i] for i in self.sel.tolist()]
        self.sel_cols = cols[self.sel]


_FLOWS: deque = deque(maxlen=6)  # (graph, its batch flow) of recent plans


def _batch_flow(low, g: Graph, info: _StructInfo):
    """``ir.rewrites.pipeline.batch_flow(g)``, updated from the recent plan that shares the most
    ops with ``g`` (usually its parent: a structural move changes a few ops, and the walk over
    every op took ~1.7 ms of each of them on a gpt-2 step)."""
    from ir.rewrites.pipeline import batch_flow, batch_flow_update

    gops = g.ops
    names = list(gops)
    best, fewest = None, len(names) // 4 + 1
    origin = g.origin() if g.origin is not None else None
    for base, flow in reversed(_FLOWS):
        if base is g:
            return flow
        if base is origin:  # the plan g was made from
            best = (base, flow)
            break
        n = sum(map(is_not, map(base.ops.get, names), gops.values()))
        if n < fewest:
            best, fewest = (base, flow), n
            if n <= 8:  # (a few ops: as good as any)
                break
    flow = None
    if best is not None:
        flow = batch_flow_update(g, best[0], best[1], info.names, info.readers)
    if flow is None:
        flow = batch_flow(g)
    _FLOWS.append((g, flow))
    return flow


def lookahead_tiers(low, g: Graph, window: int = DEFAULT_WINDOW,
                    pipeline: str = "auto") -> Iterator[tuple[np.ndarray, np.ndarray] | None]:
    """The control-edge sets ``(ctl_ptr, ctl_idx)`` (or None: no edges) a schedule may follow, in
    order of preference; the first that the data edges leave acyclic is the schedule's. A
    pipelined plan's are its 1F1B order (``pipeline``: ``auto`` or ``1f1b``) with the port order,
    then without it, then GPipe's order (``gpipe``, or where a placement contradicts 1F1B's
    interleaving: ops a search's ``place`` spread over every stage's devices make the unit chain
    cyclic) with and without the port order, each with the window's edges; the last is the
    window's alone (edges only forward in program order: always acyclic). The simulator's own
    topological pass tells whether a set is acyclic (``Evaluator`` tries them in turn), so the
    usual plan pays for no separate check: a pipelined 70B truncation at 512 GPUs spent ~0.2 s
    in two of them. ``pipeline``: ``auto`` (1F1B where the structure allows, else GPipe),
    ``gpipe``, ``1f1b`` (GPipe where 1F1B's order is cyclic) or ``off`` (the window's alone)."""
    pipe = pipeline_units(low, g, pipeline) if pipeline != "off" else None
    if pipe is not None:
        skip = pipe[0] >= 0  # pipeline units have their own order (the same nodes under GPipe's)
        win = _window_edges(low, g, window, skip) if window > 0 else ([], [])
        for k in range(2 if pipe[1] == "1f1b" else 1):
            p = pipe if k == 0 else pipeline_units(low, g, "gpipe")  # (GPipe's only once 1F1B's failed)
            if p is None:
                continue
            ps, pd = _unit_chain_edges(low, g, p[0])
            ts, td = _port_order_edges(low, g, p[0], p.stage)
            if ts.size:
                yield _edges_csr(low, [ps, ts] + win[0], [pd, td] + win[1])
            yield _edges_csr(low, [ps] + win[0], [pd] + win[1])
    yield _window_csr(low, g, window, None) if window > 0 else None


def lookahead_edges(low, g: Graph, window: int = DEFAULT_WINDOW,
                    pipeline: str = "auto") -> tuple[np.ndarray, np.ndarray] | None:
    """``(ctl_ptr, ctl_idx)``: the control edges of the lookahead and of the pipeline schedule
    (see the module doc), or None: the first of ``lookahead_tiers`` that leaves the data edges
    acyclic, checked here on its own (the evaluator lets the simulator check)."""
    for ctl in lookahead_tiers(low, g, window, pipeline):
        if ctl is None or _acyclic_csr(low, *ctl):
            return ctl
    return None  # (unreachable: the last tier, the window's edges, is acyclic)


def _edges_csr(low, src: list, dst: list) -> tuple[np.ndarray, np.ndarray] | None:
    """The CSR of these edge arrays' concatenation over the plan's nodes, or None if none."""
    src = [s for s in src if s.size]
    if not src:
        return None
    dst = [d for d in dst if d.size]
    s_new = np.concatenate(src) if len(src) > 1 else src[0]
    d_new = np.concatenate(dst) if len(dst) > 1 else dst[0]
    return _csr(low.kind.shape[0], s_new, d_new)


@njit(cache=True, nogil=True)
def _csr(n, src, dst):
    """``(ptr int64[n+1], idx int32[m])`` of the edges ``src[k] -> dst[k]``, each node's edges in
    their input order (a counting sort: the stable argsort it replaced cost ~0.1 ms a plan)."""
    ptr = np.zeros(n + 1, np.int64)
    for e in range(src.shape[0]):
        ptr[src[e] + 1] += 1
    for i in range(n):
        ptr[i + 1] += ptr[i]
    fill = ptr[:-1].copy()
    idx = np.empty(src.shape[0], np.int32)
    for e in range(src.shape[0]):
        s = src[e]
        idx[fill[s]] = dst[e]
        fill[s] += 1
    return ptr, idx


def _window_csr(low, g: Graph, window: int, skip: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """The CSR ``(ptr, idx)`` of the program-order window over compute nodes (those not in
    ``skip``: pipeline units have their own order), or None if it has no edges; see
    ``_window_kernel``."""
    nc = low.n_compute
    has_skip = skip is not None
    ptr, idx = _window_kernel(np.asarray(low.dev[:nc]), np.asarray(low.op_offsets, np.int64),
                              _struct_info(low, g).fetch_reader, skip if has_skip else _NO_SKIP, has_skip, window,
                              low.n_devices, low.kind.shape[0], low.succ_ptr, low.succ_idx)
    return (ptr, idx) if idx.size else None


def _window_edges(low, g: Graph, window: int, skip: np.ndarray | None) -> tuple[list, list]:
    """``_window_csr`` as edge arrays ``([src], [dst])`` by source, each source's in order (to
    join other edges' in one CSR), or ``([], [])``."""
    ctl = _window_csr(low, g, window, skip)
    if ctl is None:
        return [], []
    ptr, idx = ctl
    return [np.repeat(np.arange(ptr.shape[0] - 1), np.diff(ptr))], [idx]


_NO_SKIP = np.zeros(0, np.bool_)


@njit(cache=True, nogil=True)
def _window_kernel(dev_in, offs, fetch_reader, skip, has_skip, window, nd, n, succ_ptr, succ_idx):
    """The window's control edges as a CSR over the ``n`` nodes (``_csr``'s: int64 ``ptr``,
    int32 ``idx``), each source's edges in the order of three runs:

    - per device, in program order (nodes are numbered op by op in program order), each compute
      node after the one ``window`` places before it;
    - each transfer or collective with no predecessors (a gather of a loop-carried state) after
      the node ``window`` places before its first reader (the reader earliest in program order,
      the first such successor on ties) on that reader's device;
    - each node of an op fed by sources only (``fetch_reader[op] >= 0``: a weight's cast) leaves
      the window's order, after the node ``window`` places before the first node of its first
      reader's op on its own device.

    Nodes in ``skip`` (pipeline units, with their own order) and fetched nodes are on a device of
    their own (``nd``), never gating nor gated. The CSR is built here, not by ``_csr`` from edge
    arrays: a source has at most one edge of the first run, placed first, so only the few others
    need placing (the edge arrays and ``_csr`` cost ~0.2 ms of ~0.55 ms on a llama2-7b
    truncation at 64 GPUs)."""
    nc = dev_in.shape[0]
    # each node's device (``nd``: skipped and fetched nodes) and rank among the device's nodes
    dev = np.empty(nc, np.int32)
    rank = np.empty(nc, np.int32)
    starts = np.zeros(nd + 2, np.int64)
    fetch = np.empty(nc, np.int32)
    fetch_op = np.empty(nc, np.int32)  # (the op of its first reader)
    n_fetch = 0
    for o in range(offs.shape[0] - 1):
        reader = fetch_reader[o]
        for i in range(offs[o], offs[o + 1]):
            d = dev_in[i]
            if has_skip and skip[i]:
                d = nd
            elif reader >= 0:
                fetch[n_fetch] = i
                fetch_op[n_fetch] = reader
                n_fetch += 1
                d = nd
            dev[i] = d
            rank[i] = starts[d + 1]
            starts[d + 1] += 1
    for d in range(nd + 1):
        starts[d + 1] += starts[d]
    # ``order``: each device's nodes in program order (a counting sort); ``prev``: the node
    # ``window`` places before each one on its device (the first run's source), else -1;
    # ``ptr[i + 1]``: node i's edges counted so far
    ptr = np.zeros(n + 1, np.int64)
    order = np.empty(nc, np.int32)
    prev = np.empty(nc, np.int32)
    for i in range(nc):
        d = dev[i]
        p = starts[d] + rank[i]
        order[p] = i
        prev[i] = -1
        if d < nd and rank[i] >= window:
            s = order[p - window]
            prev[i] = s
            ptr[s + 1] = 1
    # the other two runs (at most one edge into each transfer and fetched node)
    x_src = np.empty(n - nc + n_fetch, np.int32)
    x_dst = np.empty(n - nc + n_fetch, np.int32)
    m = 0
    fed = np.zeros(n - nc, np.bool_)  # transfers with a predecessor
    for e in range(succ_idx.shape[0]):
        if succ_idx[e] >= nc:
            fed[succ_idx[e] - nc] = True
    for t in range(nc, n):
        if fed[t - nc]:
            continue
        best = -1
        lo = 0  # the first node of best's op
        for e in range(succ_ptr[t], succ_ptr[t + 1]):
            v = succ_idx[e]
            if v < nc and (best < 0 or v < lo):
                best = v
                lo = offs[_first_at_least(offs, 0, offs.shape[0], v + 1) - 1]
        if best >= 0 and prev[best] >= 0:
            x_src[m] = prev[best]
            x_dst[m] = t
            m += 1
    for j in range(n_fetch):
        d = dev_in[fetch[j]]
        # (the first of d's nodes at or after the reader's op, less the window)
        k = _first_at_least(order, starts[d], starts[d + 1], offs[fetch_op[j]]) - window
        if k >= starts[d]:
            x_src[m] = order[k]
            x_dst[m] = fetch[j]
            m += 1
    at = np.empty(m, np.int64)  # each such edge's place among its source's
    for q in range(m):
        at[q] = ptr[x_src[q] + 1]
        ptr[x_src[q] + 1] += 1
    for i in range(n):
        ptr[i + 1] += ptr[i]
    idx = np.empty(ptr[n], np.int32)
    for i in range(nc):
        if prev[i] >= 0:
            idx[ptr[prev[i]]] = i
    for q in range(m):
        idx[ptr[x_src[q]] + at[q]] = x_dst[q]
    return ptr, idx


@njit(cache=True, nogil=True)
def _first_at_least(a, lo, hi, x):
    """The first position in ``a[lo:hi]`` (ascending) whose value is at least ``x``, else ``hi``."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------------------------------------
# pipeline schedules
# ---------------------------------------------------------------------------------------------

POLICIES = ("auto", "gpipe", "1f1b", "off")
class _MbFacts:
    """Per op with a batch column (``_BatchCols.sel`` order), for one plan: the op, whether its
    devices hold several of its batch pieces (``_shard_starts``), its number of distinct batch starts, and the
    global microbatch of each shard (``parts``, for the plan's ``total``)."""

    __slots__ = ("bc", "ops", "several", "starts", "total", "parts", "_ids")

    def ids(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids of the ops, their argsort): to find an op of another plan among them."""
        if getattr(self, "_ids", None) is None:
            ids = np.fromiter(map(id, self.ops), np.int64, len(self.ops))
            self._ids = (ids, np.argsort(ids))
        return self._ids


def _match(F: _MbFacts, last: _MbFacts) -> tuple[np.ndarray, np.ndarray]:
    """Per op of ``F``: its position among ``last``'s ops and whether it is the same op (the
    same object, with the same batch column there)."""
    n = len(F.ops)
    if last.bc is F.bc:
        return np.arange(n), np.fromiter(map(is_, F.ops, last.ops), np.bool_, n)
    ids = np.fromiter(map(id, F.ops), np.int64, n)
    pid, order = last.ids()
    if not pid.size:
        return np.zeros(n, np.int64), np.zeros(n, np.bool_)
    cand = order[np.minimum(np.searchsorted(pid, ids, sorter=order), len(pid) - 1)]
    # (an id equal to a live op's is that op: ``last`` keeps its ops alive)
    same = (pid[cand] == ids) & (last.bc.sel_cols[cand] == F.bc.sel_cols)
    return cand, same


def _mb_facts(low, g: Graph, info: _StructInfo, bc: _BatchCols, multi: np.ndarray) -> _MbFacts:
    """The microbatch facts of ``g``, taken from the last plan's of the structure (else the last
    plan's) for every op that is the same object there: a child plan changes a few ops, and
    looking at every op of a gpt-2 step took ~0.5 ms of each evaluation."""
    F = _MbFacts()
    F.bc, F.ops, F.total, F.parts, F._ids = bc, list(map(g.ops.__getitem__, bc.names)), 0, None, None
    n = len(F.ops)
    last = info.mb_last if info.mb_last is not None else (_MB_RECENT[-1] if _MB_RECENT else None)
    if last is not None:
        match, same = _match(F, last)
        F.several = np.where(same, last.several[match], False)
        F.starts = np.where(same, last.starts[match], 0)
        changed = np.nonzero(~same)[0].tolist()
    else:
        match = same = None
        F.several, F.starts = np.zeros(n, np.bool_), np.zeros(n, np.int64)
        changed = range(n)
    offs, sel, cols = low.op_offsets, bc.sel, bc.sel_cols
    for k in changed:
        o, i = F.ops[k], sel[k]
        if not multi[i]:
            continue  # one node per device: not microbatched (``several`` stays False)
        if len(o.shards) == offs[i + 1] - offs[i]:  # (else: not lowered shard for shard, never microbatched)
            F.several[k], F.starts[k] = _shard_starts(o, int(cols[k]))
    several = F.starts[F.several]
    F.total = int(several.min()) if several.size else 0
    if F.total >= 2:
        if last is None or last.total != F.total or last.parts is None:  # a recent plan with the same total
            last = next((h for h in reversed(_MB_RECENT) if h.total == F.total and h.parts is not None), None)
            if last is not None:
                match, same = _match(F, last)
                changed = np.nonzero(~same)[0].tolist()
        if last is not None:
            parts = list(map(last.parts.__getitem__, match.tolist()))  # (the changed ones are redone below)
        else:
            parts, changed = [None] * n, range(n)
        for k in changed:
            i = sel[k]
            parts[k] = _op_microbatches(F.ops[k], g, int(cols[k]), int(offs[i + 1] - offs[i]), F.total)
        F.parts = parts
    info.mb_last = F
    _MB_RECENT.append(F)
    return F


def _multi(low) -> np.ndarray:
    """Per op: whether some device runs several of its nodes (only such ops can be microbatched)."""
    return _multi_kernel(np.asarray(low.op_offsets, np.int64), low.dev, low.n_devices)


@njit(cache=True, nogil=True)
def _multi_kernel(offs, dev, nd):
    n_ops = offs.shape[0] - 1
    out = np.zeros(n_ops, np.bool_)
    seen = np.full(nd, -1, np.int64)  # the last op that had a node on each device
    for o in range(n_ops):
        for i in range(offs[o], offs[o + 1]):
            d = dev[i]
            if seen[d] == o:
                out[o] = True
                break
            seen[d] = o
    return out


_MB_RECENT: deque = deque(maxlen=4)  # microbatch facts of the last plans (they hold their ops)


def _microbatch_parts(low, g: Graph) -> tuple[_StructInfo, _MbFacts] | None:
    """The structure's info and the plan's microbatch facts, or None when no op has several batch
    pieces on one device (``total`` < 2: nothing is microbatched)."""
    if low.n_compute == 0:
        return None
    multi = _multi(low)
    if not multi.any():  # (one pass over the nodes; most plans of small programs end here)
        return None
    # an op is microbatched only if some dim has two starts a device (``_shard_starts`` of its
    # batch dim): where no op's dims do, no batch flow is needed to say so (a search's plans with
    # a few ops split twice on a device: ~0.65 ms a truncation of llama2-7b on 64 GPUs)
    gops = g.ops
    if not any(map(_two_starts, map(gops.__getitem__, compress(low.op_names, multi)))):
        return None
    info = _struct_info(low, g)
    bc = _batch_cols(low, g, info)
    if not bc.sel.size:
        return None
    F = _mb_facts(low, g, info, bc, multi)
    return (info, F) if F.total >= 2 else None


def _microbatch_of_nodes(low, g: Graph) -> np.ndarray | None:
    """Microbatch index of each compute node (-1: not microbatched), or None when no op has
    several shards along its batch dim per device (on average: ``_shard_starts``).

    The plan's ``M`` global microbatches are those of its most coarsely microbatched op (the
    fewest distinct batch starts among microbatched ops;
    ``ir.rewrites.pipeline.microbatch`` cuts every op at the same global boundaries). A shard
    lying inside global microbatch ``j`` gets ``j``; then, per device, ``j`` is replaced by its
    rank among the microbatches that device runs (its data-parallel replica's ``m``)."""
    r = _microbatch_parts(low, g)
    return _node_microbatches(low, r[1]) if r is not None else None


def _node_microbatches(low, F: _MbFacts) -> np.ndarray | None:
    """``_microbatch_of_nodes`` from the plan's microbatch facts."""
    keep = [(k, j) for k, j in enumerate(F.parts) if j is not None]
    if not keep:
        return None
    has = np.zeros(len(low.op_names), np.bool_)
    has[F.bc.sel[[k for k, _j in keep]]] = True
    mb = _node_mb_kernel(np.asarray(low.op_offsets, np.int64), has, np.concatenate([j for _k, j in keep]),
                         np.asarray(low.dev), low.n_devices, F.total)
    return mb if (mb > 0).any() else None


@njit(cache=True, nogil=True)
def _node_mb_kernel(offs, has, found, dev, n_dev, total):
    """Each compute node's global microbatch (``found``: those of the ops marked in ``has``, their
    nodes in order; -1 elsewhere), then per device its rank among the device's own."""
    nc = offs[offs.shape[0] - 1]
    mb = np.full(nc, -1, np.int64)
    present = np.zeros((n_dev, total + 1), np.int64)
    q = 0
    for o in range(has.shape[0]):
        if has[o]:
            for i in range(offs[o], offs[o + 1]):
                mb[i] = found[q]
                present[dev[i], found[q]] = 1
                q += 1
    for d in range(n_dev):  # rank of each global microbatch among the device's
        r = -1
        for j in range(total + 1):
            r += present[d, j]
            present[d, j] = r
    for i in range(nc):
        if mb[i] >= 0:
            mb[i] = present[dev[i], mb[i]]
    return mb


def _op_microbatches(o, g: Graph, col: int, n_nodes: int, total: int) -> np.ndarray | None:
    """The global microbatch of each shard of op ``o`` (lowered into ``n_nodes`` nodes), or None."""
    if len(o.shards) != n_nodes:
        return None
    ext = g.signature(o).extents[col]
    if ext < total:
        return None
    return _global_ids(o, col, ext, total)


def _op_memo(o, name: str, key: tuple, fn):
    """``fn()`` memoised on op ``o`` under ``name`` for ``key`` (the memo lives and dies with the
    op, as ``Graph.signature``'s does; ``Op.__getstate__`` drops it)."""
    hit = o.__dict__.get(name)
    if hit is not None and hit[0] == key:
        return hit[1]
    out = fn()
    o.__dict__[name] = (key, out)
    return out


def _shard_starts(o, col: int) -> tuple[bool, int]:
    """(op ``o``'s devices hold at least two of its batch starts each on average, number of
    distinct batch starts). The average, as the lowering's ``_microbatched``: ``microbatch`` cuts
    every device's shard in ``m >= 2``, while one shard a search moved beside another (one device
    with two batch starts, the rest with one) is no microbatch. Counted as one, it made the step
    a single-stage "pipeline" whose units left the program-order window (a unit's nodes run in
    any order): one moved shard switched the lookahead off for the whole plan, and searches
    used that (a gpt-2 XL plan: 59 ms so, 134 ms in the window; docs/benchmarks.md)."""
    def run():
        sh = o.shards
        lo, d = sh.lo[:, col], sh.device
        pairs = distinct(d * (int(lo.max()) + 1) + lo)
        return bool(len(pairs) >= 2 * len(distinct(d))), int(len(distinct(lo)))
    return _op_memo(o, "_mbstarts", (col,), run)


def _two_starts(o) -> bool:
    """Whether some index dim of op ``o`` has two starts a device on average (``_shard_starts``'
    test for every dim at once): without one, ``o`` is no microbatched op."""
    def run():
        sh = o.shards
        d = sh.device
        if len(d) < 2:
            return False
        need = 2 * len(distinct(d))
        return any(len(distinct(d * (int(lo.max()) + 1) + lo)) >= need for lo in sh.lo.T)
    return _op_memo(o, "_twostarts", (), run)


def _global_ids(o, col: int, ext: int, total: int) -> np.ndarray | None:
    """Global microbatch of each shard of op ``o``, or None when a shard spans several."""
    from ir.rewrites.pipeline import microbatch_bounds

    def run():
        sh = o.shards
        b = microbatch_bounds(ext, total)
        j = np.searchsorted(b, sh.lo[:, col], side="right") - 1
        k = np.searchsorted(b, sh.hi[:, col] - 1, side="right") - 1
        return j.astype(np.int64) if np.array_equal(j, k) else None
    return _op_memo(o, "_mbids", (col, ext, total), run)


class PipelineUnits(tuple):
    """``(unit, policy)`` as ``pipeline_units`` returns them, and ``stage``: each device's stage
    key (``_first_forward``: the program position of its stage's first forward op, -1 for a
    device outside the pipeline)."""

    stage: np.ndarray


def pipeline_units(low, g: Graph, policy: str = "auto") -> PipelineUnits | None:
    """``(unit position of each compute node in its device's pipeline order (-1: outside the
    pipeline), policy used)``, or None when the plan has no microbatches or none can be ordered;
    its ``stage`` holds each device's stage key.

    Units are (phase, microbatch) per device: GPipe runs F0..F(m-1) then B0..B(m-1); 1F1B
    (PipeDream-Flush, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM", §2.2) runs ``w = min(p - s - 1, m)`` warm-up forwards on
    stage ``s`` of ``p``, then alternates one forward and one backward, so at most ``p - s``
    microbatches' activations are alive on stage ``s`` (GPipe: all ``m``)."""
    if policy not in POLICIES:
        raise ValueError(f"pipeline policy {policy!r} is not one of {list(POLICIES)}")
    r = _microbatch_parts(low, g) if policy != "off" else None
    if r is None:
        return None
    info, F = r
    found = [k for k, j in enumerate(F.parts) if j is not None]
    if not found:
        return None
    tagged = tuple(F.bc.sel[found].tolist())  # the microbatched ops (their nodes get microbatches)
    op_phase = info.op_phase(g)
    bar = info.barrier_memo.get(tagged)
    if bar is None:
        tag = np.full(len(op_phase), -1, np.int64)
        tag[list(tagged)] = op_phase[list(tagged)]
        bar = info.barriers(tag)
        if len(info.barrier_memo) > 16:
            info.barrier_memo.clear()
        info.barrier_memo[tagged] = bar
    within, across, after_op = bar
    if within:
        return None
    mb = _node_microbatches(low, F)
    if mb is None:
        return None
    offs = np.asarray(low.op_offsets, np.int64)
    dev = np.asarray(low.dev)
    fwd_ops, fwd_dev, any_bwd, m_dev = _pipeline_nodes(offs, op_phase, mb, dev, low.n_devices)
    use = "gpipe" if policy == "gpipe" or not any_bwd or across else "1f1b"
    first_f = _first_forward(low, info, fwd_ops, fwd_dev)
    has = first_f >= 0
    stage_ids = distinct(first_f[has])
    p = len(stage_ids)
    s_dev = np.where(has, np.searchsorted(stage_ids, first_f), p - 1)
    unit = _units_kernel(offs, op_phase, np.asarray(after_op, np.bool_), mb, dev, s_dev, m_dev, p, use == "1f1b")
    out = PipelineUnits((unit, use))
    out.stage = first_f
    return out


def _unit_chain_edges(low, g: Graph, unit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Control edges so that each device runs its units in order: the first node (in program
    order) of unit ``k + 1`` starts once every node of unit ``k`` has started, and the other
    nodes of unit ``k + 1`` once that first node has."""
    return _unit_chain_kernel(np.asarray(low.dev[:low.n_compute]), np.asarray(unit, np.int64), low.n_devices)


@njit(cache=True, nogil=True)
def _unit_chain_kernel(dev, unit, n_dev):
    """``_unit_chain_edges`` by a counting sort of the pipeline's nodes on (device, unit): node
    indices follow program order (the lowering numbers ops in program order), so each group's
    nodes stay in program order. Edges: every node of a group to the first of the device's next
    group, then each group's first node to its others (a NumPy lexsort took ~30 ms on a pipelined
    70B truncation)."""
    nc = unit.shape[0]
    n_units = 0
    cnt = 0
    for i in range(nc):
        if unit[i] >= 0:
            cnt += 1
            if unit[i] + 1 > n_units:
                n_units = unit[i] + 1
    if cnt == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    start = np.zeros(n_dev * n_units + 1, np.int64)
    for i in range(nc):
        if unit[i] >= 0:
            start[dev[i] * n_units + unit[i] + 1] += 1
    for k in range(n_dev * n_units):
        start[k + 1] += start[k]
    fill = start[:-1].copy()
    o = np.empty(cnt, np.int64)
    for i in range(nc):
        if unit[i] >= 0:
            k = dev[i] * n_units + unit[i]
            o[fill[k]] = i
            fill[k] += 1
    src = np.empty(2 * cnt, np.int64)
    dst = np.empty(2 * cnt, np.int64)
    e = 0
    for d in range(n_dev):  # every node of a group -> the first node of the device's next group
        prev = -1
        for u in range(n_units):
            k = d * n_units + u
            if start[k + 1] == start[k]:
                continue
            if prev >= 0:
                for q in range(start[prev], start[prev + 1]):
                    src[e] = o[q]
                    dst[e] = o[start[k]]
                    e += 1
            prev = k
    for k in range(n_dev * n_units):  # a group's first node -> its other nodes
        for q in range(start[k] + 1, start[k + 1]):
            src[e] = o[start[k]]
            dst[e] = o[q]
            e += 1
    return src[:e].copy(), dst[:e].copy()


def _port_order_edges(low, g: Graph, unit: np.ndarray, stage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Control edges so that each port moves the pipeline's point-to-point transfers in unit
    order: on a device's ingress (per link), a transfer whose readers are in unit ``k`` is
    issued after those whose readers are in an earlier unit; on its egress, likewise by the
    producer's unit. Within a unit, both ports order transfers by their producers' program
    positions (topological: a transfer never waits for one that depends on it), so two
    transfers between the same pair of ports are ordered alike on both ends (the readers' order
    on one end and the producers' on the other closed cycles under tensor parallelism).

    Without them the list scheduler, which places nodes in priority order and does not back-fill
    a port, may place a transfer that is *later* in time first (1F1B: the activation for stage
    ``s``'s next forward, ready only after the upstream stage's next forward) and hold the port
    past an earlier one (the gradient stage ``s`` waits for): measured at (p, m) = (4, 8), it
    added a stall to every steady-state step, also with transfers of zero length. Runtimes post
    receives and sends in program order (Megatron-LM's 1F1B,
    ``forward_backward_pipelining_without_interleaving``: warm-up forwards, then forward,
    ``send_forward_recv_backward``, backward, ``send_backward_recv_forward``), so a FIFO per
    port is what they do. Transfers with a reader outside the pipeline (or none) and collectives
    get no edge, and so do the transfers between two devices of one stage (tensor-parallel
    peers, data-parallel replicas): those are the stage's own exchanges, which Megatron-LM runs
    on other communicators than the pipeline's send/recv, and their ends need not agree (a
    partial sum produced in a late unit on one peer and read by an accumulate tagged with an
    early unit on another). Ordering them too closed a cycle in every pipelined plan with tensor
    parallelism, and ``lookahead_edges`` then dropped the port order altogether."""
    nc = low.n_compute
    n = low.kind.shape[0]
    if n == nc:
        return _NO_EDGES, _NO_EDGES
    link = np.zeros(n, np.int8) if low.link is None else np.asarray(low.link, np.int8)
    return _port_order_kernel(nc, np.asarray(low.kind), np.asarray(low.succ_ptr, np.int64),
                              np.asarray(low.succ_idx), np.asarray(low.dev), np.asarray(low.dst), link,
                              np.asarray(low.op_offsets, np.int64), _struct_info(low, g).op_pos,
                              np.asarray(unit, np.int64), np.asarray(stage, np.int64))


def _first_forward(low, info: _StructInfo, op: np.ndarray, dev: np.ndarray) -> np.ndarray:
    """Per device, the program position of the first forward op it runs in the pipeline (its
    forward nodes' ops ``op`` on devices ``dev``), or -1: devices of one stage share it, and its
    order is the stages' order. Only the
    layers a device holds its share of count (at least half the forward nodes of its busiest
    layer; the ops outside the layers count as one more): one shard moved onto a device of
    another stage (a search's ``move``) would otherwise make that device a stage of its own, whose
    1F1B order differs from its tensor-parallel peers' and closes a cycle through their exchanges
    (the pipeline order was then dropped)."""
    n_dev = low.n_devices
    none = np.full(n_dev, -1, np.int64)
    if not op.size:
        return none
    group = info.op_layer[op] + 1  # 0: outside the layers
    n_grp = int(group.max()) + 1
    held = np.bincount(dev * n_grp + group, minlength=n_dev * n_grp).reshape(n_dev, n_grp)
    own = 2 * held >= held.max(axis=1, keepdims=True)
    keep = own[dev, group]
    first = np.full(n_dev, np.iinfo(np.int64).max)
    np.minimum.at(first, dev[keep], info.op_pos[op[keep]])
    return np.where(first < np.iinfo(np.int64).max, first, none)


@njit(cache=True, nogil=True)
def _pipeline_nodes(offs, op_phase, mb, dev, n_dev):
    """Of the microbatched compute nodes (``mb >= 0``): the forward ones' ops and devices,
    whether any is in the backward, and each device's microbatch count."""
    n_fwd = 0
    for o in range(offs.shape[0] - 1):
        if op_phase[o] == 0:
            for i in range(offs[o], offs[o + 1]):
                if mb[i] >= 0:
                    n_fwd += 1
    ops = np.empty(n_fwd, np.int64)
    devs = np.empty(n_fwd, np.int64)
    m_dev = np.zeros(n_dev, np.int64)
    any_bwd = False
    k = 0
    for o in range(offs.shape[0] - 1):
        for i in range(offs[o], offs[o + 1]):
            if mb[i] < 0:
                continue
            if mb[i] + 1 > m_dev[dev[i]]:
                m_dev[dev[i]] = mb[i] + 1
            if op_phase[o] == 0:
                ops[k] = o
                devs[k] = dev[i]
                k += 1
            else:
                any_bwd = True
    return ops, devs, any_bwd, m_dev


@njit(cache=True, nogil=True)
def _units_kernel(offs, op_phase, after_op, mb, dev, s_dev, m_dev, p, one_f_one_b):
    """Each compute node's unit in its device's order (``pipeline_units``), in closed form: GPipe
    runs forward ``j`` as unit ``j`` and backward ``j`` as ``m + j``; 1F1B on stage ``s`` with
    ``w = min(p - s - 1, m)`` warm-up forwards runs forward ``j`` at ``j`` (``j < w``) or
    ``w + 2(j - w)``, and backward ``j`` at ``w + 2j + 1`` (``j < m - w``) or ``m + j``; the
    drain's nodes (``after_op``) at ``2m``; -1 outside the pipeline."""
    nc = mb.shape[0]
    unit = np.full(nc, -1, np.int64)
    for o in range(offs.shape[0] - 1):
        for i in range(offs[o], offs[o + 1]):
            j = mb[i]
            d = dev[i]
            m = m_dev[d]
            if j < 0:
                if after_op[o]:
                    unit[i] = 2 * m
                continue
            if not one_f_one_b:
                unit[i] = op_phase[o] * m + j
                continue
            w = min(p - s_dev[d] - 1, m)
            if op_phase[o] == 0:
                unit[i] = j if j < w else w + 2 * (j - w)
            else:
                unit[i] = w + 2 * j + 1 if j < m - w else m + j
    return unit


_NO_EDGES = np.zeros(0, np.int64)


@njit(cache=True, nogil=True)
def _port_order_kernel(nc, kind, succ_ptr, succ_idx, dev, dst, link, op_offsets, op_pos, unit, stage, dense=True):
    """``_port_order_edges`` over the lowering's arrays (``stage``: each device's, transfers inside
    one stage get no edge): each transfer's readers' earliest unit
    (none if a reader is outside the pipeline) and its producer's unit and program position, then
    per side (ingress: by the readers' unit; egress: by the producer's) the transfers sorted by
    (port, unit, producer position, node), and an edge between neighbours on one port. A pipelined
    70B truncation at 512 GPUs has up to 12 million transfers: NumPy's version (arrays over every
    edge, a lexsort) took 1-4 s. ``dense=False``: always the merge sorts (a test's comparison)."""
    n = kind.shape[0]
    T = n - nc
    big = np.iinfo(np.int64).max
    r_unit = np.full(T, big, np.int64)
    outside = np.zeros(T, np.bool_)
    p_unit = np.full(T, -1, np.int64)
    p_pos = np.zeros(T, np.int64)
    op = 0
    for i in range(nc):  # producers: the compute node feeding each transfer (the last one)
        while op_offsets[op + 1] <= i:
            op += 1
        for e in range(succ_ptr[i], succ_ptr[i + 1]):
            v = succ_idx[e]
            if kind[v] == 1:
                p_unit[v - nc] = unit[i]
                p_pos[v - nc] = op_pos[op]
    for t in range(nc, n):  # readers: the earliest unit; ``outside`` if a reader is in none
        if kind[t] != 1:
            continue
        for e in range(succ_ptr[t], succ_ptr[t + 1]):
            r = succ_idx[e]
            if r < nc:
                if unit[r] < 0:
                    outside[t - nc] = True
                elif unit[r] < r_unit[t - nc]:
                    r_unit[t - nc] = unit[r]
    span = 1
    for v in range(op_pos.shape[0]):
        if op_pos[v] + 1 > span:
            span = op_pos[v] + 1
    src = np.empty(2 * T, np.int64)
    tgt = np.empty(2 * T, np.int64)
    k = 0
    sel = np.empty(T, np.int64)
    for side in range(2):
        c = 0
        for t in range(nc, n):
            j = t - nc
            if kind[t] == 1 and stage[dev[t]] != stage[dst[t]] and (
                    (side == 0 and r_unit[j] < big and not outside[j]) or (side == 1 and p_unit[j] >= 0)):
                sel[c] = t
                c += 1
        if c < 2:
            continue
        ts = sel[:c]
        port = np.empty(c, np.int64)
        key = np.empty(c, np.int64)
        max_port = 0
        for q in range(c):
            t = ts[q]
            port[q] = (dst[t] if side == 0 else dev[t]) * 2 + link[t]
            if port[q] > max_port:
                max_port = port[q]
            key[q] = (r_unit[t - nc] if side == 0 else p_unit[t - nc]) * span + p_pos[t - nc]
        # ordered by (port, key), ties in node order: two stable counting sorts (by key, then by
        # port) where the keys span a range of the order of the transfers' count (units and
        # program positions are small numbers), else by port and each port's run by merge sort
        max_key = 0
        for q in range(c):
            if key[q] > max_key:
                max_key = key[q]
        start = np.zeros(max_port + 2, np.int64)
        for q in range(c):
            start[port[q] + 1] += 1
        for b in range(max_port + 1):
            start[b + 1] += start[b]
        fill = start[:-1].copy()
        o = np.empty(c, np.int64)
        if dense and max_key < 4 * c + (1 << 20):
            at = np.zeros(max_key + 2, np.int64)
            for q in range(c):
                at[key[q] + 1] += 1
            for b in range(max_key + 1):
                at[b + 1] += at[b]
            by_key = np.empty(c, np.int64)
            for q in range(c):
                by_key[at[key[q]]] = q
                at[key[q]] += 1
            for i in range(c):
                q = by_key[i]
                o[fill[port[q]]] = q
                fill[port[q]] += 1
        else:
            for q in range(c):
                o[fill[port[q]]] = q
                fill[port[q]] += 1
            for b in range(max_port + 1):
                if start[b + 1] - start[b] > 1:
                    seg = o[start[b]:start[b + 1]].copy()
                    o[start[b]:start[b + 1]] = seg[np.argsort(key[seg], kind="mergesort")]
        for b in range(max_port + 1):
            for q in range(start[b], start[b + 1] - 1):
                src[k] = ts[o[q]]
                tgt[k] = ts[o[q + 1]]
                k += 1
    return src[:k].copy(), tgt[:k].copy()


@njit(cache=True, nogil=True)
def _kahn_complete(n, succ_ptr, succ_idx, c_ptr, c_idx) -> bool:
    indeg = np.zeros(n, np.int64)
    for e in range(succ_idx.shape[0]):
        indeg[succ_idx[e]] += 1
    for e in range(c_idx.shape[0]):
        indeg[c_idx[e]] += 1
    stack = np.empty(n, np.int64)
    top = 0
    for i in range(n):
        if indeg[i] == 0:
            stack[top] = i
            top += 1
    seen = 0
    while top > 0:
        top -= 1
        u = stack[top]
        seen += 1
        for e in range(succ_ptr[u], succ_ptr[u + 1]):
            v = succ_idx[e]
            indeg[v] -= 1
            if indeg[v] == 0:
                stack[top] = v
                top += 1
        for e in range(c_ptr[u], c_ptr[u + 1]):
            v = c_idx[e]
            indeg[v] -= 1
            if indeg[v] == 0:
                stack[top] = v
                top += 1
    return seen == n


def _acyclic(low, src: np.ndarray, dst: np.ndarray) -> bool:
    """Whether data edges plus these control edges still order every node (a placement the
    pipeline order contradicts would otherwise deadlock the simulated schedule)."""
    n = low.kind.shape[0]
    return _acyclic_csr(low, *_csr(n, np.asarray(src, np.int64), np.asarray(dst, np.int64)))


def _acyclic_csr(low, c_ptr: np.ndarray, c_idx: np.ndarray) -> bool:
    """``_acyclic`` of control edges given as a CSR."""
    return bool(_kahn_complete(low.kind.shape[0], np.asarray(low.succ_ptr, np.int64), low.succ_idx, c_ptr, c_idx))
