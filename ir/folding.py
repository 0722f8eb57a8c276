"""Constant folding: the ops a runtime computes once, when it loads the weights, not every step.

An op whose every input is a parameter that the program never updates (role ``parameter``, not
loop-carried: an inference program's weights, a training step's frozen ones), or the output of
another such op, computes the same value on every run. Runtimes fold these at load time (ONNX
Runtime's and TensorRT's constant folding; PyTorch inference code packs Q, K and V weights into
one tensor once), so a plan pays for them neither in time nor in a second copy: the folded
value *is* how the weights are stored. ``ir.rewrites.substitute_merge``'s weight concatenations
are the case that matters: merged Q/K/V projections read one stacked weight.

:func:`fold_constants` gives the graph a runtime runs after loading: the folded ops removed, their
outputs turned into parameters. The search's cost model lowers that graph (``Lowerer(runtime=True)``,
the ``Evaluator``'s); the executor, ``verify`` and the predictions of measured plans
(``Lowerer()``) take the plan as written, folded ops included (same values).
"""

from __future__ import annotations

import weakref

from ir.graph import NEXT_SUFFIX, Edit, Graph, Tensor

__all__ = ["fold_constants", "folded_ops"]


def folded_ops(g: Graph) -> tuple[str, ...]:
    """The ops of ``g`` computed from non-carried parameters only (directly or through other
    such ops, earlier in op order), in op order; never one whose output is a graph output.
    Memoised per tensor table (structural rewrites make a new one; shard moves keep it, and with
    it the answer)."""
    return _folding(g)[0]


def _folding(g: Graph) -> tuple[tuple[str, ...], dict | None]:
    """(the folded ops, the tensor table with their outputs as parameters) of ``g``'s table."""
    hit = _MEMO.get(id(g.tensors))
    if hit is not None and hit[0] is g.tensors:
        return hit[1], hit[2]
    tensors = g.tensors
    const: set[str] = set()
    out: list[str] = []
    # op order (program order almost always; where it is not, a chain folds less, never wrongly):
    # a truncated model's new tables pass here, and its topological order would cost more
    ops = () if _folds_nothing(g) else g.ops.values()
    for o in ops:
        if not o.inputs:
            continue
        for _, t in o.inputs:
            if t not in const and (tensors[t].role != "parameter" or g.is_carried(t)):
                break
        else:
            if tensors[o.output].role != "output":
                const.add(o.output)
                out.append(o.name)
    table = None
    if out:
        table = dict(tensors)
        for t in const:
            x = tensors[t]
            table[t] = Tensor(x.name, x.shape, x.dtype, "parameter")
    if len(_MEMO) > 256:
        _MEMO.clear()
    _MEMO[id(tensors)] = (tensors, tuple(out), table)  # holding the table keeps its id unique
    return tuple(out), table


_MEMO: dict[int, tuple[object, tuple[str, ...], dict | None]] = {}


def _folds_nothing(g: Graph) -> bool:
    """Whether nothing of ``g`` folds, told from the plan ``with_ops`` made it from when that plan's
    table folds nothing (the search's plans: a training step's weights are carried). The first op
    that folds reads non-carried parameters only, so only an op the edit brought or one reading a
    tensor the edit changed (or whose next value it changed: ``Graph.is_carried``) could; else
    False (look at every op). A truncated plan's edits make new tables: this saves the pass."""
    origin = g.origin() if g.origin is not None else None
    delta = g.tensor_delta
    if origin is None or g.ops_delta is None or delta is None or delta[0] is not origin.tensors:
        return False
    hit = _MEMO.get(id(origin.tensors))
    if hit is None or hit[0] is not origin.tensors or hit[1]:
        return False
    tensors, before = g.tensors, origin.tensors

    def foldable(t: str) -> bool:  # (a tensor the first folded op may read)
        x = tensors.get(t)
        return x is not None and x.role == "parameter" and not g.is_carried(t)

    for n in delta[1]:
        if foldable(n) or (n.endswith(NEXT_SUFFIX) and foldable(n[:-len(NEXT_SUFFIX)])):
            return False
        if n in before and before[n].role == "output":  # (an op it was the output of may fold now)
            return False
    replace, insert_after = g.ops_delta
    for o in [*replace.values(), *(o for extra in insert_after.values() for o in extra)]:
        if o is not None and o.inputs and (all(foldable(t) for _, t in o.inputs)
                                           or any(t not in tensors for _, t in o.inputs)):
            return False  # (a missing tensor: the pass over every op says what it says)
    return True


def fold_constants(g: Graph) -> Graph:
    """``g`` as a runtime runs it after loading its weights: the :func:`folded_ops` removed and
    their outputs parameters (read where their readers need them, like any weight). ``g`` itself
    when nothing folds (every built-in workload's program). Memoised on ``g``; plans that share a
    tensor table share the folded one, and a shard move's child keeps its lineage (``Graph.edit``)
    to its parent's folded graph, so the cost model's lowering stays incremental."""
    names, table = _folding(g)
    if not names:
        return g
    hit = g.__dict__.get("_folded")
    if hit is not None:
        return hit
    gone = set(names)
    out = Graph(table, {n: o for n, o in g.ops.items() if n not in gone})
    parent = g.origin() if g.origin is not None else None
    pf = parent.__dict__.get("_folded") if parent is not None else None
    if pf is not None:
        out.origin = weakref.ref(pf)
        if g.edit is not None and pf.tensors is table:
            out.edit = Edit(weakref.ref(pf), tuple(n for n in g.edit.replaced if n not in gone))
    g.__dict__["_folded"] = out
    return out
