"""``ir.rewrites.pipeline.batch_flow_update``: the batch's flow of a child, from its parent's,
equals the flow computed whole."""

from __future__ import annotations

import numpy as np
import pytest

from ir import workloads
from ir.builder import GraphBuilder
from ir.graph import Graph
from ir.rewrites import RewriteError, random_rewrite
from ir.rewrites.pipeline import batch_dims, batch_flow, batch_flow_update


def readers_in(g: Graph):
    order = g.topo_order
    pos = {n: i for i, n in enumerate(order)}
    cons = g.consumers
    return order, lambda i: [pos[r] for r, _ in cons.get(g.ops[order[i]].output, [])]


def same_flow(a, b, g: Graph) -> bool:
    return a[0] == b[0] and {t: r for t, r in a[1].items() if t in g.tensors} == \
        {t: r for t, r in b[1].items() if t in g.tensors}


@pytest.mark.parametrize("name,kw", [
    ("gpt", dict(mode="train", batch=4, seq=8, layers=2, d_model=16, heads=2, vocab=32)),
    ("llama", dict(mode="train", batch=2, seq=8, layers=2, d_model=16, heads=4, kv_heads=2, d_ff=32, vocab=32)),
    ("mlp", dict(mode="train", batch=8, widths=[8, 16, 8])),
])
def test_the_update_equals_the_whole_flow_over_random_walks(name, kw):
    rng = np.random.default_rng(5)
    g0 = workloads.build(name, **kw)
    g, updated = g0, 0
    for _ in range(60):
        try:
            child, _m = random_rewrite(g, rng, 8, max_shards_per_op=8)
        except RewriteError:
            g = g0
            continue
        order, readers = readers_in(child)
        up = batch_flow_update(child, g, batch_flow(g), order, readers)
        whole = batch_flow(child)
        # rewrites change no source: always an update, structural moves (new and removed
        # tensors) included
        assert up is not None and same_flow(up, whole, child)
        assert whole[0] == batch_dims(child)
        updated += child.tensors is not g.tensors
        g = child if rng.random() < 0.7 else g
    assert updated >= 5


def test_a_split_reduction_over_the_batch_changes_its_readers_rows():
    """A changed op whose output rows change is followed into its (kept) readers."""
    from ir.rewrites import split_reduction

    g = workloads.build("mlp", mode="train", batch=8, widths=[8, 16, 8])
    grads = [n for n in g.ops if n.endswith(".dW")]  # reductions over the batch
    checked = 0
    for n in grads:
        try:
            child = split_reduction(g, n, 2)
        except RewriteError:
            continue
        order, readers = readers_in(child)
        up = batch_flow_update(child, g, batch_flow(g), order, readers)
        assert up is not None and same_flow(up, batch_flow(child), child)
        assert up[0][n] == ("dim", 0) and batch_flow(g)[0][n][0] == "red"  # the batch moved into a dim
        checked += 1
    assert checked >= 1


def test_a_changed_source_falls_back_to_the_whole_flow():
    b = GraphBuilder()
    y = b.relu(b.input("x", (4, 4)), name="r")
    b.relu(y, name="s")
    g = b.build()
    tensors = dict(g.tensors)
    tensors["x"] = tensors["x"].__class__(**{**tensors["x"].__dict__, "shape": (4, 4)})
    other = Graph(tensors, dict(g.ops))
    order, readers = readers_in(other)
    assert batch_flow_update(other, g, batch_flow(g), order, readers) is None
