"""Hand-built sharded plans of training steps for tests: data parallel (state whole on device 0 or
ZeRO-sharded) and tensor parallel, written with the plain rewrites only (``split``,
``split_reduction``, ``place``) so they test the IR, not the search's layout moves."""

from __future__ import annotations

from ir.graph import Graph
from ir.rewrites import place, split, split_reduction


def _spread(g: Graph, op: str, dim, k: int) -> Graph:
    return place(split(g, op, dim, k), op, list(range(k)))


def _reduce_over(g: Graph, op: str, red: str, k: int, scatter: bool) -> Graph:
    """Split reduction ``red`` of ``op`` in ``k`` blocks, one per device; the accumulate is
    scattered over the devices along its dim 0 (reduce-scatter) or kept on device 0 (reduce)."""
    g = split_reduction(g, op, k, red)
    g = _spread(g, op, "kb", k)
    acc = f"{op}.acc"
    if scatter and g.signature(acc).extents[0] >= k:
        g = _spread(g, acc, 0, k)
    return g


def data_parallel(step: Graph, k: int, batch: int, zero: bool) -> Graph:
    """Batch-split compute on devices ``0..k-1``; weight gradients reduced over the batch blocks;
    optimizer updates (the state's home) sharded over the devices (``zero``) or on device 0."""
    g = step
    for name in list(step.ops):
        sig = g.signature(name)
        batch_red = next((r for r in sig.reductions if r.extent == batch and any(
            g.tensors[g.ops[name].input_map[p]].shape[d] == batch and d == 0 for p, d in r.spans)), None)
        if batch_red is not None:
            g = _reduce_over(g, name, batch_red.name, k, zero)
        elif sig.extents and sig.extents[0] == batch and len(sig.extents) > 1:
            g = _spread(g, name, 0, k)
        elif zero and sig.extents[0] >= k:
            g = _spread(g, name, 0, k)
    return g


def tensor_parallel(step: Graph, k: int, dims: dict[str, int]) -> Graph:
    """Megatron-style: every op with an index dim or hidden reduction whose extent is one of the
    sharded model sizes (``dims``: name -> extent, e.g. heads, d_ff) splits it over ``0..k-1``;
    the rest stays on device 0."""
    g = step
    extents = set(dims.values())
    for name in list(step.ops):
        sig = g.signature(name)
        d = next((i for i, e in enumerate(sig.extents) if e in extents), None)
        if d is not None:
            g = _spread(g, name, d, k)
            continue
        red = next((r for r in sig.reductions if r.extent in extents), None)
        if red is not None:
            g = _reduce_over(g, name, red.name, k, scatter=False)
    return g
