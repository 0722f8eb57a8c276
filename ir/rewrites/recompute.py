"""Activation recomputation: the backward re-runs forward ops instead of keeping their outputs.

``recompute(g, ["l3.ff1", "l3.ff_act"])`` on a training step copies each listed forward op ``X``
to ``X.re`` (same kernel, params and shards) writing ``T.re`` for its output ``T``, and makes every
*backward* reader of ``T`` read ``T.re``; a copied op reads the copies of the other listed ops'
outputs, so a block is recomputed from its inputs (the checkpoint)::

    l3.ff1 -> l3.ff1.out -> l3.ff_act -> ... -> loss -> ... -> l3.ff_act.dx(reads l3.ff1.out)
 -> l3.ff1 -> l3.ff1.out -> l3.ff_act -> ...         l3.ff1.re -> l3.ff1.out.re -> l3.ff_act.dx

The forward output then dies at its last forward reader, and the copy is made late (the
simulator's upward-rank priority schedules it just before its reader), trading FLOPs for memory.
Backward ops are those that depend on the loss gradient (the ``*_loss_grad`` kernels' outputs).
``unrecompute`` is the inverse; ``unshard`` applies it, so the program behind a plan is unchanged.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Mapping

from ir.graph import Graph, Tensor
from ir.layers import layer_of
from ir.rewrites.errors import RewriteError
from ir.rewrites.shard import get_op

LOSS_GRAD_KERNELS = ("mse_loss_grad", "cross_entropy_grad")
SUFFIX = ".re"


def backward_ops(g: Graph) -> set[str]:
    """Ops that depend on the loss gradient, and ops that only they read (e.g. layernorm's x̂ for
    the gamma gradient); empty for a forward-only program."""
    seeds = {o.output for o in g.ops.values() if o.kernel in LOSS_GRAD_KERNELS}
    out: set[str] = set()
    live = set(seeds)
    for n in g.topo_order:
        o = g.ops[n]
        if o.output in seeds or any(t in live for _, t in o.inputs):
            out.add(n)
            live.add(o.output)
    if not out:
        return out
    for n in reversed(g.topo_order):
        readers = [r for r, _ in g.consumers.get(g.ops[n].output, [])]
        if n not in out and readers and all(r in out for r in readers):
            out.add(n)
    return out


def recompute(g: Graph, ops: Iterable[str], layer: int | None = None) -> Graph:
    """Recompute forward ops ``ops`` in the backward (see the module docstring). ``layer``: only
    backward ops of that layer (``ir.layers.layer_of``) read the copies; the others keep reading
    the originals (a layer's output is the next layer's checkpoint, kept for its recomputation)."""
    names = list(dict.fromkeys(ops))
    bwd = backward_ops(g)
    if layer is not None:
        bwd = {n for n in bwd if layer_of(n) == layer}
    if not bwd:
        raise RewriteError("recompute needs a training step (no op reads a loss gradient)")
    for n in names:
        o = get_op(g, n)
        if n in bwd:
            raise RewriteError(f"{n}: a backward op; only forward ops are recomputed")
        if n.endswith(SUFFIX) or n + SUFFIX in g.ops:
            raise RewriteError(f"{n}: already recomputed")
        if o.output + SUFFIX in g.tensors:
            raise RewriteError(f"{n}: tensor name {o.output + SUFFIX!r} is taken")
    chosen = set(names)
    order = [n for n in g.topo_order if n in chosen]
    copy = {g.ops[n].output: g.ops[n].output + SUFFIX for n in order}
    # A copy is needed if a backward op reads its output, or a needed copy does (checked in reverse).
    needed: set[str] = set()
    for n in reversed(order):
        t = g.ops[n].output
        readers = [r for r, _ in g.consumers.get(t, [])]
        if any(r in bwd for r in readers) or any(r in needed for r in readers if r in chosen):
            needed.add(n)
    if not needed:
        raise RewriteError(f"no backward op reads the outputs of {names}; nothing to recompute")
    replace, tensors, copies = {}, {}, []
    for n in order:
        if n not in needed:
            continue
        o = g.ops[n]
        ins = tuple((p, copy[t] if t in copy and g.producers[t] in needed else t) for p, t in o.inputs)
        t = g.tensors[o.output]
        tensors[copy[o.output]] = Tensor(copy[o.output], t.shape, t.dtype, "intermediate")
        copies.append(o.replace(name=n + SUFFIX, output=copy[o.output], inputs=ins))
    # In program order the copies go just before the first backward op that reads one of them, so
    # a runtime (and the simulator's bounded lookahead) recomputes when the backward gets there.
    names_in_order = list(g.ops)
    readers = {r for n in needed for r, _ in g.consumers.get(g.ops[n].output, []) if r in bwd}
    first = min(names_in_order.index(r) for r in readers)
    insert = {names_in_order[first - 1]: copies}
    for r in bwd:
        o = g.ops[r]
        ins = tuple((p, copy[t] if t in copy and g.producers[t] in needed else t) for p, t in o.inputs)
        if ins != o.inputs:
            replace[r] = o.replace(inputs=ins)
    return g.with_ops(replace, insert_after=insert, tensors=tensors)


def recompute_block(g: Graph, prefix: str) -> Graph:
    """Recompute every forward op whose name starts with ``prefix`` (``"l3."``: layer 3); in a
    layer, only for that layer's backward (its output, the next layer's input, is kept whole)."""
    bwd = backward_ops(g)
    ops = [n for n in g.topo_order if n.startswith(prefix) and n not in bwd and not n.endswith(SUFFIX)]
    if not ops:
        raise RewriteError(f"no forward op name starts with {prefix!r}")
    return recompute(g, ops, layer_of(prefix + "x"))


def recomputed(g: Graph) -> list[str]:
    """The original ops that have a recomputed copy."""
    return [n[: -len(SUFFIX)] for n in g.ops if is_copy(g.ops, n)]


def is_copy(ops: Mapping[str, object], name: str) -> bool:
    """Whether op ``name`` is the recomputed copy of an op in ``ops`` (``recompute``)."""
    return name.endswith(SUFFIX) and name[: -len(SUFFIX)] in ops


def with_copies(g: Graph, ops: Iterable[str]) -> list[str]:
    """Those of ``ops`` that are recomputed copies or have one: a substitution over them, or an undo
    of one, would leave the copies reading names it removes (``unshard`` could not undo it)."""
    return [n for n in ops if n + SUFFIX in g.ops or is_copy(g.ops, n)]


def unrecompute(g: Graph, ops: Iterable[str] | None = None) -> Graph:
    """Drop the copies of ``ops`` (default: all) and let their readers read the originals again."""
    names = recomputed(g) if ops is None else list(ops)
    back: dict[str, str] = {}
    drop: dict[str, None] = {}
    for n in names:
        if n + SUFFIX not in g.ops:
            raise RewriteError(f"{n}: not recomputed")
        if g.ops[n + SUFFIX].params.get("split") and not g.ops[n].params.get("split"):
            raise RewriteError(f"{n}: its copy's reduction is split (it writes partials, not {n}'s output); "
                               f"merge_reduction{{op={n}{SUFFIX}}} first")
        back[g.ops[n + SUFFIX].output] = g.ops[n].output
        drop[n + SUFFIX] = None
    replace = dict(drop)
    for n, o in g.ops.items():
        if n in drop:
            continue
        ins = tuple((p, back.get(t, t)) for p, t in o.inputs)
        if ins != o.inputs:
            hit = _REREAD.get(o)
            if hit is None or hit[0] != ins:
                hit = _REREAD[o] = (ins, o.replace(inputs=ins))
            replace[n] = hit[1]
    return g.with_ops(replace, tensors={t: None for t in back})


#: op -> (new inputs, the op reading them): ``unshard`` drops the copies of the (shared) ops of every
#: plan of a search, and the same rewired readers keep their memos (signatures, canonical text)
_REREAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
