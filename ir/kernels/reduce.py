"""Reductions: reduce_sum / reduce_max over one dimension, and accumulate.

``accumulate`` combines partials ``p[k, *shape]`` over the leading block dimension with the
reduction's monoid; ``split_reduction`` inserts it after a partial op.
"""

from __future__ import annotations

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
                         identity_projection(n), TensorSpec(out, ins["p"].dtype), float(shape[0] - 1))

    def compute(self, xp, blocks, params):
        p = blocks["p"]
        return xp.sum(p, axis=0) if params["monoid"] == "sum" else xp.max(p, axis=0)


KERNELS = (ReduceSum, ReduceMax, Accumulate)
