"""Elementwise kernels: unary maps and broadcasting binary arithmetic.

Index space = output shape; identity output projection. A broadcast input (size-1 or missing
leading dims) gets zero rows: every index point along that dim reads the same cell.
"""

from __future__ import annotations

from typing import Any, Mapping

from ir.kernels.base import (ELEMENTWISE, Kernel, Signature, SignatureError, TensorSpec, broadcast_shape,
                             gelu, identity_rows, unit_row, zero_row)
from ir.zspace import Projection, identity_projection


def elementwise_dims(rank: int) -> tuple[str, ...]:
    return tuple(f"d{i}" for i in range(rank))


def broadcast_projection(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> Projection:
    """Right-aligned numpy broadcasting as a projection (zero row where the input has size 1)."""
    n, r = len(out_shape), len(in_shape)
    rows = []
    for k in range(r):
        col = n - r + k
        rows.append(zero_row(n) if in_shape[k] == 1 and out_shape[col] != 1 else unit_row(n, col))
    return Projection(tuple(rows), (0,) * r, (1,) * r)


class Unary(Kernel):
    inputs = ("x",)
    properties = frozenset({ELEMENTWISE})
    kernel_class = "elementwise"
    flops = 1.0

    def base_signature(self, ins: Mapping[str, TensorSpec], params: Mapping[str, Any]) -> Signature:
        x = ins["x"]
        return Signature(elementwise_dims(len(x.shape)), x.shape, {"x": identity_projection(len(x.shape))},
                         identity_projection(len(x.shape)), x, self.flops)


class Relu(Unary):
    name = "relu"

    def compute(self, xp, blocks, params):
        return xp.maximum(blocks["x"], 0)


class Gelu(Unary):
    name = "gelu"
    flops = 8.0

    def compute(self, xp, blocks, params):
        return gelu(xp, blocks["x"])


class Exp(Unary):
    name = "exp"
    flops = 4.0

    def compute(self, xp, blocks, params):
        return xp.exp(blocks["x"])


class Tanh(Unary):
    name = "tanh"
    flops = 4.0

    def compute(self, xp, blocks, params):
        return xp.tanh(blocks["x"])


class Binary(Kernel):
    inputs = ("a", "b")
    properties = frozenset({ELEMENTWISE})
    kernel_class = "elementwise"

    def base_signature(self, ins: Mapping[str, TensorSpec], params: Mapping[str, Any]) -> Signature:
        a, b = ins["a"], ins["b"]
        out = broadcast_shape([a.shape, b.shape])
        return Signature(elementwise_dims(len(out)), out,
                         {"a": broadcast_projection(a.shape, out), "b": broadcast_projection(b.shape, out)},
                         identity_projection(len(out)), TensorSpec(out, a.dtype), 1.0)


class Add(Binary):
    name = "add"

    def compute(self, xp, blocks, params):
        return blocks["a"] + blocks["b"]


class Sub(Binary):
    name = "sub"

    def compute(self, xp, blocks, params):
        return blocks["a"] - blocks["b"]


class Mul(Binary):
    name = "mul"

    def compute(self, xp, blocks, params):
        return blocks["a"] * blocks["b"]


class Div(Binary):
    name = "div"

    def compute(self, xp, blocks, params):
        return blocks["a"] / blocks["b"]


KERNELS = (Relu, Gelu, Exp, Tanh, Add, Sub, Mul, Div)

__all__ = ["KERNELS", "broadcast_projection", "elementwise_dims", "SignatureError", "identity_rows"]
