"""Pipeline parallelism: stage placement of layer ranges, and microbatching.

Two meaning-preserving moves (placement and sharding only; every shard still computes what it did):

- ``stage(g, "4:7", "16:32")`` puts the ops of layers 4..7 on devices 16..31: a shard on device
  ``d`` moves to ``16 + d mod 16``, so a plan laid out over a 16-device mesh (TP × DP) keeps its
  layout inside the stage. ``pipeline(g, p, G)`` does it for ``p`` equal contiguous layer ranges,
  stage ``s`` on devices ``s·G .. (s+1)·G - 1`` (Megatron-LM's pipeline: TP × DP inside a stage).
- ``microbatch(g, "all", m)`` cuts the batch into ``m`` microbatches for every op of a region:
  each shard of an op whose index has a batch dim is split along it into ``m`` shards on the same
  device (the simulator runs them as separate tasks, so stage ``s + 1`` can start microbatch 0
  while stage ``s`` computes microbatch 1). An op that *reduces* over the batch (weight and bias
  gradients, the loss) gets ``split_reduction`` into ``m`` blocks, one shard per block on the
  shard's device, and an ``accumulate`` where the op was: weight-gradient accumulation across
  microbatches is a reduction, as ``ir.rewrites.reduction`` already expresses it. Where the
  reduction was already split over data-parallel devices (``k`` blocks), it is re-split into
  ``k·m`` blocks and the accumulate reduced in two levels (``ir.rewrites.hierarchical``): each
  device sums its own ``m`` microbatch partials first, then the ``k`` devices reduce as before.
  A reduction whose batch extent ``m`` does not divide (reduction blocks are equal) stays whole:
  it runs once after the last microbatch, over every microbatch's activations (a valid plan
  that holds them all; the ops whose batch dims can be cut are still cut).
  Under tensor parallelism each device's microbatch partials are pieces of the sum (a column
  slice), and the first level sums them where they are (``hierarchical.own_boxes``): no partial
  crosses a link, so the bytes moved do not grow with ``m``.

Which ops belong to a layer: ops named ``l<k>.…`` (the ``ir.workloads`` gpt/llama programs), ops
derived from them by the training step (``l3.ff1.dW``, ``l3.resid1.out.gsum1``) and the optimizer
and cast ops of their parameters (``l3_W1.update``, ``l3_W1.m.update``, ``l3_W1.cast``). Ops
outside the layers go with the first stage (the embedding, its gradient and update) or the last
(final norm, head, loss), by where their forward op sits in the program.

Memory: the lowering accumulates microbatch partials in place (``Lowered.acc``), one buffer per
accumulate, as runtimes do.
"""

from __future__ import annotations

import heapq
import re
from itertools import compress
from operator import is_not
from typing import Callable, Iterable

import numpy as np

from ir.graph import STATE_ROLES, Graph, Shards
from ir.layers import LAYER_RE
from ir.rewrites.errors import RewriteError
from ir.rewrites.hierarchical import two_level
from ir.rewrites.layout import _unit_col, select_ops
from ir.rewrites.reduction import merge_reduction, split_reduction
from ir.rewrites.shard import split
from ir.unique import distinct
from ir.zspace import split_points


# ------------------------------------------------------------------------------------------
# layers
# ------------------------------------------------------------------------------------------


def op_layers(g: Graph) -> tuple[dict[str, int], int]:
    """``(layer of each op, number of layers)``; ops before the first layer get ``-1``, ops
    after it ``L`` (see the module doc). ``L = 0`` when no op is named ``l<k>.…``."""
    return _op_layers(tuple(g.ops), g)


def _op_layers(names: tuple[str, ...], g: Graph) -> tuple[dict[str, int], int]:
    key = names
    hit = _LAYER_CACHE.get(key)
    if hit is not None:
        return hit
    order = g.topo_order
    pos = {n: i for i, n in enumerate(order)}
    direct: dict[str, int] = {}
    for n in order:
        m = LAYER_RE.match(n)
        if m:
            direct[n] = int(m.group(1))
    n_layers = max(direct.values()) + 1 if direct else 0
    # where the layers start: the first op named l<k>.… (casts of l<k>_W run earlier)
    first = min((pos[n] for n in direct if re.match(r"^l\d+\.", n)), default=len(order))
    consumers = g.consumers

    def resolve(name: str) -> tuple[int | None, str]:
        """(layer, the forward op it derives from)."""
        m = LAYER_RE.match(name)
        if m:
            return int(m.group(1)), name
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):
            stem = ".".join(parts[:k])
            if stem in g.ops and stem != name:
                return resolve(stem)
            t = g.tensors.get(stem)
            if t is not None and t.role in STATE_ROLES:  # a parameter's update/cast: where it is read
                readers = sorted(pos[r] for r, _ in consumers.get(stem, []) if r in pos)
                if readers:
                    r = order[readers[0]]
                    if r != name:
                        return resolve(r)
        return None, name

    out: dict[str, int] = {}
    for n in order:
        k, anchor = resolve(n)
        if k is None:
            k = -1 if pos.get(anchor, pos[n]) < first else n_layers
        out[n] = k
    res = (out, n_layers)
    if len(_LAYER_CACHE) > 32:
        _LAYER_CACHE.clear()
    _LAYER_CACHE[key] = res
    return res


_LAYER_CACHE: dict[tuple[str, ...], tuple[dict[str, int], int]] = {}


def _parse_range(text: str, what: str) -> tuple[int, int]:
    a, sep, b = str(text).partition(":")
    try:
        lo, hi = int(a), int(b) if sep else int(a)
    except ValueError:
        raise RewriteError(f"{what} {text!r} must be A:B (two integers)") from None
    return lo, hi


def _remap(g: Graph, names: list[str], d0: int, size: int) -> dict:
    ops = {}
    for n in names:
        o = g.ops[n]
        dev = d0 + np.asarray(o.shards.device, np.int64) % size
        if not np.array_equal(dev, o.shards.device):
            ops[n] = o.replace(shards=o.shards.with_devices(dev))
    return ops


def stage(g: Graph, layers: str, devices: str) -> Graph:
    """Put the ops of layers ``A:B`` (inclusive; with the ops before the first layer when
    ``A == 0`` and those after the last when ``B`` is the last layer) on devices ``D0:D1``
    (half-open): a shard on device ``d`` moves to ``D0 + d mod (D1 - D0)``."""
    a, b = _parse_range(layers, "layers")
    d0, d1 = _parse_range(devices, "devices")
    lay, n_layers = op_layers(g)
    if n_layers == 0:
        raise RewriteError("stage: the program has no layers (ops named l<k>.…, as ir.workloads gpt/llama)")
    if not 0 <= a <= b < n_layers:
        raise RewriteError(f"stage: layers {layers!r} must satisfy 0 <= A <= B < {n_layers}")
    if not 0 <= d0 < d1:
        raise RewriteError(f"stage: devices {devices!r} must be a half-open range D0:D1 with 0 <= D0 < D1")
    lo = -1 if a == 0 else a
    hi = n_layers if b == n_layers - 1 else b
    names = [n for n, k in lay.items() if lo <= k <= hi]
    ops = _remap(g, names, d0, d1 - d0)
    if not ops:
        raise RewriteError(f"stage: layers {layers} are already on devices {devices}")
    return g.with_ops(ops)


def pipeline(g: Graph, stages: int, group: int) -> Graph:
    """``stages`` near-equal contiguous layer ranges, stage ``s`` on devices ``s·group ..``."""
    lay, n_layers = op_layers(g)
    if n_layers == 0:
        raise RewriteError("pipeline: the program has no layers (ops named l<k>.…, as ir.workloads gpt/llama)")
    if not 2 <= stages <= n_layers or group < 1:
        raise RewriteError(f"pipeline: needs 2 <= stages <= {n_layers} layers and group >= 1, "
                           f"got stages={stages}, group={group}")
    cuts = split_points(0, n_layers, stages)
    ops: dict = {}
    for s in range(stages):
        lo = -1 if s == 0 else cuts[s]
        hi = n_layers if s == stages - 1 else cuts[s + 1] - 1
        names = [n for n, k in lay.items() if lo <= k <= hi]
        ops.update(_remap(g, names, s * group, group))
    if not ops:
        raise RewriteError(f"pipeline: already in {stages} stages of {group} devices")
    return g.with_ops(ops)


def stage_of_layers(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """The inclusive layer range of each of ``stages`` near-equal stages."""
    cuts = split_points(0, n_layers, stages)
    return [(cuts[s], cuts[s + 1] - 1) for s in range(stages)]


# ------------------------------------------------------------------------------------------
# batch dims
# ------------------------------------------------------------------------------------------


def batch_dims(g: Graph) -> dict[str, tuple[str, int | str]]:
    """Per op, where the batch (dim 0 of the graph's ``input`` tensors) runs through it:
    ``("dim", c)``: index dim ``c`` (for a partial op whose split reduction is over the batch:
    its block dim 0); ``("red", name)``: a hidden reduction. Ops the batch does not reach are
    absent (weights' casts, optimizer updates)."""
    key = tuple((n, o.params_key) for n, o in g.ops.items())
    hit = _BATCH_CACHE.get(key)
    if hit is not None:
        return hit
    out = batch_flow(g)[0]
    if len(_BATCH_CACHE) > 32:
        _BATCH_CACHE.clear()
    _BATCH_CACHE[key] = out
    return out


BatchFlow = tuple[dict[str, tuple[str, int | str]], dict[str, frozenset[int]]]


def batch_flow(g: Graph) -> BatchFlow:
    """``(batch_dims(g), the batch rows of each tensor the batch reaches)`` (uncached)."""
    T: dict[str, frozenset[int]] = {n: _BATCH_ROWS for n, t in g.tensors.items() if t.role == "input" and t.shape}
    out: dict[str, tuple[str, int | str]] = {}
    ops = g.ops
    for n in g.topo_order:
        _visit(g, ops[n], T, out)
    return out, T


_BATCH_ROWS = frozenset((0,))


def _visit(g: Graph, o, T: dict, out: dict) -> frozenset[int] | None:
    """Op ``o``'s batch dims into ``out`` and its output's rows into ``T``, from ``T`` of its
    inputs; returns the output's rows (None: the batch does not leave it)."""
    tin = tuple([T.get(t) for _, t in o.inputs])
    found = tout = None
    if any(tin):
        sig = g.signature(o)
        # memo on the op (ops are shared by the plans of a search): same signature, same batch rows in
        memo = o.__dict__.get("_batch")
        if memo is not None and memo[0] is sig and memo[1] == tin:
            found, tout = memo[2], memo[3]
        else:
            found, tout = _op_batch(o, sig, tin)
            o.__dict__["_batch"] = (sig, tin, found, tout)
    if found is None:
        out.pop(o.name, None)
        T.pop(o.output, None)
        return None
    out[o.name] = found
    if tout is None:
        T.pop(o.output, None)
    else:
        T[o.output] = tout
    return tout


def batch_flow_update(g: Graph, base: Graph, flow: BatchFlow, order: tuple[str, ...],
                      readers: Callable[[int], Iterable[int]]) -> BatchFlow | None:
    """``batch_flow(g)`` from ``flow = batch_flow(base)``, where ``g`` and ``base`` share most op
    objects (a rewrite's child and its parent): only the ops that are not ``base``'s, and the
    readers of tensors whose rows change, are visited, in program order. ``order``: ``g``'s
    program order; ``readers(i)``: positions in it of the readers of op ``i``'s output. None when
    the graphs differ in their sources (then compute it whole)."""
    gops, bops = g.ops, base.ops
    names = list(gops)
    dirty = list(compress(names, map(is_not, map(bops.get, names), gops.values())))
    if g.tensors is not base.tensors:
        outs, gt = {gops[n].output for n in dirty}, g.tensors
        if any(n in gt and n not in outs for n in g.changed_tensors(base.tensors)):
            return None  # a source or another tensor changed under kept ops
    out, T = dict(flow[0]), dict(flow[1])
    old = flow[1]
    for n in bops.keys() - gops.keys():  # removed ops: the new producers of their outputs are dirty
        out.pop(n, None)
        T.pop(bops[n].output, None)
    pos = {n: i for i, n in enumerate(order)} if dirty else {}
    heap = [pos[n] for n in dirty]
    heapq.heapify(heap)
    seen: set[int] = set()
    while heap:
        i = heapq.heappop(heap)
        if i in seen:
            continue
        seen.add(i)
        o = gops[order[i]]
        if _visit(g, o, T, out) != old.get(o.output):  # its readers saw other rows in base
            for r in readers(i):
                heapq.heappush(heap, r)
    return out, T


_BATCH_CACHE: dict[tuple, dict[str, tuple[str, int | str]]] = {}


def _op_batch(o, sig, tin: tuple) -> tuple[tuple[str, int | str] | None, frozenset[int] | None]:
    """(where the batch runs through op ``o``, the batch rows of its output) given the batch rows
    ``tin`` of its inputs (see ``batch_dims``)."""
    found: tuple[str, int | str] | None = None
    split_from = sig.split_from
    for (port, _t), rows in zip(o.inputs, tin):
        for r in rows or ():
            if split_from is not None and (port, r) in split_from.spans:
                found = ("dim", 0)
                break
            proj = sig.inputs[port]
            c = _unit_col(proj.A[r]) if r < len(proj.A) else None
            if c is not None and proj.s[r] == 1:
                found = ("dim", c)
                break
            red = next((x for x in sig.reductions if (port, r) in x.spans), None)
            if red is not None and found is None:
                found = ("red", red.name)
        if found is not None and found[0] == "dim":
            break
    if found is None or found[0] != "dim":
        return found, None
    c = found[1]
    return found, frozenset(r for r, row in enumerate(sig.output.A) if _unit_col(row) == c)


# ------------------------------------------------------------------------------------------
# microbatching
# ------------------------------------------------------------------------------------------


def _resplit(g: Graph, name: str, m: int) -> Graph:
    """A reduction already split into ``k`` blocks over devices: ``k·m`` blocks, each device's
    ``m`` microbatch partials summed on it first (two levels)."""
    o = g.ops[name]
    spl = o.params["split"]
    k, red = int(spl["parts"]), spl["reduction"]
    readers = g.consumers.get(o.output, [])
    if len(readers) != 1 or g.ops[readers[0][0]].kernel != "accumulate":
        raise RewriteError(f"{name}: its partials are not read by one accumulate")
    acc = readers[0][0]
    a = g.ops[acc]
    if a.params.get("split"):
        raise RewriteError(f"{acc}: already reduced in two levels")
    P = o.shards
    if np.any(P.hi[:, 0] - P.lo[:, 0] != 1):
        raise RewriteError(f"{name}: a shard holds several reduction blocks")
    g2 = split_reduction(merge_reduction(g, name), name, k * m, red)
    lo = np.repeat(P.lo, m, axis=0)
    hi = np.repeat(P.hi, m, axis=0)
    i = np.tile(np.arange(m), len(P))
    lo[:, 0] = lo[:, 0] * m + i
    hi[:, 0] = lo[:, 0] + 1
    new = Shards(lo, hi, np.repeat(P.device, m))
    g2 = g2.with_ops({name: g2.ops[name].replace(shards=new), acc: g2.ops[acc].replace(shards=a.shards)})
    return two_level(g2, acc, m)


def microbatch_bounds(extent: int, total: int) -> np.ndarray:
    """Start of each of ``total`` global microbatches along a batch dim of ``extent`` (near-equal),
    and ``extent`` at the end: global microbatch ``j`` is ``[b[j], b[j+1])``."""
    return np.asarray(split_points(0, extent, total), np.int64)


def _cut_at(g: Graph, name: str, col: int, total: int) -> Graph:
    """Cut every shard of ``name`` at the global microbatch boundaries along index ``col``."""
    o = g.ops[name]
    sh = o.shards
    ext = g.signature(o).extents[col]
    if ext < total:
        raise RewriteError(f"{name}: batch extent {ext} is smaller than {total} microbatches")
    b = microbatch_bounds(ext, total)
    a, z = sh.lo[:, col], sh.hi[:, col]
    # shard i is cut at the bounds strictly inside it, b[first[i]:last[i]], into pieces[i] pieces
    first = np.searchsorted(b, a, side="right")
    last = np.searchsorted(b, z, side="left")
    pieces = np.maximum(last - first, 0) + 1
    if pieces.sum() == len(sh):
        raise RewriteError(f"{name}: its shards already lie within single microbatches")
    row = np.repeat(np.arange(len(sh)), pieces)  # the shard each piece comes from, in order
    j = np.arange(len(row)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece number in it
    k = first[row] + j  # the bound ending piece j, unless it is the shard's last piece
    lo, hi = sh.lo[row], sh.hi[row]
    lo[:, col] = np.where(j == 0, a[row], b.take(k - 1, mode="clip"))  # (clipped: entries not taken)
    hi[:, col] = np.where(j == pieces[row] - 1, z[row], b.take(k, mode="clip"))
    return g.with_ops({name: o.replace(shards=Shards(lo, hi, sh.device[row]))})


def _batch_ranges(g: Graph, names: list[str], bd: dict) -> int:
    """The fewest distinct batch ranges among the region's ops whose index has the batch (the
    data-parallel degree of the plan's main ops)."""
    counts = []
    for n in names:
        b = bd.get(n)
        o = g.ops.get(n)
        if b is None or b[0] != "dim" or o is None or o.params.get("split"):
            continue
        counts.append(len(distinct(o.shards.lo[:, b[1]])))
    return min(counts) if counts else 1


def microbatch(g: Graph, ops: str, m: int) -> Graph:
    """Cut the batch into ``m`` microbatches for every op of the region ``ops`` (a region text
    as ``ir.rewrites.layout.select_ops`` reads it: ``all``, a glob, ``a:b``)."""
    if not isinstance(m, (int, np.integer)) or m < 2:
        raise RewriteError(f"microbatch needs m >= 2 microbatches, got {m!r}")
    names = select_ops(g, ops)
    bd = batch_dims(g)
    total = m * _batch_ranges(g, names, bd)  # microbatches over the whole batch (m per data-parallel rank)
    done = 0
    refused: list[str] = []
    for n in names:
        if n not in g.ops or n not in bd:
            continue
        kind, x = bd[n]
        o = g.ops[n]
        try:
            if kind == "dim" and o.params.get("split") and x == 0:
                g = _resplit(g, n, m)
            elif kind == "dim":
                # cut at global microbatch boundaries: an op whose batch is already split finer
                # (a weightless op under tensor parallelism) gets the same microbatches
                g = _cut_at(g, n, x, total)
            elif o.params.get("split"):
                raise RewriteError(f"{n}: another reduction of it is split already")
            else:
                g = split_reduction(g, n, m, str(x))
                g = split(g, n, 0, m)  # one block per shard, on the shard's device
                # the accumulate stays where the op's shards were: microbatch partials are summed locally
        except RewriteError as e:
            refused.append(f"{n} ({e})")
            continue
        done += 1
    if not done:
        why = "; ".join(refused[:3]) or "no op of the region reads the batch"
        raise RewriteError(f"microbatch: no op of region {ops!r} could be cut into {m} microbatches: {why}")
    return g


__all__ = ["LAYER_RE", "batch_dims", "batch_flow", "batch_flow_update", "microbatch", "microbatch_bounds", "op_layers", "pipeline", "stage", "stage_of_layers"]
