"""Reductions: reduce_sum / reduce_mean / reduce_max over one dimension, reduce_to (sum down to a
broadcast shape: the gradient of broadcasting), expand (the gradient of a reduction), accumulate.

``accumulate`` combines partials ``p[k, *shape]`` over the leading block dimension with the
reduction's monoid; ``split_reduction`` inserts it after a partial op.
"""

from __future__ import annotations

import numpy as np

from ir.kernels.base import MONOIDS, Kernel, Reduction, Signature, SignatureError, TensorSpec, unit_row, zero_row
from ir.zspace import Projection, identity_projection


class ReduceOver(Kernel):
    inputs = ("x",)
    kernel_class = "reduction"
    params_defaults = {"dim": -1}
    monoid = "sum"

    def base_signature(self, ins, params):
        shape = ins["x"].shape
        if len(shape) < 2:
            raise SignatureError(f"{self.name} needs rank >= 2 (the output keeps the other dims), got {shape}")
        d = params["dim"]
        if not isinstance(d, int) or not -len(shape) <= d < len(shape):
            raise SignatureError(f"{self.name} dim {d!r} is out of range for shape {shape}")
        d %= len(shape)
        out = shape[:d] + shape[d + 1 :]
        n = len(out)
        rows, s = [], []
        for k in range(len(shape)):
            if k == d:
                rows.append(zero_row(n))
                s.append(shape[k])
            else:
                rows.append(unit_row(n, k if k < d else k - 1))
                s.append(1)
        return Signature(tuple(f"d{i}" for i in range(n)), out,
                         {"x": Projection(tuple(rows), (0,) * len(shape), tuple(s))},
                         identity_projection(n), TensorSpec(out, ins["x"].dtype), float(shape[d]),
                         (Reduction("r", shape[d], self.monoid, (("x", d),)),))

    def compute(self, xp, blocks, params):
        dim = params["dim"] % blocks["x"].ndim
        return xp.sum(blocks["x"], axis=dim) if self.monoid == "sum" else xp.max(blocks["x"], axis=dim)


class ReduceSum(ReduceOver):
    name = "reduce_sum"
    monoid = "sum"


class ReduceMax(ReduceOver):
    name = "reduce_max"
    monoid = "max"


class ReduceMean(ReduceOver):
    name = "reduce_mean"
    monoid = "sum"

    def compute(self, xp, blocks, params):
        dim = params["dim"] % blocks["x"].ndim
        return xp.sum(blocks["x"], axis=dim) / blocks["x"].shape[dim]

    def partial_compute(self, xp, blocks, params, block):
        # Each block sums its chunk; dividing by the whole extent makes the partials add up to the mean.
        dim = params["dim"] % blocks["x"].ndim
        return xp.sum(blocks["x"], axis=dim) / (blocks["x"].shape[dim] * params["split"]["parts"])


class ReduceTo(Kernel):
    """``y = Σ x`` over the dims that numpy broadcasting from ``shape`` to ``x.shape`` would add.

    ``shape`` is right-aligned against ``x``: leading dims of ``x`` beyond it, and dims where it
    has 1 and ``x`` has more, are summed (kept as size 1 in the second case). Every summed dim is a
    splittable ``sum`` reduction (``r<k>``, k the dim of ``x``), the batch first: the gradient of
    a bias is a reduction over the batch, so data-parallel synchronisation is ``split_reduction``.
    """

    name = "reduce_to"
    inputs = ("x",)
    kernel_class = "reduction"
    params_defaults = {"shape": None}

    def base_signature(self, ins, params):
        x = ins["x"].shape
        shape = params["shape"]
        if not isinstance(shape, (list, tuple)) or not shape or len(shape) > len(x) or \
                any(not isinstance(v, int) for v in shape):
            raise SignatureError(f"reduce_to shape {shape!r} must be a list of at most {len(x)} integers")
        shape = tuple(shape)
        lead = len(x) - len(shape)
        rows, s, reds = [], [], []
        n = len(shape)
        for k, ext in enumerate(x):
            col = k - lead
            if col >= 0 and shape[col] == ext:
                rows.append(unit_row(n, col))
                s.append(1)
            elif col < 0 or shape[col] == 1:
                rows.append(zero_row(n))
                s.append(ext)
                reds.append(Reduction(f"r{k}", ext, "sum", (("x", k),)))
            else:
                raise SignatureError(f"reduce_to cannot sum x{list(x)} down to {list(shape)} (dim {k})")
        summed = float(np.prod([r.extent for r in reds])) if reds else 1.0
        return Signature(tuple(f"d{i}" for i in range(n)), shape,
                         {"x": Projection(tuple(rows), (0,) * len(x), tuple(s))},
                         identity_projection(n), TensorSpec(shape, ins["x"].dtype), summed, tuple(reds))

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        shape = tuple(params["shape"])
        lead = x.ndim - len(shape)
        if lead:
            x = xp.sum(x, axis=tuple(range(lead)))
        keep = tuple(i for i, e in enumerate(shape) if e == 1 and x.shape[i] != 1)
        return xp.sum(x, axis=keep, keepdims=True) if keep else x


class Expand(Kernel):
    """``y`` = ``x`` with a new dim inserted at ``dim`` and repeated ``size`` times (the gradient of
    reducing over that dim)."""

    name = "expand"
    inputs = ("x",)
    kernel_class = "elementwise"
    params_defaults = {"dim": 0, "size": 1}

    def base_signature(self, ins, params):
        x = ins["x"].shape
        d, size = params["dim"], params["size"]
        if not isinstance(d, int) or not 0 <= d <= len(x) or not isinstance(size, int) or size < 1:
            raise SignatureError(f"expand needs 0 <= dim <= {len(x)} and size >= 1, got dim={d!r}, size={size!r}")
        out = x[:d] + (size,) + x[d:]
        n = len(out)
        rows = tuple(unit_row(n, k if k < d else k + 1) for k in range(len(x)))
        return Signature(tuple(f"d{i}" for i in range(n)), out,
                         {"x": Projection(rows, (0,) * len(x), (1,) * len(x))},
                         identity_projection(n), TensorSpec(out, ins["x"].dtype), 0.0)

    def run(self, xp, blocks, params, box, sig):
        # The block's extent along the new dim is the shard's, not ``size``: read it off the box.
        x = xp.expand_dims(blocks["x"], params["dim"])
        return xp.broadcast_to(x, box.shape).copy()


class Accumulate(Kernel):
    """``y[*s] = monoid_k p[k, *s]``: combines the partials of a split reduction."""

    name = "accumulate"
    inputs = ("p",)
    kernel_class = "elementwise"
    params_defaults = {"monoid": "sum"}

    def base_signature(self, ins, params):
        shape = ins["p"].shape
        if params["monoid"] not in MONOIDS:
            raise SignatureError(f"accumulate monoid {params['monoid']!r} is not one of {list(MONOIDS)}")
        if len(shape) < 2:
            raise SignatureError(f"accumulate needs partials p[k, ...] of rank >= 2, got {shape}")
        out = shape[1:]
        n = len(out)
        rows = (zero_row(n),) + tuple(unit_row(n, c) for c in range(n))
        return Signature(tuple(f"d{i}" for i in range(n)), out,
                         {"p": Projection(rows, (0,) * len(shape), (shape[0],) + (1,) * n)},
                         identity_projection(n), TensorSpec(out, ins["p"].dtype), float(shape[0] - 1),
                         # the block dim is itself splittable: a two-level reduction (inside a node,
                         # then across nodes) is split_reduction of the accumulate
                         (Reduction("k", shape[0], params["monoid"], (("p", 0),)),))

    def compute(self, xp, blocks, params):
        p = blocks["p"]
        return xp.sum(p, axis=0) if params["monoid"] == "sum" else xp.max(p, axis=0)


KERNELS = (ReduceSum, ReduceMean, ReduceMax, ReduceTo, Expand, Accumulate)
