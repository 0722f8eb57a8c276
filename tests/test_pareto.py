"""Tests for optimizer.search.pareto: every fast routine is checked against an
independent brute-force reference written here."""

from __future__ import annotations

import itertools
import json
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from optimizer.search.pareto import (
    ArchiveChanges,
    EpsilonBoxArchive,
    crowding_distance,
    dominates,
    hypervolume,
    nondominated_mask,
    nondominated_sort,
    rank_and_crowding,
    ranks,
    reference_point,
    select_nsga2,
    tournament,
)

SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --------------------------------------------------------------------------- #
# brute-force references (pure Python, obviously correct)
# --------------------------------------------------------------------------- #
def bf_dominates(a, b) -> bool:
    return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))


def bf_mask(F: np.ndarray) -> np.ndarray:
    rows = [tuple(r) for r in F.tolist()]
    out = []
    for i, a in enumerate(rows):
        dominated = any(bf_dominates(b, a) for b in rows)
        dup_of_earlier = any(rows[j] == a for j in range(i))
        out.append(not dominated and not dup_of_earlier)
    return np.array(out, dtype=bool)


def bf_fronts(F: np.ndarray) -> list[list[int]]:
    rows = [tuple(r) for r in F.tolist()]
    remaining = set(range(len(rows)))
    fronts = []
    while remaining:
        front = sorted(
            i for i in remaining if not any(bf_dominates(rows[j], rows[i]) for j in remaining)
        )
        fronts.append(front)
        remaining -= set(front)
    return fronts


def np_fronts(F: np.ndarray) -> list[np.ndarray]:
    """Vectorised O(n^2) peeling reference for larger n."""
    le = np.all(F[:, None, :] <= F[None, :, :], axis=2)
    lt = np.any(F[:, None, :] < F[None, :, :], axis=2)
    D = le & lt  # D[i, j]: i dominates j
    remaining = np.ones(len(F), dtype=bool)
    fronts = []
    while remaining.any():
        dominated = (D & remaining[:, None]).any(axis=0)
        front = remaining & ~dominated
        fronts.append(np.flatnonzero(front))
        remaining &= ~front
    return fronts


def bf_crowding(F: np.ndarray) -> list[float]:
    """Deb et al. (2002) pseudo-code, constant objectives skipped."""
    n, m = F.shape
    d = [0.0] * n
    if n <= 2:
        return [math.inf] * n
    for j in range(m):
        order = sorted(range(n), key=lambda i: F[i, j])  # stable, like the module
        lo, hi = F[order[0], j], F[order[-1], j]
        if hi == lo:
            continue
        d[order[0]] = d[order[-1]] = math.inf
        for p in range(1, n - 1):
            d[order[p]] += (F[order[p + 1], j] - F[order[p - 1], j]) / (hi - lo)
    return d


def bf_hypervolume(F: np.ndarray, ref: np.ndarray) -> float:
    """Exact grid decomposition: the union of boxes [p, ref] is a union of
    cells of the grid spanned by all point coordinates; add up the cells whose
    lower corner is weakly dominated by some point."""
    P = [p for p in F.tolist() if all(x < r for x, r in zip(p, ref))]
    if not P:
        return 0.0
    m = len(ref)
    axes = [sorted(set([p[j] for p in P] + [float(ref[j])])) for j in range(m)]
    total = 0.0
    for cell in itertools.product(*[range(len(a) - 1) for a in axes]):
        lower = [axes[j][c] for j, c in enumerate(cell)]
        if any(all(p[j] <= lower[j] for j in range(m)) for p in P):
            vol = 1.0
            for j, c in enumerate(cell):
                vol *= axes[j][c + 1] - axes[j][c]
            total += vol
    return total


def sweep_hv_2d(F: np.ndarray, ref) -> float:
    """Independent 2-D sweep: sort by f1, accumulate staircase rectangles."""
    P = sorted((a, b) for a, b in F.tolist() if a < ref[0] and b < ref[1])
    area, best_y = 0.0, ref[1]
    for x, y in P:
        if y < best_y:
            area += (ref[0] - x) * (best_y - y)
            best_y = y
    return area


# --------------------------------------------------------------------------- #
# strategies: small matrices with many ties and duplicate rows
# --------------------------------------------------------------------------- #
TIE_VALUES = st.one_of(
    st.sampled_from([0.0, 1.0, 2.0, 3.0, -1.0, -0.0]),
    st.sampled_from([0.0, 1.0, 2.0, 3.0, math.inf]),
    st.floats(-5, 5, allow_nan=False, allow_infinity=False, width=16),
)


@st.composite
def objective_matrices(draw, max_n=25, min_n=0, elements=TIE_VALUES, m=None):
    m = draw(st.integers(1, 4)) if m is None else m
    n = draw(st.integers(min_n, max_n))
    F = draw(arrays(np.float64, (n, m), elements=elements))
    if n:
        dup = draw(st.lists(st.integers(0, n - 1), max_size=n))
        F = np.vstack([F, F[dup]]) if dup else F
        perm = draw(st.permutations(range(len(F))))
        F = F[list(perm)]
    return F


# --------------------------------------------------------------------------- #
# dominates
# --------------------------------------------------------------------------- #
def test_dominates_hand_examples():
    assert dominates([1, 2], [1, 3])
    assert dominates([0, 0, 0], [1, 1, 1])
    assert not dominates([1, 2], [1, 2])  # identical
    assert not dominates([1, 3], [2, 2])  # incomparable
    assert not dominates([2, 2], [1, 3])
    assert not dominates([1, 3], [1, 2])
    assert dominates([1.0], [math.inf])
    assert not dominates([math.nan, 0], [1, 1])
    with pytest.raises(ValueError):
        dominates([1, 2], [1, 2, 3])


@SETTINGS
@given(st.data())
def test_dominates_matches_bruteforce(data):
    m = data.draw(st.integers(1, 4))
    vec = st.lists(st.sampled_from([0.0, 1.0, 2.0]), min_size=m, max_size=m)
    a, b = data.draw(vec), data.draw(vec)
    assert dominates(a, b) == bf_dominates(a, b)
    assert not (dominates(a, b) and dominates(b, a))


# --------------------------------------------------------------------------- #
# non-dominated mask & sorting
# --------------------------------------------------------------------------- #
def test_mask_hand_example_keeps_first_duplicate():
    F = np.array([[1, 1], [0, 1], [1, 0], [1, 0], [2, 2], [0, 1]], dtype=float)
    assert nondominated_mask(F).tolist() == [False, True, True, False, False, False]
    assert nondominated_mask(np.zeros((0, 3))).shape == (0,)
    assert nondominated_mask(np.array([[3.0], [1.0], [1.0], [2.0]])).tolist() == [
        False, True, False, False
    ]


def test_input_validation():
    with pytest.raises(ValueError):
        nondominated_mask(np.array([1.0, 2.0]))  # 1-D is ambiguous
    with pytest.raises(ValueError):
        nondominated_mask(np.array([[1.0, math.nan], [0.0, 0.0]]))
    with pytest.raises(ValueError):
        ranks(np.array([[math.nan]]))


@SETTINGS
@given(objective_matrices())
def test_mask_matches_bruteforce(F):
    mask = nondominated_mask(F)
    assert mask.dtype == bool and mask.shape == (len(F),)
    np.testing.assert_array_equal(mask, bf_mask(F))


@SETTINGS
@given(objective_matrices())
def test_sort_and_ranks_match_bruteforce(F):
    fronts = nondominated_sort(F)
    expected = bf_fronts(F)
    assert [f.tolist() for f in fronts] == expected
    r = ranks(F)
    assert r.dtype == np.int64
    for k, front in enumerate(expected):
        assert (r[front] == k).all()
    # front 0 = the non-dominated points, duplicates included
    if len(F):
        first = set(fronts[0].tolist())
        assert set(np.flatnonzero(nondominated_mask(F)).tolist()) <= first


@pytest.mark.parametrize("m", [2, 3, 4])
def test_mask_and_sort_medium_n_vs_vectorised_reference(m):
    rng = np.random.default_rng(m)
    F = np.round(rng.random((1500, m)) * 20)  # many ties and duplicates
    F[:, -1] = np.where(rng.random(1500) < 0.5, 20 - F[:, 0], F[:, -1])
    ref_fronts = np_fronts(F)
    got = nondominated_sort(F)
    assert len(got) == len(ref_fronts)
    for a, b in zip(got, ref_fronts):
        np.testing.assert_array_equal(a, b)
    mask = nondominated_mask(F)
    front0 = F[ref_fronts[0]]
    # kept = first occurrence of each distinct front-0 row
    _, first_idx = np.unique(front0, axis=0, return_index=True)
    np.testing.assert_array_equal(np.flatnonzero(mask), np.sort(ref_fronts[0][first_idx]))


def test_mask_and_ranks_on_50k_points():
    rng = np.random.default_rng(0)
    for m in (2, 3, 4):
        F = rng.random((50_000, m))
        F[:, -1] = 1.0 - F[:, 0] + 0.01 * F[:, -1]  # a large front
        mask = nondominated_mask(F)
        r = ranks(F)
        assert mask.sum() > 0 and (r[mask] == 0).all()


# --------------------------------------------------------------------------- #
# crowding
# --------------------------------------------------------------------------- #
def test_crowding_hand_examples():
    F = np.array([[0, 10], [1, 6], [3, 3], [10, 0]], dtype=float)
    # obj0 (range 10): p1 = (3-0)/10, p2 = (10-1)/10
    # obj1 (range 10): p1 = (10-3)/10, p2 = (6-0)/10
    np.testing.assert_allclose(crowding_distance(F), [np.inf, 1.0, 1.5, np.inf])
    F = np.array([[0, 4], [1, 2], [2, 1], [4, 0]], dtype=float)
    np.testing.assert_allclose(crowding_distance(F), [np.inf, 1.25, 1.25, np.inf])
    # constant third objective contributes nothing
    F = np.array([[0, 5, 1], [2, 3, 1], [5, 0, 1]], dtype=float)
    np.testing.assert_allclose(crowding_distance(F), [np.inf, 2.0, np.inf])
    # shuffled rows -> permuted distances
    perm = [2, 0, 1]
    np.testing.assert_allclose(crowding_distance(F[perm]), [np.inf, np.inf, 2.0])
    # small sets are all boundary
    assert np.isinf(crowding_distance(np.array([[1.0, 2.0], [2.0, 1.0]]))).all()
    assert crowding_distance(np.zeros((0, 2))).shape == (0,)
    # all-equal front: no information, all zero
    np.testing.assert_array_equal(crowding_distance(np.ones((4, 2))), np.zeros(4))


@SETTINGS
@given(objective_matrices(elements=st.sampled_from([0.0, 1.0, 2.0, 3.5, 7.0])))
def test_crowding_matches_bruteforce(F):
    np.testing.assert_allclose(crowding_distance(F), bf_crowding(F), rtol=1e-12)


def test_rank_and_crowding_is_per_front():
    F = np.array([[0, 2], [1, 1], [2, 0], [1, 3], [2, 2], [3, 1]], dtype=float)
    r, cd = rank_and_crowding(F)
    assert r.tolist() == [0, 0, 0, 1, 1, 1]
    np.testing.assert_allclose(cd, [np.inf, 2.0, np.inf, np.inf, 2.0, np.inf])


# --------------------------------------------------------------------------- #
# NSGA-II selection
# --------------------------------------------------------------------------- #
def test_select_nsga2_hand_example():
    F = np.array(
        [[0, 10], [1, 6], [3, 3], [10, 0], [11, 11], [5, 5.5], [12, 12]], dtype=float
    )
    # fronts: {0,1,2,3}, {5} (dominated by 2), {4}, {6}; crowding of front 0
    # is [inf, 1.0, 1.5, inf] (see test_crowding_hand_examples)
    sel = select_nsga2(F, 5, np.random.default_rng(0))
    assert set(sel[:4].tolist()) == {0, 1, 2, 3} and sel[4] == 5
    # truncating front 0 keeps the boundary points, then the least crowded
    sel = select_nsga2(F, 3, np.random.default_rng(0))
    assert sorted(sel.tolist()) == [0, 2, 3]
    assert len(select_nsga2(F, 100, 1)) == 7
    assert len(select_nsga2(F, 0, 1)) == 0


@SETTINGS
@given(objective_matrices(min_n=1), st.integers(0, 60), st.integers(0, 2**32 - 1))
def test_select_nsga2_properties(F, k, seed):
    sel = select_nsga2(F, k, np.random.default_rng(seed))
    n = len(F)
    assert len(sel) == min(k, n) and len(set(sel.tolist())) == len(sel)
    np.testing.assert_array_equal(sel, select_nsga2(F, k, np.random.default_rng(seed)))
    if 0 < len(sel) < n:
        r = ranks(F)
        rest = np.setdiff1d(np.arange(n), sel)
        worst = r[sel].max()
        assert worst <= r[rest].min()
        # inside the cut front, survivors are at least as uncrowded as the rest
        front = np.flatnonzero(r == worst)
        cd = crowding_distance(F[front])
        chosen = np.isin(front, sel)
        if chosen.any() and (~chosen).any():
            assert cd[chosen].min() >= cd[~chosen].max()


def test_tournament():
    rng = np.random.default_rng(1)
    # n = 2: both contestants always meet, the lower rank always wins
    assert (tournament([0, 1], [0.0, 9.0], 200, rng) == 0).all()
    assert (tournament([3, 3], [1.0, np.inf], 200, rng) == 1).all()
    w = tournament([0, 0], [1.0, 1.0], 4000, rng)
    assert 0.4 < w.mean() < 0.6  # fair coin on full ties
    assert (tournament([5], [0.0], 7, rng) == 0).all()
    assert len(tournament([0, 1, 2], [1, 1, 1], 0, rng)) == 0
    # a unique best individual wins every tournament it takes part in (p = 2/n)
    n = 10
    r = np.ones(n, dtype=int)
    r[4] = 0
    w = tournament(r, np.zeros(n), 20_000, rng)
    assert 0.17 < (w == 4).mean() < 0.23
    assert set(np.unique(w).tolist()) == set(range(n))
    with pytest.raises(ValueError):
        tournament([], [], 3, rng)
    with pytest.raises(ValueError):
        tournament([0, 1], [0.0], 3, rng)


# --------------------------------------------------------------------------- #
# hypervolume & reference point
# --------------------------------------------------------------------------- #
def test_hypervolume_hand_examples():
    ref = np.array([4.0, 4.0])
    F = np.array([[1, 3], [2, 2], [3, 1]], dtype=float)
    assert hypervolume(F, ref) == pytest.approx(6.0)  # 1 + 2 + 3
    assert hypervolume(np.vstack([F, [[2.5, 2.5], [2, 2]]]), ref) == pytest.approx(6.0)
    # points not strictly dominating the reference are ignored
    assert hypervolume(np.array([[4, 1], [1, 4], [5, 0]], dtype=float), ref) == 0.0
    assert hypervolume(np.array([[4, 1], [2, 2], [np.inf, 0]]), ref) == pytest.approx(4.0)
    assert hypervolume(np.zeros((0, 2)), ref) == 0.0
    # 3-D: union of two boxes minus their overlap: 4 + 2 - 1
    F3 = np.array([[0, 0, 1], [1, 1, 0]], dtype=float)
    assert hypervolume(F3, [2, 2, 2]) == pytest.approx(5.0)
    assert hypervolume(np.array([[1.0, 1.0, 1.0]]), [2, 3, 4]) == pytest.approx(6.0)
    # 3-D: three 3x1x1 slabs; every pairwise (and the triple) intersection
    # is the unit cube [2,3]^3: 3*3 - 3*1 + 1 = 7
    F3 = np.array([[0, 2, 2], [2, 0, 2], [2, 2, 0]], dtype=float)
    assert hypervolume(F3, [3, 3, 3]) == pytest.approx(7.0)
    # 4-D and 1-D
    assert hypervolume(np.array([[1.0, 1, 1, 1], [0, 2, 2, 2]]), [3, 3, 3, 3]) == pytest.approx(
        16 + 3 - 2  # overlap [1,3]x[2,3]^3
    )
    assert hypervolume(np.array([[3.0], [1.0], [5.0]]), [4.0]) == pytest.approx(3.0)
    assert hypervolume(np.array([[5.0], [6.0]]), [4.0]) == 0.0
    with pytest.raises(ValueError):
        hypervolume(F, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError):
        hypervolume(F, [np.inf, 4.0])


@SETTINGS
@given(st.data())
def test_hypervolume_matches_bruteforce(data):
    m = data.draw(st.integers(2, 4))
    vals = st.one_of(
        st.sampled_from([0.0, 1.0, 2.0, 3.0, 6.0, 7.0]),
        st.floats(0, 7, allow_nan=False, width=16),
    )
    F = data.draw(objective_matrices(max_n=7 if m < 4 else 5, elements=vals, m=m))
    ref = np.array(data.draw(st.lists(st.sampled_from([5.0, 6.0, 6.5]), min_size=m, max_size=m)))
    hv = hypervolume(F, ref)
    assert hv == pytest.approx(bf_hypervolume(F, ref), rel=1e-9, abs=1e-9)
    if m == 2:
        assert hv == pytest.approx(sweep_hv_2d(F, ref), rel=1e-9, abs=1e-9)
    # monotone: adding points never decreases HV; only the front matters
    if len(F):
        assert hypervolume(F[nondominated_mask(F)], ref) == pytest.approx(hv, rel=1e-9, abs=1e-9)
        assert hypervolume(F[:-1], ref) <= hv + 1e-9


def test_reference_point():
    np.testing.assert_allclose(reference_point(np.array([[1.0, 2.0], [3.0, 0.0]])), [3.3, 2.2])
    np.testing.assert_allclose(reference_point(np.zeros((2, 2))), [0.1, 0.1])
    F = np.array([[-2.0, 0.0, 0.0], [-1.0, 0.0, -4.0]])
    np.testing.assert_allclose(reference_point(F), [-0.9, 0.1, 0.4])
    np.testing.assert_allclose(reference_point(F, margin=0.5), [-0.5, 0.5, 2.0])
    F = np.array([[1.0, np.inf], [2.0, 10.0]])
    np.testing.assert_allclose(reference_point(F), [2.2, 11.0])
    with pytest.raises(ValueError):
        reference_point(np.zeros((0, 2)))
    with pytest.raises(ValueError):
        reference_point(np.array([[1.0, np.inf]]))
    with pytest.raises(ValueError):
        reference_point(np.ones((2, 2)), margin=-0.1)


@SETTINGS
@given(objective_matrices(min_n=1, elements=st.floats(-1e3, 1e3, allow_nan=False, width=32)))
def test_reference_point_beyond_all_points(F):
    ref = reference_point(F, margin=0.05)
    assert (F < ref).all()
    assert hypervolume(F, ref) > 0.0


# --------------------------------------------------------------------------- #
# ε-box archive
# --------------------------------------------------------------------------- #
def eps_bound(f: np.ndarray, eps: np.ndarray, relative: bool) -> np.ndarray:
    """Largest value a member may have and still ε-dominate f."""
    b = np.where(relative & (f > 0), f * (1 + eps), f + eps)
    return b + 1e-9 * np.abs(b) + 1e-12


def check_archive_invariants(arch: EpsilonBoxArchive, offered, relative):
    eps = arch.eps
    mem = arch.members()
    F = arch.objectives()
    assert len(arch) == len(mem) == len(F)
    keys = [k for k, _, _ in mem]
    assert len(set(keys)) == len(keys) and keys == arch.keys()
    assert all(k in arch for k in keys)
    boxes = np.array([arch.box(f) for f in F]).reshape(len(F), arch.n_objectives)
    for i in range(len(F)):
        for j in range(len(F)):
            if i != j:
                # boxes are distinct and mutually non-dominated
                assert not np.all(boxes[i] <= boxes[j])
                assert not bf_dominates(F[i], F[j])
    finite = [(k, f) for k, f in offered if np.all(np.isfinite(f))]
    for k, f in finite:
        # every offered point is ε-dominated by some member ...
        assert len(F) and np.any(np.all(F <= eps_bound(f, eps, relative), axis=1))
        # ... and no member is Pareto-dominated by any offered point
        assert not np.any([bf_dominates(f, g) for g in F])
    # members really are offered items
    # (an evicted key may be offered again with other objectives)
    for k, f, p in mem:
        assert any(k == k2 and np.array_equal(f, f2) for k2, f2 in offered)
        assert p == {"k": k}


ARCHIVE_VALUES = st.one_of(
    st.floats(0.5, 200.0, allow_nan=False, width=32),
    st.sampled_from([1.0, 1.01, 1.02, 2.0, 3.0, 0.0, -0.5, -2.0]),
    st.floats(-3.0, 3.0, allow_nan=False, width=16),
)


@SETTINGS
@given(
    st.integers(1, 4),
    st.booleans(),
    st.lists(st.sampled_from([0.01, 0.05, 0.3, 1.0]), min_size=4, max_size=4),
    st.data(),
)
def test_archive_invariants(m, relative, eps, data):
    eps = eps[:m]
    arch = EpsilonBoxArchive(eps, relative=relative)
    pts = data.draw(
        st.lists(st.lists(ARCHIVE_VALUES, min_size=m, max_size=m), min_size=1, max_size=40)
    )
    offered = []
    model: set[str] = set()
    for i, p in enumerate(pts):
        # occasionally re-offer an identical point under a new key or an old key
        key = f"k{i}"
        if i and data.draw(st.integers(0, 5)) == 0:
            key = f"k{data.draw(st.integers(0, i - 1))}"
        f = np.array(p)
        present_before = key in arch
        accepted = arch.add(key, f, {"k": key})
        ch = arch.last_changes()
        if present_before:
            assert not accepted and ch == ArchiveChanges((), ())
        else:
            offered.append((key, f))
        if accepted:
            assert ch.entered == (key,) and key in arch
        else:
            assert ch == ArchiveChanges((), ())
        assert not set(ch.left) - model
        model = (model - set(ch.left)) | set(ch.entered)
        assert model == set(arch.keys())
    check_archive_invariants(arch, offered, relative)
    # size bound: projecting away one coordinate is injective on members
    B = np.array([arch.box(f) for _, f in offered])
    distinct = [len(np.unique(B[:, j])) for j in range(m)]
    bound = min(math.prod(distinct[:j] + distinct[j + 1 :]) for j in range(m)) if m > 1 else 1
    assert len(arch) <= bound


@SETTINGS
@given(
    st.booleans(),
    st.sampled_from([0.01, 0.1, 0.5]),
    st.floats(-50, 50, allow_nan=False),
    st.floats(-50, 50, allow_nan=False),
)
def test_box_index_monotone(relative, eps, x, y):
    arch = EpsilonBoxArchive([eps], relative=relative)
    lo, hi = min(x, y), max(x, y)
    assert arch.box([lo])[0] <= arch.box([hi])[0]
    if relative and lo <= 0 < hi:
        assert arch.box([lo])[0] < arch.box([hi])[0]


def test_box_index_values():
    rel = EpsilonBoxArchive([0.01, 0.1])
    np.testing.assert_array_equal(rel.box([1.0, 1.0]), [0, 0])
    np.testing.assert_array_equal(rel.box([1.0099, 1.09]), [0, 0])
    np.testing.assert_array_equal(rel.box([1.0101, 1.11]), [1, 1])
    np.testing.assert_array_equal(rel.box([0.5, 100.0]), [-70, 48])
    # values <= 0 fall back to additive boxes, below every positive box
    z, n1, n2 = rel.box([0.0, 0.0]), rel.box([-0.015, -0.15]), rel.box([-0.005, -0.05])
    tiny = rel.box([1e-300, 1e-300])
    assert (n1 < n2).all() and (n2 < z).all() and (z < tiny).all()
    np.testing.assert_array_equal(z - n1, [2, 2])  # floor(-1.5) = -2
    add = EpsilonBoxArchive([0.5, 2.0], relative=False)
    np.testing.assert_array_equal(add.box([1.2, 5.0]), [2, 2])
    np.testing.assert_array_equal(add.box([-0.2, -5.0]), [-1, -3])


def test_archive_hand_example_same_box_and_eviction():
    arch = EpsilonBoxArchive([0.1, 0.1], relative=False)
    assert arch.add("a", [0.35, 0.58], "A")  # box (3, 5)
    assert not arch.add("a", [0.0, 0.0], "dup key")  # duplicate key ignored
    assert arch.last_changes() == ArchiveChanges((), ())
    # in-box positions are measured in box widths from the corner (0.3, 0.5):
    # a = (0.5, 0.8) -> squared distance 0.89
    # same box, incomparable, farther (0.8, 0.7) -> 1.13: rejected
    assert not arch.add("b", [0.38, 0.57], "B")
    # same box, incomparable, closer (0.1, 0.9) -> 0.82: replaces a
    assert arch.add("c", [0.31, 0.59], "C")
    assert arch.last_changes() == ArchiveChanges(("c",), ("a",))
    # same box, dominates c: replaces it
    assert arch.add("d", [0.305, 0.585], "D")
    assert arch.last_changes() == ArchiveChanges(("d",), ("c",))
    # identical point, new key: first one stays
    assert not arch.add("d2", [0.305, 0.585], "D2")
    # another box, incomparable boxes: both kept
    assert arch.add("e", [0.55, 0.21], "E")  # box (5, 2)
    assert arch.keys() == ["d", "e"]
    # a box dominated by a member's box is rejected even if not Pareto-dominated
    assert not arch.add("f", [0.65, 0.2001], "F")  # box (6, 2) > (5, 2)
    assert not arch.add("g", [0.55, 0.81], "G")  # box (5, 8)
    # a newcomer whose box dominates both boxes evicts both members
    assert arch.add("h", [0.2, 0.1], "H")
    assert arch.last_changes() == ArchiveChanges(("h",), ("d", "e"))
    assert len(arch) == 1 and "h" in arch and "d" not in arch
    f, payload = arch.get("h")
    np.testing.assert_array_equal(f, [0.2, 0.1])
    assert payload == "H" and arch.get("d") is None
    # non-finite vectors are never accepted; wrong length raises
    assert not arch.add("x", [np.inf, 0.0], None)
    assert not arch.add("y", [np.nan, 0.0], None)
    with pytest.raises(ValueError):
        arch.add("z", [0.1, 0.1, 0.1], None)
    with pytest.raises(ValueError):
        EpsilonBoxArchive([0.1, 0.0])
    assert arch.objectives().shape == (1, 2)
    assert EpsilonBoxArchive([0.1] * 3).objectives().shape == (0, 3)


def test_archive_size_bound_on_a_line():
    # 2-D front f1 + f2 = 3 with f in [1, 2]: members need distinct f1-boxes,
    # and there are floor(log 2 / log 1.01) + 1 = 70 of them.
    rng = np.random.default_rng(3)
    t = rng.random(5000)
    pts = np.column_stack([1 + t, 2 - t])
    arch = EpsilonBoxArchive([0.01, 0.01])
    for i, p in enumerate(pts):
        arch.add(f"p{i}", p)
    n_boxes = math.floor(math.log(2) / math.log(1.01)) + 1
    assert 50 <= len(arch) <= n_boxes
    # the same with additive boxes of width 0.05: 21 boxes along f1 in [1, 2]
    arch = EpsilonBoxArchive([0.05, 0.05], relative=False)
    arch.update((f"p{i}", p, None) for i, p in enumerate(pts))
    assert 15 <= len(arch) <= 21
    # a 3-D plane is bounded by the boxes of two axes
    P = rng.dirichlet([1, 1, 1], size=3000) + 1.0
    arch = EpsilonBoxArchive([0.05, 0.05, 0.05])
    arch.update((f"q{i}", p, None) for i, p in enumerate(P))
    per_axis = math.floor(math.log(2) / math.log(1.05)) + 1
    assert len(arch) <= per_axis**2
    F = arch.objectives()
    assert nondominated_mask(F).all()


def test_archive_update_reports_net_changes():
    arch = EpsilonBoxArchive([0.1, 0.1], relative=False)
    arch.add("old", [0.55, 0.55], None)
    ch = arch.update(
        [
            ("a", [0.75, 0.35], None),  # enters
            ("b", [0.45, 0.95], None),  # enters ...
            ("c", [0.45, 0.85], None),  # ... and is evicted by c (box (4,8) < (4,9))
            ("x", [0.75, 0.36], None),  # rejected (same box as a, dominated)
            ("d", [0.15, 0.15], None),  # evicts old, a and c
        ]
    )
    assert ch == ArchiveChanges(("d",), ("old",))
    assert arch.last_changes() == ch and arch.keys() == ["d"]
    arch.clear()
    assert len(arch) == 0 and arch.last_changes() == ArchiveChanges((), ("d",))
    # a key that leaves and comes back within one batch is no net change
    arch.add("k", [0.58, 0.58], None)
    ch = arch.update([("z", [0.56, 0.56], None), ("k", [0.55, 0.55], None)])
    assert ch == ArchiveChanges((), ()) and arch.keys() == ["k"]
    np.testing.assert_array_equal(arch.get("k")[0], [0.55, 0.55])


def test_archive_dominating_point_wins_even_at_equal_box_distance():
    # the two points are one ulp apart: their in-box positions round to the
    # same value, yet the dominating one must take the box
    arch = EpsilonBoxArchive([0.01, 0.01])
    assert arch.add("a", [1e6, 2.0])
    assert arch.add("b", [np.nextafter(1e6, 0.0), 2.0])
    assert arch.keys() == ["b"]
    assert not arch.add("c", [1e6, 2.0])


@SETTINGS
@given(st.booleans(), st.lists(st.lists(ARCHIVE_VALUES, min_size=3, max_size=3), max_size=40))
def test_archive_update_equals_sequential_adds(relative, pts):
    items = [(f"k{i}", np.array(p), {"k": f"k{i}"}) for i, p in enumerate(pts)]
    a = EpsilonBoxArchive([0.05, 0.1, 0.2], relative=relative)
    b = EpsilonBoxArchive([0.05, 0.1, 0.2], relative=relative)
    a.update(items[:10])
    b.update(items[:10])
    before = set(a.keys())
    ch = a.update(items[10:])
    for it in items[10:]:
        b.add(*it)
    assert a.keys() == b.keys()
    after = set(a.keys())
    assert set(ch.entered) == after - before and set(ch.left) == before - after


def test_archive_json_round_trip():
    rng = np.random.default_rng(7)
    arch = EpsilonBoxArchive([0.02, 0.05, 0.1], relative=True)
    P = rng.dirichlet([1, 1, 1], size=400) * rng.choice([1e-3, 1.0, 1e6], size=(400, 1))
    P[::50] = -P[::50]  # some non-positive values
    for i, p in enumerate(P[:300]):
        arch.add(f"plan-{i}", p, {"id": i, "tags": ["a", "b"], "x": float(p[0])})
    doc = arch.to_json()
    text = json.dumps(doc)
    assert "pickle" not in text
    back = EpsilonBoxArchive.from_json(json.loads(text))
    also = EpsilonBoxArchive.from_json(text)
    for other in (back, also):
        assert other.keys() == arch.keys()
        assert other.relative and np.array_equal(other.eps, arch.eps)
        np.testing.assert_array_equal(other.objectives(), arch.objectives())  # bit exact
        assert [p for _, _, p in other.members()] == [p for _, _, p in arch.members()]
        assert other.last_changes() == ArchiveChanges((), ())
    assert back.to_json() == doc
    # the restored archive behaves identically afterwards
    for i, p in enumerate(P[300:], start=300):
        assert arch.add(f"plan-{i}", p, {"id": i}) == back.add(f"plan-{i}", p, {"id": i})
        assert arch.last_changes() == back.last_changes()
    assert arch.keys() == back.keys()
    with pytest.raises(ValueError):
        EpsilonBoxArchive.from_json({**doc, "version": 99})
    bad = EpsilonBoxArchive([0.1])
    assert bad.add("bad", [1.0], object())
    with pytest.raises(TypeError):
        bad.to_json()
