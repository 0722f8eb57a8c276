"""``unshard``: the logical program behind any plan (the reference that ``verify`` runs).

Undoes every fusion, reduction split, substitution (``unfuse_attention``, ``unfuse_norm``,
``split_matmuls``, ``unreassociate``) and activation recomputation, and puts each op back to one
whole shard on device 0.
Two plans of one program have equal ``unshard`` digests.
"""

from __future__ import annotations

import weakref

from ir.graph import Graph, Shards
from ir.kernels.attention import COMBINE_KERNEL
from ir.rewrites.fusion import unfuse, unfuse_each
from ir.rewrites.recompute import SUFFIX, is_copy, recomputed, unrecompute
from ir.rewrites.reduction import merge_reduction
from ir.rewrites.substitute_attention import fused_attentions, unfuse_attention
from ir.rewrites.substitute_merge import merged_matmuls, split_matmuls
from ir.rewrites.substitute_norm import fused_norms, unfuse_norm
from ir.rewrites.substitute_reassoc import reassociated, unreassociate


def unshard(g: Graph, keep_substitutions: bool = False) -> Graph:
    """The logical program of ``g``; with ``keep_substitutions`` the substituted ops (fused attention,
    fused norms, merged matmuls) stay as they are (``training_step`` differentiates them as such).

    Recomputed copies are dropped wherever one is found beside its original (``_unrecompute``): a
    copy of a fused op before the fusions are undone (unfusing it would collide with its
    original), the others once fusions and split reductions are undone, and again after each
    substitution is undone (copies of originals renamed by a substitution made after them)."""
    g = _unrecompute(g, fused=True)
    while True:  # fusions (nested ones one level a sweep)
        fused = [n for n, o in g.ops.items() if o.kernel == "fused"]
        if not fused:
            break
        g, done = unfuse_each(g, fused)  # refused: a copy's fusion beside its original's, dropped below
        g = _unrecompute(g, fused=True)
        if not done:
            g = unfuse(g, fused[0])  # stuck: the rewrite names the problem
    # copies of accumulate ops read a partial beside their originals: dropped before the merge
    g = _unrecompute(_merge_reductions(_unrecompute(g)))
    if keep_substitutions:
        return _whole(g)
    for find, undo in ((fused_attentions, unfuse_attention), (fused_norms, unfuse_norm),
                       (merged_matmuls, split_matmuls), (reassociated, unreassociate)):
        for n in find(g):  # substitutions last: their ops may have been split or fused since
            g = undo(g, n)
        g = _unrecompute(g)
    return _whole(g)


def _unrecompute(g: Graph, fused: bool = False) -> Graph:
    """``g`` without the recomputed copies that stand beside their originals (``fused``: only
    copies of fused ops); never a split reduction's partial or its original (a partial's output
    is not the op's: reductions are merged first)."""
    ops = g.ops
    names = [n for n in recomputed(g) if not ops[n].params.get("split") and not ops[n + SUFFIX].params.get("split")
             and (not fused or ops[n].kernel == "fused")]
    return unrecompute(g, names) if names else g


#: split op -> ((its accumulate's output, its input tensors), the merged whole op): see ``_WHOLE``
_MERGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _merge_reductions(g: Graph) -> Graph:
    """Every split reduction merged (``merge_reduction`` of each, innermost first), in one pass:
    one graph copy instead of one per reduction (a sharded training step has hundreds). Merged
    ops get one whole shard (``unshard`` makes every op whole anyway)."""
    split = [n for n, o in g.ops.items() if o.params.get("split")]
    if not split:
        return g
    ops, dropped_tensors = dict(g.ops), {}
    consumers = g.__dict__.get("consumers") or _readers(g, {g.ops[n].output for n in split})
    for n in reversed(split):  # innermost first: a two-level reduction's accumulate is itself split
        o = ops[n]
        readers = consumers.get(o.output, [])
        if not readers and is_copy(ops, n):
            # a recomputed partial op whose accumulate went with a dropped copy of a fused op: unread
            del ops[n]
            dropped_tensors[o.output] = None
            continue
        if len(readers) != 1 or readers[0][0] not in ops or ops[readers[0][0]].kernel not in (
                "accumulate", COMBINE_KERNEL):
            return merge_reduction(g, n)  # malformed: the single-step rewrite raises, naming the problem
        acc = ops.pop(readers[0][0])
        key = (acc.output, tuple([g.tensors.get(t) for _, t in o.inputs]))
        hit = _MERGED.get(o)
        if hit is None or hit[0] != key:
            merged = o.replace(params={k: v for k, v in o.params.items() if k != "split"}, output=acc.output)
            hit = _MERGED[o] = (key, merged.replace(shards=Shards.whole(g.signature(merged).extents)))
        ops[n] = hit[1]
        dropped_tensors[o.output] = None
    return Graph({t: v for t, v in g.tensors.items() if t not in dropped_tensors}, ops)


def _readers(g: Graph, tensors: set[str]) -> dict[str, list[tuple[str, str]]]:
    """``g.consumers`` of ``tensors`` alone (the whole map costs a list per tensor of the graph)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for o in g.ops.values():
        for port, t in o.inputs:
            if t in tensors:
                out.setdefault(t, []).append((o.name, port))
    return out


#: op -> (its input tensors, its one-whole-shard version or None where it is one already): the plans
#: of a search share their ops, and the same whole op keeps its canonical text from call to call
_WHOLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _whole(g: Graph) -> Graph:
    ops = {}
    memo, tensors = _WHOLE, g.tensors
    for n, o in g.ops.items():
        ts = tuple([tensors.get(t) for _, t in o.inputs])
        hit = memo.get(o)
        if hit is None or hit[0] != ts:
            ext = g.signature(o).extents
            sh = o.shards
            if sh is not None and len(sh) == 1 and not sh.lo.any() and tuple(sh.hi[0].tolist()) == tuple(ext) \
                    and sh.device[0] == 0:
                hit = (ts, None)  # already one whole shard on device 0
            else:
                hit = (ts, o.replace(shards=Shards.whole(ext)))
            memo[o] = hit
        if hit[1] is not None:
            ops[n] = hit[1]
    return g.with_ops(ops) if ops else g
