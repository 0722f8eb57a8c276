"""The lowering's pieces are cached by what they are computed from (``costmodel.lowering``): ops a
structural move re-creates unchanged find their op and group pieces again, and a piece is never
shared where the boxes or devices differ."""

from __future__ import annotations

import numpy as np

from costmodel import load_hardware
from costmodel.lowering import Lowerer
from ir import workloads
from ir.rewrites import place, retile


def _groups(low: Lowerer) -> int:
    return sum(isinstance(k, tuple) and k[0] in ("grp", "bgrp", "sgrp") for k in low._cache)


def _same(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f))
               for f in ("kind", "dev", "dst", "dur", "lat", "alloc", "succ_ptr", "succ_idx", "resident"))


def test_ops_made_again_unchanged_reuse_their_pieces():
    hw = load_hardware("h100-sxm-8")
    g = workloads.build("mlp", batch=32, widths=[64, 128, 64])
    g = retile(g, next(iter(g.ops)), [4, 1], [0, 1, 2, 3])
    low = Lowerer(hw)
    first = low.lower(g)
    groups = _groups(low)
    again = g.with_ops({n: o.replace() for n, o in g.ops.items()})  # every op a new object, equal
    assert all(again.ops[n] is not g.ops[n] for n in g.ops)
    assert _same(low.lower(again), first) and _groups(low) == groups
    # the same boxes on other devices are another piece, priced afresh (as a fresh lowerer does)
    moved = place(again, next(iter(g.ops)), [4, 5, 6, 7])
    got, want = low.lower(moved), Lowerer(hw).lower(moved)
    assert _groups(low) > groups and _same(got, want) and not _same(got, first)
