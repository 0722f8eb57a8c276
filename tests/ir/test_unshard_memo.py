"""``unshard``'s memos: the ops it makes are remembered per (shared) source op and reused only where
the tensors they read are the same (a search's plans share ops; their unsharded programs share
the ops made from them, with their cached text)."""

from __future__ import annotations

from ir.builder import GraphBuilder
from ir.graph import Graph
from ir.rewrites import fuse, place, unshard


def block(batch: int) -> Graph:
    b = GraphBuilder()
    y = b.matmul(b.input("x", (batch, 4)), b.parameter("W", (4, 6)), name="mm")
    b.relu(b.relu(y, name="act"), name="neg", out="y")
    return fuse(b.build(outputs=["y"]), "mm", "act")


def test_plans_sharing_a_fused_op_share_its_unfused_ops():
    g = place(block(8), "neg", [1])
    h = place(g, "neg", [0])  # a shard move elsewhere: the fused op is the same object
    fused = next(n for n, o in g.ops.items() if o.kernel == "fused")
    assert h.ops[fused] is g.ops[fused]
    a, b = unshard(g), unshard(h)
    assert a.digest == b.digest
    assert a.ops["mm"] is b.ops["mm"] and a.ops["act"] is b.ops["act"]


def test_the_same_op_over_other_tensors_is_unsharded_afresh():
    small, big = block(8), block(16)
    mixed = Graph(big.tensors, small.ops)  # the batch-8 plan's op objects reading batch-16 tensors
    unshard(small)  # (memos made for the batch-8 tensors)
    u = unshard(mixed)
    assert u.digest == unshard(big).digest
    assert u.ops["mm"].shards.hi.tolist()[0][0] == 16 and u.ops["neg"].shards.hi.tolist()[0][0] == 16
