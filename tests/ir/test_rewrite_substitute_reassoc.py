"""reassociate / unreassociate: ``(A·B)·R`` as ``A·(B·R)`` (or ``(A·R)·B``), and back."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel import evaluate
from executor import verify
from ir.builder import GraphBuilder
from ir.rewrites import RewriteError, parse_move, place, random_rewrite, reassociate, split, unreassociate, unshard
from ir.rewrites.substitute_reassoc import reassociation_flops, reassociation_sites
from ir.serialize import dumps, loads
from ir.validate import validate


def chain(n: int, d: int, r: int, kind: str = "einsum", batch: int = 0):
    """x[n, d] · Wd[d, r] · Wu[r, d] (a low-rank adapter when r < d), as einsums or matmuls."""
    b = GraphBuilder()
    if batch:
        x = b.input("x", (batch, n, d))
        h = b.einsum(x, b.parameter("Wd", (d, r)), name="down", equation="bnd,dr->bnr", alpha=0.5)
        b.einsum(h, b.parameter("Wu", (batch, r, d)), name="up", equation="bnr,bre->bne")
    elif kind == "matmul":
        h = b.matmul(b.input("x", (n, d)), b.parameter("Wd", (d, r)), name="down")
        b.matmul(h, b.parameter("Wu", (r, d)), name="up", alpha=2.0)
    else:
        h = b.einsum(b.input("x", (n, d)), b.parameter("Wd", (d, r)), name="down", equation="nd,dr->nr")
        b.einsum(b.parameter("Wu", (r, d)), h, name="up", equation="re,nr->ne")  # the chain on port b
    return b.build()


def assert_equivalent(h, g):
    issues = validate(h)
    assert issues == [], "\n".join(map(str, issues))
    rep = verify(h, reference=g)
    assert rep.ok, str(rep)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), d=st.integers(1, 9), r=st.integers(1, 9), kind=st.sampled_from(["einsum", "matmul"]),
       batch=st.sampled_from([0, 0, 2]), keep=st.sampled_from(["a", "b"]), seed=st.integers(0, 2**32 - 1))
def test_both_orders_compute_the_same(n, d, r, kind, batch, keep, seed):
    g = chain(n, d, r, kind, batch)
    h = reassociate(g, "up", keep)
    assert "down" not in h.ops and "down.out" not in h.tensors and h.ops["up"].output == "up.out"
    assert_equivalent(h, g)
    assert unreassociate(h, "up").digest == g.digest
    assert unshard(h).digest == g.digest
    assert loads(dumps(h)).digest == h.digest
    rng = np.random.default_rng(seed)
    dims = h.signature("up").dims
    dim = dims[int(rng.integers(len(dims)))]
    if h.signature("up").extents[dims.index(dim)] >= 2:
        assert_equivalent(place(split(h, "up", dim, 2), "up", [0, 1]), g)


def test_the_cheaper_order_is_proposed_and_the_cost_model_agrees():
    g = chain(1024, 8, 1024)  # (x·Wd)·Wu: 2·1024·8·1024 twice; x·(Wd·Wu) contracts the 1024s once
    before, after = reassociation_flops(g, "up", "a")
    assert before == 2 * (2 * 1024 * 8 * 1024) and after == 2 * 8 * 1024 * 8 + 2 * 1024 * 8 * 8
    assert reassociation_sites(g) == [("up", "a")]
    assert reassociation_sites(chain(8, 1024, 8)) == []  # a low-rank adapter is cheaper as written
    h = reassociate(g, "up")
    a, b = evaluate(g, "h100-sxm-8"), evaluate(h, "h100-sxm-8")
    ops = {o["op"]: o for o in b.breakdown().ops}
    sig = h.signature("down.re")  # Wd·Wu: weights only, so computed once at load time (ir.folding)
    assert "down.re" not in ops and ops["up"]["flops"] + np.prod(sig.extents) * sig.flops_per_point == after
    assert b.makespan < a.makespan


def test_refusals_and_moves():
    g = chain(4, 3, 2)
    with pytest.raises(RewriteError, match="neither operand of down"):
        reassociate(g, "down")
    with pytest.raises(RewriteError, match="not a reassociated einsum"):
        unreassociate(g, "up")
    b = GraphBuilder()
    h = b.einsum(b.input("x", (4, 3)), b.parameter("A", (3, 2)), name="p", equation="nd,dr->nr")
    b.einsum(h, b.parameter("B", (2, 5)), name="q", equation="nr,re->ne")
    b.relu(h, name="peek")
    with pytest.raises(RewriteError, match="must be private"):
        reassociate(b.build(), "q")
    m = parse_move("reassociate{op=up,keep=b}")
    assert str(m) == "reassociate{op=up,keep=b}"
    assert_equivalent(m.apply(g), g)
    assert parse_move("unreassociate{op=up}").apply(m.apply(g)).digest == g.digest
    g2 = chain(1024, 8, 1024)
    h2, move = random_rewrite(g2, np.random.default_rng(0), 2, weights={"reassociate": 1.0})
    assert str(move) == "reassociate{op=up,keep=a}" and "up" in h2.ops
    with pytest.raises(RewriteError, match="already|not a plain"):
        reassociate(h2, "up")
