"""Hand-built sharded plans of training steps for tests: data parallel (state whole on device 0 or
ZeRO-sharded) and tensor parallel, written with the plain rewrites only (``split_reduction`` and
shard tables cut like ``split`` + ``place`` would) so they test the IR, not the search's layout moves.
Shard changes are collected and applied in one ``with_ops``, so whole models build in seconds."""

from __future__ import annotations

import numpy as np

from ir.graph import Graph, Shards
from ir.rewrites import split_reduction
from ir.zspace import split_points


def spread(g: Graph, op: str, dim: int, k: int) -> Shards:
    """``op``'s one whole shard cut ``k`` ways along index ``dim``, piece ``i`` on device ``i``."""
    ext = g.signature(op).extents
    cuts = split_points(0, ext[dim], k)
    lo = np.zeros((k, len(ext)), np.int64)
    hi = np.tile(np.array(ext, np.int64), (k, 1))
    lo[:, dim], hi[:, dim] = cuts[:-1], cuts[1:]
    return Shards(lo, hi, np.arange(k))


def _reduce_over(g: Graph, op: str, red: str, k: int, scatter: bool) -> tuple[Graph, dict]:
    """Split reduction ``red`` of ``op`` in ``k`` blocks, one per device; the accumulate is
    scattered over the devices along its dim 0 (reduce-scatter) or kept on device 0 (reduce)."""
    g = split_reduction(g, op, k, red)
    new = {op: g.ops[op].replace(shards=spread(g, op, 0, k))}
    acc = f"{op}.acc"
    if scatter and g.signature(acc).extents[0] >= k:
        new[acc] = g.ops[acc].replace(shards=spread(g, acc, 0, k))
    return g, new


def data_parallel(step: Graph, k: int, batch: int, zero: bool) -> Graph:
    """Batch-split compute on devices ``0..k-1``; weight gradients reduced over the batch blocks;
    optimizer updates (the state's home) sharded over the devices (``zero``) or on device 0."""
    g = step
    new: dict = {}
    for name in list(step.ops):
        sig = g.signature(name)
        batch_red = next((r for r in sig.reductions if r.extent == batch and any(
            g.tensors[g.ops[name].input_map[p]].shape[d] == batch and d == 0 for p, d in r.spans)), None)
        if batch_red is not None:
            g, more = _reduce_over(g, name, batch_red.name, k, zero)
            new.update(more)
        elif sig.extents and sig.extents[0] == batch and len(sig.extents) > 1:
            new[name] = g.ops[name].replace(shards=spread(g, name, 0, k))
        elif zero and sig.extents[0] >= k:
            new[name] = g.ops[name].replace(shards=spread(g, name, 0, k))
    return g.with_ops(new)


def tensor_parallel(step: Graph, k: int, dims: dict[str, int]) -> Graph:
    """Megatron-style: every op with an index dim or hidden reduction whose extent is one of the
    sharded model sizes (``dims``: name -> extent, e.g. heads, d_ff) splits it over ``0..k-1``;
    the rest stays on device 0."""
    g = step
    new: dict = {}
    extents = set(dims.values())
    for name in list(step.ops):
        sig = g.signature(name)
        d = next((i for i, e in enumerate(sig.extents) if e in extents), None)
        if d is not None:
            new[name] = g.ops[name].replace(shards=spread(g, name, d, k))
            continue
        red = next((r for r in sig.reductions if r.extent in extents), None)
        if red is not None:
            g, more = _reduce_over(g, name, red.name, k, scatter=False)
            new.update(more)
    return g.with_ops(new)
