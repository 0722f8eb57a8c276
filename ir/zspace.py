"""Integer boxes and affine projections: the arithmetic sharding rests on.

A ``ZRange`` is a half-open box ``[start, end)`` with ``start[d] <= end[d]`` checked per
dimension (never by dominance: Tapestry's Java version accepted inverted boxes that way).
Empty boxes are legal. A ``Projection`` maps an index point ``i`` to the box
``[A·i + b, A·i + b + s)``; the image of an index *box* uses interval arithmetic per row,
so negative entries of ``A`` are exact (the two-corner rule is not).

Vectorised forms (``project_boxes``) work on ``(n, d)`` int64 arrays of lows and highs;
the lowering and executor use them on thousands of shards at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

import numpy as np

from ir.unique import distinct

#: the largest size a workload or import parameter may give a dim: far beyond any model's, far
#: below where NumPy's int64 shape arithmetic overflows (a tensor's cell count is checked later)
MAX_DIM = 2**40


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@dataclass(frozen=True, slots=True)
class ZRange:
    """Half-open integer box ``[start, end)``; 0-dimensional boxes have size 1."""

    start: tuple[int, ...]
    end: tuple[int, ...]

    def __init__(self, start: Iterable[int], end: Iterable[int]) -> None:
        s, e = _ints(start), _ints(end)
        if len(s) != len(e):
            raise ValueError(f"ZRange start {s} and end {e} differ in rank")
        for d, (a, b) in enumerate(zip(s, e)):
            if a > b:
                raise ValueError(f"ZRange dimension {d} is inverted: start {a} > end {b}")
        object.__setattr__(self, "start", s)
        object.__setattr__(self, "end", e)

    @classmethod
    def of_shape(cls, shape: Sequence[int]) -> ZRange:
        return cls((0,) * len(shape), shape)

    @property
    def ndim(self) -> int:
        return len(self.start)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in zip(self.start, self.end))

    @property
    def size(self) -> int:
        n = 1
        for x in self.shape:
            n *= x
        return n

    @property
    def is_empty(self) -> bool:
        return self.size == 0

    def intersect(self, other: ZRange) -> ZRange:
        """The common box; empty (never ``None``) when the boxes do not overlap."""
        self._same_rank(other)
        lo = tuple(max(a, b) for a, b in zip(self.start, other.start))
        hi = tuple(max(l, min(a, b)) for l, a, b in zip(lo, self.end, other.end))
        return ZRange(lo, hi)

    def contains(self, other: ZRange) -> bool:
        """Box containment, per dimension; an empty box (a point set) lies in every box of its rank."""
        self._same_rank(other)
        if other.is_empty:
            return True
        return all(a <= c and d <= b for a, b, c, d in zip(self.start, self.end, other.start, other.end))

    def contains_point(self, point: Sequence[int]) -> bool:
        """Strict per-dimension test ``start <= p < end``."""
        if len(point) != self.ndim:
            raise ValueError(f"point {tuple(point)} has rank {len(point)}, box has {self.ndim}")
        return all(a <= p < b for a, p, b in zip(self.start, point, self.end))

    def translate(self, offset: Sequence[int]) -> ZRange:
        return ZRange((s + o for s, o in zip(self.start, offset)), (e + o for e, o in zip(self.end, offset)))

    def split(self, dim: int, parts: int) -> list[ZRange]:
        """Split along ``dim`` into ``parts`` contiguous near-equal pieces (first ones larger)."""
        extent = self.end[dim] - self.start[dim]
        if parts < 1 or parts > max(extent, 1):
            raise ValueError(f"cannot split extent {extent} of dimension {dim} into {parts} parts")
        cuts = split_points(self.start[dim], extent, parts)
        out = []
        for a, b in zip(cuts[:-1], cuts[1:]):
            s, e = list(self.start), list(self.end)
            s[dim], e[dim] = a, b
            out.append(ZRange(s, e))
        return out

    def _same_rank(self, other: ZRange) -> None:
        if other.ndim != self.ndim:
            raise ValueError(f"rank mismatch: {self} vs {other}")

    def __repr__(self) -> str:
        return "zr[" + ", ".join(f"{a}:{b}" for a, b in zip(self.start, self.end)) + "]"


def split_points(start: int, extent: int, parts: int) -> list[int]:
    """Cut points of ``[start, start+extent)`` into ``parts`` near-equal pieces."""
    base, extra = divmod(extent, parts)
    cuts = [start]
    for p in range(parts):
        cuts.append(cuts[-1] + base + (1 if p < extra else 0))
    return cuts


def partition_problem(parts: Sequence[ZRange] | tuple[np.ndarray, np.ndarray],
                      whole: ZRange) -> tuple[str, str] | None:
    """``(code, why)`` when ``parts`` is not an exact partition of ``whole``, else ``None``.

    Codes: ``shard-inverted``, ``shard-outside``, ``shard-coverage`` (sizes do not add up),
    ``shard-overlap``.

    Exact means: every part inside ``whole``, pairwise disjoint, and sizes adding up.
    Sizes alone are not enough (``[0:1,0:2]`` and ``[0:2,0:1]`` overlap and leave a gap),
    so disjointness is checked by counting coverage on the compressed coordinate grid.
    """
    lo, hi = boxes_to_arrays(parts, whole.ndim) if not isinstance(parts, tuple) else parts
    wlo, whi = np.array(whole.start, dtype=np.int64), np.array(whole.end, dtype=np.int64)
    if lo.shape[0] == 0:
        return None if whole.size == 0 else ("shard-coverage", "the op has no shards")
    if np.any(lo > hi):
        return "shard-inverted", f"shard {int(np.argmax(np.any(lo > hi, axis=1)))} is inverted"
    outside = np.any((lo < wlo) | (hi > whi), axis=1)
    if outside.any():
        i = int(np.argmax(outside))
        return "shard-outside", f"shard {i} {_fmt(lo[i], hi[i])} lies outside the index space {whole!r}"
    sizes = np.prod(hi - lo, axis=1)
    total = int(sizes.sum())
    if total != whole.size:
        return "shard-coverage", f"shard sizes add up to {total}, the index space has {whole.size} points"
    why = _overlap_problem(lo, hi)
    return None if why is None else ("shard-overlap", why)


def _overlap_problem(lo: np.ndarray, hi: np.ndarray) -> str | None:
    keep = np.prod(hi - lo, axis=1) > 0
    idx = np.nonzero(keep)[0]
    lo, hi = lo[keep], hi[keep]
    n, d = lo.shape
    if n <= 1:
        return None
    axes = [distinct(np.concatenate([lo[:, k], hi[:, k]])) for k in range(d)]
    cells = int(np.prod([len(a) - 1 for a in axes]))
    if cells <= 4_000_000:
        count = np.zeros([len(a) - 1 for a in axes], dtype=np.int32)
        clo = np.stack([np.searchsorted(axes[k], lo[:, k]) for k in range(d)], axis=1)
        chi = np.stack([np.searchsorted(axes[k], hi[:, k]) for k in range(d)], axis=1)
        for i in range(n):
            view = count[tuple(slice(a, b) for a, b in zip(clo[i], chi[i]))]
            if view.max(initial=0) > 0:
                return f"shard {int(idx[i])} {_fmt(lo[i], hi[i])} overlaps another shard"
            view += 1
        return None
    for i in range(n - 1):  # huge irregular grids: pairwise, vectorised per row
        inter = np.all(np.maximum(lo[i], lo[i + 1 :]) < np.minimum(hi[i], hi[i + 1 :]), axis=1)
        if inter.any():
            return f"shard {int(idx[i])} {_fmt(lo[i], hi[i])} overlaps another shard"
    return None


def _fmt(lo: np.ndarray, hi: np.ndarray) -> str:
    return repr(ZRange(lo, hi))


def is_exact_partition(parts: Sequence[ZRange], whole: ZRange) -> bool:
    return partition_problem(parts, whole) is None


def boxes_to_arrays(boxes: Sequence[ZRange], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    lo = np.array([b.start for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    hi = np.array([b.end for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    return lo, hi


@dataclass(frozen=True)
class Projection:
    """``P(i) = [A·i + b, A·i + b + s)``: rows of ``A`` are tensor dims, columns index dims."""

    A: tuple[tuple[int, ...], ...]
    b: tuple[int, ...]
    s: tuple[int, ...]

    def __post_init__(self) -> None:
        A = tuple(_ints(r) for r in self.A)
        object.__setattr__(self, "A", A)
        object.__setattr__(self, "b", _ints(self.b))
        object.__setattr__(self, "s", _ints(self.s))
        if len(self.b) != len(A) or len(self.s) != len(A):
            raise ValueError(f"projection rows disagree: A has {len(A)}, b {len(self.b)}, s {len(self.s)}")
        if not A or len({len(r) for r in A}) > 1:
            raise ValueError("projection matrix must have rows of one length (tensors have rank >= 1)")
        if any(x < 0 for x in self.s):
            raise ValueError(f"projection shape {self.s} has a negative entry")

    @classmethod
    def from_arrays(cls, A: np.ndarray, b: np.ndarray, s: np.ndarray) -> Projection:
        return cls(tuple(map(tuple, np.asarray(A).tolist())), tuple(np.asarray(b).tolist()), tuple(np.asarray(s).tolist()))

    @property
    def out_rank(self) -> int:
        return len(self.A)

    @property
    def in_rank(self) -> int:
        return len(self.A[0])

    @cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(A⁺, A⁻, b, s)`` as int64 arrays for interval arithmetic."""
        A = _matrix(self)
        return np.maximum(A, 0), np.minimum(A, 0), np.array(self.b, dtype=np.int64), np.array(self.s, dtype=np.int64)

    def apply_point(self, point: Sequence[int]) -> ZRange:
        return self.apply(ZRange(point, [p + 1 for p in point]))

    def apply(self, box: ZRange) -> ZRange:
        lo, hi = project_boxes(self, np.array([box.start], np.int64), np.array([box.end], np.int64))
        return ZRange(lo[0], hi[0])

    def compose(self, inner: Projection) -> Projection:
        """``self ∘ inner``: index point → ``inner``'s box → this projection's image of it."""
        Ao, Ai = _matrix(self), _matrix(inner)
        si = np.array(inner.s, dtype=np.int64)
        bi = np.array(inner.b, dtype=np.int64)
        neg = np.minimum(Ao, 0)
        A = Ao @ Ai
        b = np.array(self.b, dtype=np.int64) + Ao @ bi + neg @ (si - 1)
        s = np.array(self.s, dtype=np.int64) + np.abs(Ao) @ (si - 1)
        return Projection.from_arrays(A, b, s)

    def to_json(self) -> dict:
        return {"A": [list(r) for r in self.A], "b": list(self.b), "s": list(self.s)}


def _matrix(p: Projection) -> np.ndarray:
    return np.array(p.A, dtype=np.int64).reshape(len(p.A), len(p.A[0]))


def project_boxes(p: Projection, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Images of ``n`` index boxes (rows of ``lo``/``hi``) under ``p`` by interval arithmetic.

    Row k: ``lo_k = b_k + Σ_j min(A_kj·lo_j, A_kj·(hi_j−1))`` and
    ``hi_k = b_k + s_k + Σ_j max(…)``. An empty index box gives an empty image at its low corner.
    """
    Ap, An, b, s = p.arrays
    last = hi - 1
    empty = np.any(hi <= lo, axis=1)
    out_lo = lo @ Ap.T + last @ An.T + b
    out_hi = last @ Ap.T + lo @ An.T + b + s
    if empty.any():
        out_lo[empty] = (lo[empty] @ (Ap + An).T) + b
        out_hi[empty] = out_lo[empty]
    return out_lo, out_hi


def identity_projection(rank: int) -> Projection:
    eye = tuple(tuple(int(r == c) for c in range(rank)) for r in range(rank))
    return Projection(eye, (0,) * rank, (1,) * rank)
