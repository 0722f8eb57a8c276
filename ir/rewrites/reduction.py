"""Splitting a hidden reduction into blocks: a partial op plus an ``accumulate`` op.

``split_reduction(g, "fc2", 4)`` on ``fc2 = linear(h, W2, b2)`` (reduction ``f``)::

    fc2: y[n, o] = Σ_f h[n, f] W2[f, o] + b2[o]
 -> fc2:     p[kb, n, o] = Σ_{f in block kb} h[n, f] W2[f, o] (+ b2 in block 0)   -> fc2.partial
    fc2.acc: y[n, o] = Σ_kb p[kb, n, o]

The partial op keeps its shards (each now covering every block); the accumulate op gets their
output boxes (the same boxes where the output projection is the identity; a strided conv's input
gradient writes blocks of stride rows per index point) and devices. ``merge_reduction`` is the
inverse.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ir.graph import Graph, Op, Shards, Tensor
from ir.kernels import cached_signature
from ir.kernels.attention import COMBINE_KERNEL, SOFTMAX_MONOID
from ir.rewrites.errors import RewriteError
from ir.zspace import Projection, ZRange, identity_projection, partition_problem, project_boxes
from ir.rewrites.shard import get_op


def partial_name(op: str) -> str:
    return f"{op}.partial"


def acc_name(op: str) -> str:
    return f"{op}.acc"


def split_reduction(g: Graph, op: str, parts: int, reduction: str | None = None) -> Graph:
    """Split ``op``'s hidden reduction (default: its first) into ``parts`` equal blocks."""
    o = get_op(g, op)
    if o.kernel == "fused":
        raise RewriteError(f"{op}: a fused op's reduction cannot be split (unfuse it first)")
    if o.params.get("split"):
        raise RewriteError(f"{op}: its reduction is already split into {o.params['split']['parts']} blocks")
    sig = g.signature(o)
    if not sig.reductions:
        raise RewriteError(f"{op}: kernel {o.kernel} has no splittable reduction")
    red = sig.reductions[0] if reduction is None else next((r for r in sig.reductions if r.name == reduction), None)
    if red is None:
        raise RewriteError(f"{op}: no reduction {reduction!r}; splittable: {[r.name for r in sig.reductions]}")
    if not isinstance(parts, (int, np.integer)) or parts < 2 or red.extent % parts:
        raise RewriteError(f"{op}: reduction {red.name!r} of extent {red.extent} does not split into "
                           f"{parts} equal blocks")
    if acc_name(op) in g.ops or partial_name(op) in g.tensors:
        raise RewriteError(f"{op}: names {acc_name(op)!r}/{partial_name(op)!r} are taken")
    out = g.tensors[o.output]
    params = {**o.params, "split": {"reduction": red.name, "parts": int(parts)}}
    sh = o.shards
    n = len(sh)
    lo = np.concatenate([np.zeros((n, 1), np.int64), sh.lo], axis=1)
    hi = np.concatenate([np.full((n, 1), parts, np.int64), sh.hi], axis=1)
    new_op = o.replace(params=params, output=partial_name(op), shards=Shards(lo, hi, sh.device))
    # The partial's shape comes from the kernel: ``(parts,) + out.shape`` for sum and max, one more
    # channel (the log-sum-exp) for attention's softmax monoid. (``g.signature`` memoises on the
    # new op, which its readers ask for next.)
    part_spec = g.signature(new_op).out_spec
    partial = Tensor(partial_name(op), part_spec.shape, out.dtype, "intermediate")
    kernel, acc_params = ((COMBINE_KERNEL, {}) if red.monoid == SOFTMAX_MONOID
                          else ("accumulate", {"monoid": red.monoid}))
    acc = Op(acc_name(op), kernel, (("p", partial.name),), o.output, acc_params)
    acc_rank = len(cached_signature(kernel, acc.params_key, (("p", part_spec),)).dims)
    if acc_rank == sh.ndim and _is_identity(sig.output):
        acc_shards = Shards(sh.lo, sh.hi, sh.device)
    else:  # the accumulate tiles the op's output boxes (attention's gradients keep a dim whole)
        out_lo, out_hi = project_boxes(sig.output, sh.lo, sh.hi)
        acc_shards = Shards(out_lo[:, :acc_rank], out_hi[:, :acc_rank], sh.device)
    return g.with_ops({op: new_op}, insert_after={op: [acc.replace(shards=acc_shards)]},
                      tensors={partial.name: partial})


def merge_reduction(g: Graph, op: str) -> Graph:
    """Undo ``split_reduction``: one op over the whole reduction again, sharded like its accumulate."""
    o = get_op(g, op)
    if not o.params.get("split"):
        raise RewriteError(f"{op}: its reduction is not split")
    readers = g.consumers.get(o.output, [])
    if len(readers) != 1 or g.ops[readers[0][0]].kernel not in ("accumulate", COMBINE_KERNEL):
        raise RewriteError(f"{op}: its partials are not read by exactly one accumulate op")
    acc = g.ops[readers[0][0]]
    if acc.params.get("split"):  # a two-level reduction: its output is the accumulate's partials
        raise RewriteError(f"{op}: its accumulate {acc.name} is itself split (merge_reduction {acc.name} first)")
    merged = o.replace(params={k: v for k, v in o.params.items() if k != "split"})
    n_op = o.shards.ndim - 1  # the index dims without the block dim
    shards = acc.shards
    out = g.signature(merged).output
    if shards.ndim == n_op and not _is_identity(out):  # output boxes back to index boxes, where they are blocks
        shards = _index_shards(out, acc.shards, ZRange.of_shape(o.shards.hi.max(axis=0)[1:]))
    elif shards.ndim != n_op:  # the accumulate tiles the output, which keeps more dims than the op's index
        _, idx = np.unique(acc.shards.lo[:, :n_op], axis=0, return_index=True)
        idx = np.sort(idx)  # first shard of each box, in the accumulate's order
        lo, hi = acc.shards.lo[idx, :n_op], acc.shards.hi[idx, :n_op]
        whole = ZRange.of_shape(o.shards.hi.max(axis=0)[1:])
        shards = (Shards(lo, hi, acc.shards.device[idx]) if partition_problem((lo, hi), whole) is None
                  else Shards.whole(whole.shape, int(acc.shards.device[0])))
    new_op = merged.replace(output=acc.output, shards=shards)
    return g.with_ops({op: new_op, acc.name: None}, tensors={o.output: None})


def _is_identity(p: Projection) -> bool:
    n = len(p.A)
    return all(len(row) == n for row in p.A) and p == _identity(n)


@lru_cache(maxsize=16)
def _identity(rank: int) -> Projection:
    return identity_projection(rank)  # built once per rank: every split and merge compares with it


def _index_shards(out: Projection, acc: Shards, whole: ZRange) -> Shards:
    """The index boxes whose images under ``out`` are ``acc``'s boxes, where ``out`` maps index dim
    ``d`` to blocks ``[a·i, a·i + a)`` of tensor dim ``d`` and the boxes are whole blocks; one
    whole shard on the first accumulate device otherwise."""
    n = len(out.A)
    blocked = (all(len(row) == n for row in out.A) and not any(out.b)
               and all(out.A[r][c] == (out.s[r] if r == c else 0) for r in range(n) for c in range(n)))
    if blocked:
        a = np.array(out.s, dtype=np.int64)
        if not (acc.lo % a).any() and not (acc.hi % a).any():
            lo, hi = acc.lo // a, acc.hi // a
            if partition_problem((lo, hi), whole) is None:
                return Shards(lo, hi, acc.device)
    return Shards.whole(whole.shape, int(acc.device[0]))
