"""Tied layers: a shard move made in one layer, made alike in every layer of its class.

A whole-model search wants one layout shared by the repeated layers (so the model keeps its
repetition, which ``costmodel.repetition`` turns into cheap evaluations) and lets layers differ
only where that pays. ``tie(parent, child)`` takes a child made from ``parent`` by a rewrite of
the ops and tensors of one layer ``i`` (a shard move, or a structural one: a fusion, a split
reduction, a substitution), and makes the same edit in every other layer of ``i``'s class
(``ir.layers.layer_classes``: layers equal to ``i`` in the parent, op for op): the replaced,
removed and inserted ops and the tensors, moved to layer ``j`` (``ir.layers.Shift``: names and
params re-pointed), inserted at the same place. An in-place edit (``Graph.edit``) stays one,
naming every replaced op, so the lowering stays incremental.

A child whose edit touches several layers or ops outside the layers, or reorders ops, is
returned as it is: that layer then differs from its class.
"""

from __future__ import annotations

from ir.graph import Graph, Op, Tensor
from ir.layers import Shift, layer_classes, layer_of, same_entry

__all__ = ["tie"]


def _diff(parent: Graph, child: Graph) -> tuple[dict, dict, dict] | None:
    """``(replace, insert_after, tensors)`` that ``parent.with_ops`` turns into ``child``, or
    None when ``child`` reorders the ops it shares with ``parent``."""
    if child.edit is not None and child.edit.parent() is parent:  # in place: the edit says it all
        return {n: child.ops[n] for n in child.edit.replaced}, {}, {}
    pops, cops = parent.ops, child.ops
    replace: dict[str, Op | None] = {n: None for n in pops if n not in cops}
    insert: dict[str, list[Op]] = {}
    anchor, last = None, -1
    pos = {n: i for i, n in enumerate(pops)}
    for n, o in cops.items():
        if n in pops:
            if pos[n] < last:
                return None
            last, anchor = pos[n], n
            if o is not pops[n]:
                replace[n] = o
        elif anchor is None:
            return None
        else:
            insert.setdefault(anchor, []).append(o)
    pt, ct = parent.tensors, child.tensors
    tensors: dict[str, Tensor | None] = {}
    if pt is not ct:  # removed, then added or changed
        tensors = {t: None for t in pt if t not in ct} | {t: v for t, v in ct.items() if pt.get(t) is not v}
    return replace, insert, tensors


def tie(parent: Graph, child: Graph) -> Graph:
    """``child`` with its edit of one layer's ops made in every layer of that layer's class
    (see the module doc); ``child`` itself when there is nothing to tie."""
    diff = _diff(parent, child)
    if diff is None:
        return child
    replace, insert, tensors = diff
    # the anchors of insertions are places, not edits: a recomputed layer's copies go just before
    # its first backward reader, after an op of the layer above (shifted alike below)
    names = [*replace, *(o.name for extra in insert.values() for o in extra), *tensors]
    owners = {layer_of(n) for n in names}
    if len(owners) != 1 or None in owners or any(layer_of(a) is None for a in insert):
        return child  # (an anchor outside the layers would not move with the layer)
    (i,) = owners
    classes = layer_classes(parent)
    if classes is None or i >= len(classes):
        return child
    mates = [j for j, c in enumerate(classes) if c == classes[i] and j != i]
    if not mates:
        return child
    all_replace, all_insert, all_tensors = dict(replace), {a: list(v) for a, v in insert.items()}, dict(tensors)
    for j in mates:
        shift = Shift(j - i)
        for n, o in replace.items():
            m = shift.name(n)
            new = shift.op(o) if o is not None else None
            if m is None or m not in parent.ops or (o is not None and new is None):
                return child  # the class's layers do not line up: leave the others alone
            if new is not None:
                same_entry(o, new, child)
            all_replace[m] = new
        for a, extra in insert.items():
            b = shift.name(a)
            moved = [shift.op(o) for o in extra]
            if b is None or b not in parent.ops or any(o is None for o in moved):
                return child
            for o, new in zip(extra, moved):
                same_entry(o, new, child)
            all_insert[b] = moved
        for t, v in tensors.items():
            u = shift.name(t)
            if u is None:
                return child
            all_tensors[u] = None if v is None else Tensor(u, v.shape, v.dtype, v.role)
    return parent.with_ops(all_replace, insert_after=all_insert or None, tensors=all_tensors or None)
