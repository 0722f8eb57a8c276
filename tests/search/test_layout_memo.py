"""The layout's memo of per-op decisions (``ir.rewrites.layout._DECISIONS``) and microbatching's
vectorised shard cuts give what the plain computations give, and the memo stays bounded."""

from __future__ import annotations

import numpy as np
import pytest

from ir import workloads
from ir.graph import Shards
from ir.mesh import parse_mesh
from ir.rewrites import layout as L
from ir.rewrites import pipeline as P
from ir.rewrites import RewriteError

PROGRAM = workloads.build("llama", mode="train", batch=4, seq=8, layers=2, d_model=16, heads=4, vocab=32,
                          d_ff=32)
LAYOUTS = [("all", "2x2", "b.t"), ("all", "4", "t"), ("all", "2x2", "s.b"), ("l0.*", "2x4", "t.b"),
           ("all", "2x2x2", "b.s.t")]


def _walk(g):
    """Each layout applied on top of the previous one: digests of the plans."""
    out = []
    for region, mesh, use in LAYOUTS:
        try:
            g = L.layout(g, region, parse_mesh(mesh, 4), use.split("."))
        except RewriteError as e:
            out.append(str(e))
            continue
        out.append(g.digest)
    return out


def test_memoised_layouts_equal_fresh_ones():
    L._DECISIONS.clear()
    fresh = _walk(PROGRAM)
    assert L._DECISIONS
    assert _walk(PROGRAM) == fresh  # now every decision is a hit


def test_every_memoised_decision_is_what_the_op_decides_afresh():
    L._DECISIONS.clear()
    _walk(PROGRAM)
    for (_, kernel, inputs, mesh, use), (sig, d) in L._DECISIONS.items():
        again = L._Decision(sig, mesh, L._assign(sig, kernel, inputs, mesh, use))
        assert (again.dims, again.red, again.out) == (d.dims, d.red, d.out)
        assert (again.shards is None) == (d.shards is None)
        if d.shards is not None:
            assert again.shards == d.shards


def test_the_memo_is_bounded(monkeypatch):
    L._DECISIONS.clear()
    monkeypatch.setattr(L, "_DECISIONS_MAX", 8)
    got = _walk(PROGRAM)
    assert 0 < len(L._DECISIONS) <= 8
    L._DECISIONS.clear()
    monkeypatch.undo()
    assert _walk(PROGRAM) == got  # dropping entries changes no result


def _cut_reference(sh: Shards, col: int, bounds: np.ndarray) -> tuple[list, list, list]:
    """Each shard cut at the bounds strictly inside it along ``col``, shard by shard."""
    lo_rows, hi_rows, devs = [], [], []
    for i in range(len(sh)):
        a, z = int(sh.lo[i, col]), int(sh.hi[i, col])
        cuts = [a] + [int(x) for x in bounds if a < x < z] + [z]
        for u, v in zip(cuts[:-1], cuts[1:]):
            lo, hi = sh.lo[i].copy(), sh.hi[i].copy()
            lo[col], hi[col] = u, v
            lo_rows.append(lo.tolist())
            hi_rows.append(hi.tolist())
            devs.append(int(sh.device[i]))
    return lo_rows, hi_rows, devs


@pytest.mark.parametrize("seed", range(20))
def test_cut_at_matches_cutting_shard_by_shard(seed):
    rng = np.random.default_rng(seed)
    g = workloads.build("mlp", batch=int(rng.integers(4, 40)), widths=[8, 16, 8])
    ext = g.signature("fc1").extents[0]
    parts = int(rng.integers(1, min(ext, 6) + 1))  # uneven rows over the batch, on random devices
    cuts = np.unique(np.concatenate([[0, ext], rng.integers(0, ext, parts)]))
    n = len(cuts) - 1
    whole = g.ops["fc1"].shards
    lo = np.repeat(whole.lo, n, axis=0)
    hi = np.repeat(whole.hi, n, axis=0)
    lo[:, 0], hi[:, 0] = cuts[:-1], cuts[1:]
    sh = Shards(lo, hi, rng.integers(0, 8, n))
    g = g.with_ops({"fc1": g.ops["fc1"].replace(shards=sh)})
    total = int(rng.integers(2, ext + 1))
    want = _cut_reference(sh, 0, P.microbatch_bounds(ext, total))
    if len(want[2]) == n:  # every bound falls on a shard's edge
        with pytest.raises(RewriteError, match="already lie within single microbatches"):
            P._cut_at(g, "fc1", 0, total)
        return
    got = P._cut_at(g, "fc1", 0, total).ops["fc1"].shards
    assert (got.lo.tolist(), got.hi.tolist(), got.device.tolist()) == want


def test_cut_at_refuses_shards_within_microbatches():
    g = workloads.build("mlp", batch=8, widths=[8, 16, 8])
    halves = Shards([[0, 0], [4, 0]], [[4, 16], [8, 16]], [0, 1])
    g = g.with_ops({"fc1": g.ops["fc1"].replace(shards=halves)})
    assert len(P._cut_at(g, "fc1", 0, 4).ops["fc1"].shards) == 4
    with pytest.raises(RewriteError, match="already lie within single microbatches"):
        P._cut_at(g, "fc1", 0, 2)
