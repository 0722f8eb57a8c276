"""``align``: give an op the same shards as another op with the same index extents.

``align(g, "act1", like="fc1")`` makes act1's shards (boxes and devices) equal fc1's, so an
elementwise consumer reads its producer's output where it was written: no transfers.
"""

from __future__ import annotations

from ir.graph import Graph
from ir.rewrites.errors import RewriteError
from ir.rewrites.shard import get_op


def align(g: Graph, op: str, like: str) -> Graph:
    o, ref = get_op(g, op), get_op(g, like)
    a, b = g.signature(o), g.signature(ref)
    if a.extents != b.extents:
        raise RewriteError(f"cannot align {op} with {like}: index spaces {list(a.extents)} and "
                           f"{list(b.extents)} differ")
    if o.shards == ref.shards:
        raise RewriteError(f"{op} already has the shards of {like}")
    return g.with_ops({op: o.replace(shards=ref.shards)})
