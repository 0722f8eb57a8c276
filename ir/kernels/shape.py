"""``reshape``: a view of the same row-major cells under another shape, sharded as a projection.

Both shapes cut the flat (row-major) index at the suffix products of their dims. Their *common
refinement* cuts at the union of those boundaries: each refinement dim is a run of cells both
shapes agree on, and every tensor dim of either shape is a group of consecutive refinement dims.
The index dims are the refinement dims that are the *outermost* member of their group in both
shapes; the inner members are read and written whole (hidden in the projection shapes). Then a
tensor dim whose outermost member is an index dim ``j`` projects as ``[st·j, st·j + st)`` with
``st`` the product of its inner members, and any box of the index space maps to one contiguous,
exact box of both tensors. Examples (index dims in capitals):

- split the last dim ``[B, S, D] -> [B, S, H, Dh]``: index ``(B, S, H)``, ``D = Dh·H + e``: heads
  shard exactly as Megatron's attention needs;
- merge ``[B, S, H, Dh] -> [B, S, D]``: the same index space, read in the other direction;
- ``[N, C, 1, 1] -> [N, C]`` (Flatten/Squeeze): index ``(N, C)``; size-1 dims get zero rows.

When the boundaries do not nest (``[6, 4] -> [4, 6]``: 24 = 6·4 = 4·6 with cut 4 inside the
first 6), no refinement exists; then the index dims are the leading dims both shapes share and
the rest is one hidden block.

``params = {"shape": out_shape, "from": in_shape}``: ``from`` repeats the input shape so that
``compute`` (which sees only blocks, e.g. as stage 0 of a fused op) can rebuild the block's
output shape from the input block's.
"""

from __future__ import annotations

import math
from typing import Sequence

from ir.kernels.base import Kernel, Signature, SignatureError, TensorSpec, unit_row, zero_row
from ir.zspace import Projection


def _suffix(shape: Sequence[int]) -> list[int]:
    """Suffix products: element k is the number of cells under dims k.. (last one: 1)."""
    out = [1] * (len(shape) + 1)
    for k in range(len(shape) - 1, -1, -1):
        out[k] = out[k + 1] * shape[k]
    return out


def _groups(shape: Sequence[int], cuts: list[int]) -> list[list[int]] | None:
    """For each tensor dim, the refinement dims (indices into ``cuts``, outermost first) it covers."""
    suf = _suffix(shape)
    out = []
    for k in range(len(shape)):
        if shape[k] == 1:
            out.append([])
            continue
        members = [j for j in range(len(cuts) - 1) if suf[k + 1] <= cuts[j] and cuts[j + 1] <= suf[k]]
        out.append(sorted(members, key=lambda j: -cuts[j]))
    return out


def reshape_layout(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[list[int], dict[int, int], list, list]:
    """``(extents, index_of, src_rows, dst_rows)``: index dim extents, refinement dim -> index
    column, and per tensor dim ``(index column or None, stride st, full size)``."""
    bounds = sorted(set(_suffix(src)) | set(_suffix(dst)))
    # refinement dim j spans cells [bounds[j], bounds[j + 1]) of stride bounds[j]
    if any(b2 % b1 for b1, b2 in zip(bounds, bounds[1:])):
        return _prefix_layout(src, dst)
    cuts = bounds  # ascending: refinement dim j has inner stride cuts[j] and size cuts[j+1]/cuts[j]
    gs, gd = _groups(src, cuts), _groups(dst, cuts)
    outer = {g[0] for g in gs if g} & {g[0] for g in gd if g}
    order = sorted(outer, key=lambda j: -cuts[j])  # outermost first: the index space reads like dst
    index_of = {j: c for c, j in enumerate(order)}
    extents = [cuts[j + 1] // cuts[j] for j in order]

    def rows(shape: tuple[int, ...], groups: list[list[int]]) -> list:
        suf = _suffix(shape)
        out = []
        for k, g in enumerate(groups):
            if g and g[0] in index_of:
                out.append((index_of[g[0]], cuts[g[0]] // suf[k + 1], shape[k]))
            else:
                out.append((None, shape[k], shape[k]))
        return out

    return extents, index_of, rows(src, gs), rows(dst, gd)


def _prefix_layout(src, dst):
    k = 0
    while k < min(len(src), len(dst)) and src[k] == dst[k]:
        k += 1
    rows_s = [(c, 1, src[c]) if c < k else (None, src[c], src[c]) for c in range(len(src))]
    rows_d = [(c, 1, dst[c]) if c < k else (None, dst[c], dst[c]) for c in range(len(dst))]
    return list(src[:k]), {}, rows_s, rows_d


def _projection(rows: list, n: int) -> Projection:
    A, s = [], []
    for col, st, size in rows:
        if col is None:
            A.append(zero_row(n))
            s.append(size)
        else:
            A.append(tuple(st * v for v in unit_row(n, col)))
            s.append(st)
    return Projection(tuple(A), (0,) * len(rows), tuple(s))


class Reshape(Kernel):
    name = "reshape"
    inputs = ("x",)
    kernel_class = "elementwise"
    params_defaults = {"shape": None, "from": None}

    def _shapes(self, ins, params) -> tuple[tuple[int, ...], tuple[int, ...]]:
        src = ins["x"].shape
        dst, frm = params["shape"], params["from"]
        if not isinstance(dst, (list, tuple)) or not dst or any(not isinstance(v, int) or v < 1 for v in dst):
            raise SignatureError(f"reshape shape {dst!r} must be a non-empty list of positive integers")
        if frm is not None and tuple(frm) != src:
            raise SignatureError(f"reshape params.from {list(frm)} differs from the input's shape {list(src)}")
        if math.prod(dst) != math.prod(src):
            raise SignatureError(f"reshape cannot turn {list(src)} ({math.prod(src)} cells) into {list(dst)} "
                                 f"({math.prod(dst)} cells)")
        return src, tuple(dst)

    def base_signature(self, ins, params):
        src, dst = self._shapes(ins, params)
        extents, _, rs, rd = reshape_layout(src, dst)
        n = len(extents)
        return Signature(tuple(f"r{c}" for c in range(n)), tuple(extents), {"x": _projection(rs, n)},
                         _projection(rd, n), TensorSpec(dst, ins["x"].dtype), 0.0)

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        src, dst = tuple(params["from"]), tuple(params["shape"])
        extents, _, rs, rd = reshape_layout(src, dst)
        count = [0] * len(extents)
        for (col, st, _), ext in zip(rs, x.shape):  # the box's extent per index dim, off the input block
            if col is not None:
                count[col] = ext // st
        shape = tuple(size if col is None else count[col] * st for col, st, size in rd)
        return xp.reshape(x, shape)


KERNELS = (Reshape,)
