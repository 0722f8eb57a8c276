"""Elementwise kernels: unary maps and broadcasting binary arithmetic.

Index space = output shape; identity output projection. A broadcast input (size-1 or missing
leading dims) gets zero rows: every index point along that dim reads the same cell.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ir.kernels.base import (ELEMENTWISE, FLOAT_DTYPES, Kernel, Signature, SignatureError, TensorSpec, broadcast_shape,
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


class Silu(Unary):
    """``x · sigmoid(x)`` (SiLU / swish; Elfwing et al. 2018), the gate of SwiGLU."""

    name = "silu"
    flops = 5.0

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        return x / (1.0 + xp.exp(-x))


class Scale(Unary):
    """``alpha · x``: negation and constant factors of the backward."""

    name = "scale"
    params_defaults = {"alpha": 1.0}

    def compute(self, xp, blocks, params):
        return blocks["x"] * params["alpha"]


class Cast(Unary):
    """``x`` converted to ``params["dtype"]`` (mixed precision: fp32 master weights -> bf16 copies)."""

    name = "cast"
    flops = 0.0
    params_defaults = {"dtype": "float32"}

    def base_signature(self, ins, params):
        if params["dtype"] not in FLOAT_DTYPES:
            raise SignatureError(f"cast dtype {params['dtype']!r} must be one of {list(FLOAT_DTYPES)}")
        sig = super().base_signature(ins, params)
        return Signature(sig.dims, sig.extents, sig.inputs, sig.output,
                         TensorSpec(sig.out_spec.shape, params["dtype"]), sig.flops_per_point)

    def compute(self, xp, blocks, params):
        return blocks["x"].astype(exec_dtype(xp, params["dtype"]))


class IndexToFloat(Kernel):
    """``int32`` values as floats of ``params["dtype"]``: ONNX's ``Cast`` of a computed integer
    tensor (BERT's padding mask, ``(1 - mask.float()) * -10000``). Its input is an index port, so
    autodiff never differentiates it; it is not marked elementwise, so fusion leaves it alone."""

    name = "index_to_float"
    inputs = ("x",)
    index_ports = ("x",)
    kernel_class = "elementwise"
    params_defaults = {"dtype": "float32"}

    def base_signature(self, ins, params):
        if params["dtype"] not in FLOAT_DTYPES:
            raise SignatureError(f"index_to_float dtype {params['dtype']!r} must be one of {list(FLOAT_DTYPES)}")
        n = len(ins["x"].shape)
        return Signature(elementwise_dims(n), ins["x"].shape, {"x": identity_projection(n)}, identity_projection(n),
                         TensorSpec(ins["x"].shape, params["dtype"]), 0.0)

    def compute(self, xp, blocks, params):
        return blocks["x"].astype(exec_dtype(xp, params["dtype"]))


class FloatToIndex(Kernel):
    """Integer-valued floats as ``int32`` (rounded to the nearest, exact below 2^24 in float32):
    ids an imported model computes from ids (RoBERTa's positions, ``cumsum(ids != pad) * mask +
    pad``) for an embedding lookup. Nothing differentiates through it (its output is an index)."""

    name = "float_to_index"
    inputs = ("x",)
    kernel_class = "elementwise"

    def base_signature(self, ins, params):
        n = len(ins["x"].shape)
        return Signature(elementwise_dims(n), ins["x"].shape, {"x": identity_projection(n)}, identity_projection(n),
                         TensorSpec(ins["x"].shape, "int32"), 0.0)

    def compute(self, xp, blocks, params):
        return xp.rint(blocks["x"]).astype(xp.int32)


def exec_dtype(xp: Any, dtype: str) -> Any:
    # bfloat16 executes as float32 (NumPy and CuPy have no bfloat16), as in ``executor.backend``.
    return xp.float32 if dtype == "bfloat16" else getattr(xp, dtype)


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


class GradBinary(Kernel):
    """``dx = dy · f'(x)`` for a unary ``f``: ports ``dy`` and ``x`` (or the forward output)."""

    inputs = ("dy", "x")
    properties = frozenset({ELEMENTWISE})
    kernel_class = "elementwise"
    flops = 4.0

    def base_signature(self, ins, params):
        dy, x = ins["dy"], ins["x"]
        if dy.shape != x.shape:
            raise SignatureError(f"{self.name} needs dy and x of one shape, got {dy.shape} and {x.shape}")
        n = len(x.shape)
        return Signature(elementwise_dims(n), x.shape, {"dy": identity_projection(n), "x": identity_projection(n)},
                         identity_projection(n), dy, self.flops)


class ReluGrad(GradBinary):
    name = "relu_grad"

    def compute(self, xp, blocks, params):
        return blocks["dy"] * (blocks["x"] > 0)


class GeluGrad(GradBinary):
    """Derivative of the tanh-approximated GELU of ``ir.kernels.base.gelu``."""

    name = "gelu_grad"

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        c = math.sqrt(2.0 / math.pi)
        t = xp.tanh(c * (x + 0.044715 * x * x * x))
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x * x)
        return blocks["dy"] * d


class SiluGrad(GradBinary):
    name = "silu_grad"

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        sg = 1.0 / (1.0 + xp.exp(-x))
        return blocks["dy"] * sg * (1.0 + x * (1.0 - sg))


class TanhGrad(GradBinary):
    """Reads the forward *output* ``y = tanh(x)`` on port ``x``: ``dx = dy · (1 - y²)``."""

    name = "tanh_grad"

    def compute(self, xp, blocks, params):
        y = blocks["x"]
        return blocks["dy"] * (1.0 - y * y)


KERNELS = (Relu, Gelu, Exp, Tanh, Silu, Scale, Cast, IndexToFloat, FloatToIndex, Add, Sub, Mul, Div, ReluGrad, GeluGrad,
           SiluGrad, TanhGrad)

__all__ = ["KERNELS", "broadcast_projection", "elementwise_dims", "SignatureError", "identity_rows"]
