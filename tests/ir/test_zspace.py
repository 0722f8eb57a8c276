"""ir.zspace: boxes checked per dimension, partitions, and projections by interval arithmetic.

The Java bugs listed in TAPESTRY_NOTES §1.2 and §3.5 each have a test here.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ir.zspace import (Projection, ZRange, identity_projection, is_exact_partition, partition_problem,
                       project_boxes, split_points)


def zr(*spans: tuple[int, int]) -> ZRange:
    return ZRange([a for a, _ in spans], [b for _, b in spans])


# -- ZRange -------------------------------------------------------------------------------------


def test_inverted_box_refused_per_dimension():
    # INCOMPARABLE under dominance, so the Java constructor let it through with extent -3.
    with pytest.raises(ValueError, match="dimension 1 is inverted"):
        ZRange((0, 5), (3, 2))
    with pytest.raises(ValueError, match="dimension 0 is inverted"):
        ZRange((4,), (3,))
    with pytest.raises(ValueError, match="rank"):
        ZRange((0, 0), (1,))


def test_empty_boxes_are_legal():
    e = ZRange((2, 3), (2, 7))
    assert e.is_empty and e.size == 0 and e.shape == (0, 4)
    assert ZRange((), ()).size == 1  # a 0-dimensional box is one point
    assert ZRange.of_shape((3, 0)).is_empty


def test_shape_size_repr():
    b = zr((1, 4), (2, 7))
    assert b.shape == (3, 5) and b.size == 15 and b.ndim == 2
    assert repr(b) == "zr[1:4, 2:7]"
    assert ZRange.of_shape((2, 3)) == zr((0, 2), (0, 3))
    assert b.translate((1, -2)) == zr((2, 5), (0, 5))


def test_intersection_possibly_empty():
    a, b = zr((0, 4), (0, 4)), zr((2, 6), (3, 8))
    assert a.intersect(b) == zr((2, 4), (3, 4))
    apart = a.intersect(zr((5, 7), (0, 4)))
    assert apart.is_empty  # never None, never inverted
    touching = a.intersect(zr((4, 6), (0, 4)))  # half-open: sharing a face is no overlap
    assert touching.is_empty
    with pytest.raises(ValueError, match="rank"):
        a.intersect(zr((0, 1)))


def test_containment():
    big = zr((0, 4), (0, 4))
    assert big.contains(zr((1, 3), (0, 4)))
    assert big.contains(big)
    assert not big.contains(zr((1, 5), (0, 4)))
    assert not big.contains(zr((-1, 2), (0, 1)))
    assert big.contains(ZRange((9, 9), (9, 9)))  # the empty set lies in every box
    assert big.contains(big.intersect(zr((7, 9), (0, 1))))


def test_point_containment_is_strict():
    b = zr((0, 2), (0, 3))
    # The Java code tested p < end by dominance and reported (0, 3) inside zr[0:2, 0:3].
    assert not b.contains_point((0, 3))
    assert not b.contains_point((2, 0))
    assert not b.contains_point((-1, 0))
    assert b.contains_point((0, 0)) and b.contains_point((1, 2))
    with pytest.raises(ValueError, match="rank"):
        b.contains_point((0,))


def test_split_ragged_extent_10_into_4():
    # The Java bug: extent 10 with chunk 4 computed quotient + remainder chunks and threw.
    parts = zr((0, 10), (5, 7)).split(0, 4)
    assert [p.shape[0] for p in parts] == [3, 3, 2, 2]
    assert [p.start[0] for p in parts] == [0, 3, 6, 8]
    assert all(p.start[1] == 5 and p.end[1] == 7 for p in parts)
    assert is_exact_partition(parts, zr((0, 10), (5, 7)))
    assert split_points(3, 10, 4) == [3, 6, 9, 11, 13]


def test_split_limits():
    b = zr((0, 3), (0, 2))
    assert b.split(1, 2) == [zr((0, 3), (0, 1)), zr((0, 3), (1, 2))]
    assert b.split(0, 1) == [b]
    assert b.split(-1, 2) == b.split(1, 2)
    with pytest.raises(ValueError, match="cannot split extent 3"):
        b.split(0, 4)
    with pytest.raises(ValueError):
        b.split(0, 0)


@settings(max_examples=100, deadline=None)
@given(extent=st.integers(0, 50), parts=st.integers(1, 50), start=st.integers(-5, 5))
def test_split_is_near_equal_partition(extent, parts, start):
    box = ZRange((start, 0), (start + extent, 2))
    if parts > max(extent, 1):
        with pytest.raises(ValueError):
            box.split(0, parts)
        return
    pieces = box.split(0, parts)
    sizes = [p.shape[0] for p in pieces]
    assert len(pieces) == parts and sum(sizes) == extent
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert is_exact_partition(pieces, box)


# -- exact partitions ----------------------------------------------------------------------------


def test_overlap_plus_gap_with_sizes_adding_up_is_caught():
    # TAPESTRY_NOTES §3.5: sizes 2 + 2 == 4 and the bounding box is full, yet (0,0) is covered
    # twice and (1,1) never. Tapestry's coverage constraint passed this.
    whole = zr((0, 2), (0, 2))
    parts = [zr((0, 1), (0, 2)), zr((0, 2), (0, 1))]
    assert sum(p.size for p in parts) == whole.size
    code, why = partition_problem(parts, whole)
    assert code == "shard-overlap" and "overlaps" in why
    assert not is_exact_partition(parts, whole)


def test_partition_problems_by_code():
    whole = zr((0, 4), (0, 4))
    assert partition_problem(whole.split(0, 2), whole) is None
    assert partition_problem([zr((0, 4), (0, 5))], whole)[0] == "shard-outside"
    assert partition_problem([zr((0, 2), (0, 4))], whole)[0] == "shard-coverage"
    assert partition_problem([], whole)[0] == "shard-coverage"
    assert partition_problem([], ZRange((0,), (0,))) is None
    lo = np.array([[0, 0], [2, 0]])
    hi = np.array([[2, 4], [1, 4]])  # inverted second shard, only expressible as raw arrays
    assert partition_problem((lo, hi), whole)[0] == "shard-inverted"
    # Empty shards are harmless (size 0, they overlap nothing).
    assert partition_problem(whole.split(0, 2) + [zr((1, 1), (0, 4))], whole) is None


def test_overlap_found_on_huge_irregular_grid():
    # An anti-diagonal of unit cells compresses to > 4M grid cells, so the pairwise fallback runs.
    n = 2100
    i = np.arange(n)
    lo = np.stack([i, n - 1 - i], axis=1)
    whole = ZRange((0, 0), (n, n))
    assert partition_problem((lo, lo + 1), whole)[0] == "shard-coverage"
    # Add one box of n*(n-1) cells: sizes now add up to n*n, but it overlaps the diagonal.
    lo2 = np.concatenate([lo, [[0, 0]]])
    hi2 = np.concatenate([lo + 1, [[n, n - 1]]])
    assert int(np.prod(hi2 - lo2, axis=1).sum()) == whole.size
    assert partition_problem((lo2, hi2), whole)[0] == "shard-overlap"


def _brute_force_partition(parts: list[ZRange], whole: ZRange) -> bool:
    count = {}
    for p in parts:
        for pt in itertools.product(*[range(a, b) for a, b in zip(p.start, p.end)]):
            if not whole.contains_point(pt):
                return False
            count[pt] = count.get(pt, 0) + 1
    return all(v == 1 for v in count.values()) and len(count) == whole.size


box2 = st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4), st.integers(0, 4)).map(
    lambda t: ZRange((min(t[0], t[1]), min(t[2], t[3])), (max(t[0], t[1]), max(t[2], t[3]))))


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(box2, max_size=5))
def test_partition_check_agrees_with_brute_force(parts):
    whole = ZRange((0, 0), (4, 4))
    assert is_exact_partition(parts, whole) == _brute_force_partition(parts, whole)


# -- projections ----------------------------------------------------------------------------


EX1 = Projection(((1, 0), (0, 1), (1, 1)), (10, 20, 30), (4, 4, 1))


def test_projection_worked_example_point():
    assert EX1.apply_point((5, 6)) == ZRange((15, 26, 41), (19, 30, 42))


def test_projection_worked_example_box():
    img = EX1.apply(zr((5, 7), (6, 8)))
    assert img == ZRange((15, 26, 41), (20, 31, 44))
    assert img.shape == (5, 5, 3)


def test_projection_example_2_augmented_matrix():
    p = Projection(((1, 0), (0, 2)), (-1, 0), (1, 2))
    assert p.apply_point((4, 3)) == ZRange((3, 6), (4, 8))


def test_projection_empty_box_gives_empty_image():
    img = EX1.apply(zr((5, 5), (6, 8)))
    assert img.is_empty and img.start == (15, 26, 41)


def test_negative_entries_use_interval_arithmetic():
    # A reversal: i -> 9 - i. The two-corner rule would give the inverted box [9, 7).
    rev = Projection(((-1,),), (9,), (1,))
    assert rev.apply(zr((0, 3))) == zr((7, 10))
    assert rev.apply_point((0,)) == zr((9, 10))


def test_projection_construction_errors():
    with pytest.raises(ValueError, match="rows disagree"):
        Projection(((1, 0),), (0, 0), (1,))
    with pytest.raises(ValueError, match="negative"):
        Projection(((1,),), (0,), (-1,))
    with pytest.raises(ValueError, match="one length"):
        Projection(((1, 0), (1,)), (0, 0), (1, 1))
    assert identity_projection(2).apply(zr((1, 3), (0, 4))) == zr((1, 3), (0, 4))


def _point_union_bbox(p: Projection, box: ZRange) -> ZRange | None:
    """Bounding box of the union of per-point images, by enumerating every index point."""
    los, his = [], []
    for pt in itertools.product(*[range(a, b) for a, b in zip(box.start, box.end)]):
        A = np.array(p.A)
        lo = A @ np.array(pt) + np.array(p.b)
        los.append(lo)
        his.append(lo + np.array(p.s))
    if not los:
        return None
    return ZRange(np.min(los, axis=0), np.max(his, axis=0))


def projections(in_rank: int, out_rank: int, lo: int = -3, hi: int = 3):
    return st.builds(
        lambda A, b, s: Projection(tuple(map(tuple, A)), tuple(b), tuple(s)),
        st.lists(st.lists(st.integers(lo, hi), min_size=in_rank, max_size=in_rank), min_size=out_rank,
                 max_size=out_rank),
        st.lists(st.integers(-10, 10), min_size=out_rank, max_size=out_rank),
        st.lists(st.integers(1, 4), min_size=out_rank, max_size=out_rank))


@st.composite
def proj_and_box(draw):
    n, m = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    p = draw(projections(n, m))
    starts = draw(st.lists(st.integers(-4, 4), min_size=n, max_size=n))
    ext = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    return p, ZRange(starts, [a + e for a, e in zip(starts, ext)])


@settings(max_examples=200, deadline=None)
@given(proj_and_box())
def test_interval_image_equals_bbox_of_point_images(pb):
    p, box = pb
    assert p.apply(box) == _point_union_bbox(p, box)


@settings(max_examples=100, deadline=None)
@given(proj_and_box())
def test_project_boxes_vectorised_matches_apply(pb):
    p, box = pb
    boxes = [box, box.translate([1] * box.ndim), ZRange(box.start, box.start)]
    lo = np.array([b.start for b in boxes])
    hi = np.array([b.end for b in boxes])
    olo, ohi = project_boxes(p, lo, hi)
    for i, b in enumerate(boxes):
        assert ZRange(olo[i], ohi[i]) == p.apply(b)


@st.composite
def composable(draw):
    n, m, k = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    inner = draw(projections(n, m))
    outer = draw(projections(m, k))
    starts = draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n))
    ext = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    return outer, inner, ZRange(starts, [a + e for a, e in zip(starts, ext)])


@settings(max_examples=150, deadline=None)
@given(composable())
def test_compose_matches_brute_force(oib):
    outer, inner, box = oib
    c = outer.compose(inner)
    assert c.in_rank == inner.in_rank and c.out_rank == outer.out_rank
    # Per point: the composed image is exactly outer's image of inner's box.
    for pt in itertools.product(*[range(a, b) for a, b in zip(box.start, box.end)]):
        assert c.apply_point(pt) == outer.apply(inner.apply_point(pt))
    # Per box: the composed projection's image is the bounding box of those per-point images.
    los, his = [], []
    for pt in itertools.product(*[range(a, b) for a, b in zip(box.start, box.end)]):
        img = outer.apply(inner.apply_point(pt))
        los.append(img.start)
        his.append(img.end)
    assert c.apply(box) == ZRange(np.min(los, axis=0), np.max(his, axis=0))
    # And never more than applying the two box images in turn (which may over-approximate).
    assert outer.apply(inner.apply(box)).contains(c.apply(box))


def test_compose_with_identity_is_neutral():
    assert EX1.compose(identity_projection(2)) == EX1
    assert identity_projection(3).compose(EX1) == EX1


def test_projection_json():
    assert EX1.to_json() == {"A": [[1, 0], [0, 1], [1, 1]], "b": [10, 20, 30], "s": [4, 4, 1]}
