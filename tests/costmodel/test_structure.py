"""The lowering structure (``costmodel.structure``) against a reference written here, op by op."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.structure import build_structure
from ir import workloads
from ir.builder import GraphBuilder
from ir.graph import SOURCE_ROLES, Graph
from ir.kernels import ITEMSIZE
from ir.rewrites import RewriteError, random_rewrite


def reference(g: Graph) -> dict:
    """The structure by its definition (``costmodel.structure`` docstring), one read at a time."""
    order = g.topo_order
    ops = [g.ops[n] for n in order]
    readers: dict[str, list] = {}
    for i, o in enumerate(ops):
        for port, t in o.inputs:
            readers.setdefault(t, []).append((i, port))
    outputs = {o.output for o in ops}
    state_of = {nxt: p for p, nxt in g.carried.items()}
    groups, homes = [], []
    for i, o in enumerate(ops):
        if readers.get(o.output):
            groups.append((i, o.output, tuple(readers[o.output]), 0))
    for i, o in enumerate(ops):
        p = state_of.get(o.output)
        if p is not None:
            homes.append((p, i))
            if p in readers:
                groups.append((i, p, tuple(readers[p]), 1))
    sources = [(t, tuple(rd), -1) for t, rd in readers.items()
               if t not in outputs and t not in g.carried and g.tensors[t].role in SOURCE_ROLES]
    sources += [(p, (), i) for p, i in homes]
    op_groups = [sorted({gi for gi, (p, _t, rd, _s) in enumerate(groups) if p == i or any(r == i for r, _ in rd)})
                 for i in range(len(ops))]
    op_sources = [sorted({si for si, (_t, rd, h) in enumerate(sources) if h == i or any(r == i for r, _ in rd)})
                  for i in range(len(ops))]
    return {"order": order, "groups": groups, "sources": sources, "op_groups": op_groups,
            "op_sources": op_sources, "inplace": [int(any(h == i for _, h in homes)) for i in range(len(ops))],
            "acc": [o.kernel == "accumulate" for o in ops], "split": ["split" in o.params for o in ops],
            "item": [float(ITEMSIZE[g.tensors[t].dtype]) for _, t, _, _ in groups]}


def assert_matches(g: Graph) -> None:
    st, ref = build_structure(g, 1), reference(g)
    assert st.order == ref["order"] and st.keys == tuple(g.ops)
    assert [(*st.groups[gi], int(st.g_state[gi])) for gi in range(len(st.groups))] == ref["groups"]
    assert [(*st.sources[si], int(st.source_home[si])) for si in range(len(st.sources))] == ref["sources"]
    assert [st.op_groups(i) for i in range(len(st.order))] == ref["op_groups"]
    assert [st.op_sources(i) for i in range(len(st.order))] == ref["op_sources"]
    assert st.op_inplace.tolist() == ref["inplace"] and st.op_acc.tolist() == ref["acc"]
    assert st.op_split.tolist() == ref["split"]
    assert st.g_item.tolist() == ref["item"]
    for gi in range(len(st.groups)):  # the per-op lookups agree with the groups
        kind = st.group_of_home if st.g_state[gi] else st.group_of_producer
        assert kind[st.g_prod[gi]] == gi


@pytest.mark.parametrize("name,kw", [
    ("gpt", dict(mode="train", batch=4, seq=8, layers=2, d_model=16, heads=2, vocab=32)),
    ("llama", dict(mode="train", batch=2, seq=8, layers=2, d_model=16, heads=4, kv_heads=2, d_ff=32, vocab=32,
                   optimizer="sgd")),
    ("transformer", dict(batch=2, seq=8, d_model=16, heads=2, d_ff=32)),
    ("mlp", dict(mode="train", batch=8, widths=[8, 16, 8])),
])
def test_structure_matches_the_reference_over_structural_walks(name, kw):
    rng = np.random.default_rng(11)
    g0 = workloads.build(name, **kw)
    g = g0
    for _ in range(40):
        assert_matches(g)
        try:
            g, _m = random_rewrite(g, rng, 8, max_shards_per_op=8)
        except RewriteError:
            g = g0


def test_an_op_order_that_is_not_topological_is_repaired():
    b = GraphBuilder()
    x = b.input("x", (4, 4))
    y = b.relu(x, name="r1")
    b.add(y, y, name="twice")
    g = b.build()
    flipped = Graph(g.tensors, {"twice": g.ops["twice"], "r1": g.ops["r1"]})
    st = build_structure(flipped, 1)
    assert st.keys == ("twice", "r1") and st.order == ("r1", "twice")
    prod, tensor, readers = st.groups[0]
    assert (prod, tensor) == (0, y) and [r for r, _ in readers] == [1, 1]  # read twice, listed twice
    assert_matches(flipped)


def test_a_state_read_without_a_reader_still_has_its_home():
    g = workloads.build("mlp", mode="train", batch=4, widths=[4, 4], optimizer="sgd")
    st = build_structure(g, 1)
    homes = [st.sources[si][0] for si in range(len(st.sources)) if st.source_home[si] >= 0]
    assert sorted(homes) == sorted(g.carried)
    assert_matches(g)


def test_building_a_structure_leaves_the_graphs_program_order_as_the_graph_finds_it():
    g = workloads.build("transformer", batch=2, seq=8, d_model=16, heads=2, d_ff=32)
    fresh = Graph(g.tensors, dict(g.ops))
    build_structure(fresh, 1)
    assert "topo_order" in fresh.__dict__ and fresh.topo_order == Graph(g.tensors, dict(g.ops)).topo_order


FIELDS = ("g_prod", "g_tensor", "g_state", "g_item", "g_rptr", "g_rop", "g_rport", "s_tensor", "s_home", "s_rptr",
          "s_rop", "s_rport", "op_inplace", "op_acc", "op_reads", "op_out", "op_split")


@pytest.mark.parametrize("name,kw", [
    ("gpt", dict(mode="train", batch=4, seq=8, layers=2, d_model=16, heads=2, vocab=32)),
    ("llama", dict(mode="train", batch=2, seq=8, layers=2, d_model=16, heads=4, kv_heads=2, d_ff=32, vocab=32)),
    ("mlp", dict(mode="train", batch=8, widths=[8, 16, 8], optimizer="sgd")),
])
def test_a_childs_structure_derived_from_its_parents_equals_the_one_built_whole(name, kw):
    from costmodel.structure import derive_structure

    rng = np.random.default_rng(8)
    g0 = workloads.build(name, **kw)
    g, derived = g0, 0
    for step in range(150):
        try:
            child, _m = random_rewrite(g, rng, 8, max_shards_per_op=8)
        except RewriteError:
            g = g0
            continue
        if step % 10 == 0:  # back to the start now and then
            g = g0
            continue
        P = build_structure(g, 1)
        p_ops = [g.ops[n] for n in P.order]
        out = derive_structure(child, P, p_ops, {id(o): i for i, o in enumerate(p_ops)}, g.tensors, 1)
        if out is not None:
            st, c2p, gmap = out
            ref = build_structure(child, 1)
            assert st.keys == ref.keys and st.order == ref.order and st.order is st.keys
            for f in FIELDS:
                a, b = getattr(st, f), getattr(ref, f)
                assert a.dtype == b.dtype and a.tolist() == b.tolist(), f
            ops = list(child.ops.values())
            assert all(j < 0 or ops[i] is p_ops[j] for i, j in enumerate(c2p.tolist()))
            for gi, j in enumerate(gmap.tolist()):  # a kept group: the same tensor, kind and readers
                if j >= 0:
                    assert P.g_tensor[j] == st.g_tensor[gi] and P.g_state[j] == st.g_state[gi]
                    assert c2p[st.groups[gi][0]] == P.groups[j][0]
                    assert [(c2p[r], p) for r, p in st.groups[gi][2]] == list(P.groups[j][2])
            derived += 1
        g = child if rng.random() < 0.7 else g
    assert derived >= 60
