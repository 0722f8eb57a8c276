"""Row-wise kernels over the last dimension: softmax and layernorm.

The last dimension is read whole by every index point (it hides in the projection shape), so
it cannot be split: the index space is the leading dims only.
"""

from __future__ import annotations

from typing import Mapping

from ir.kernels.base import Kernel, Signature, SignatureError, TensorSpec, identity_rows, zero_row
from ir.zspace import Projection


def row_projection(shape: tuple[int, ...]) -> Projection:
    lead = len(shape) - 1
    rows = identity_rows(lead, lead) + (zero_row(lead),)
    return Projection(rows, (0,) * len(shape), (1,) * lead + (shape[-1],))


def _row_signature(x: TensorSpec, flops_per_elem: float, extra: Mapping[str, Projection]) -> Signature:
    lead = len(x.shape) - 1
    return Signature(tuple(f"d{i}" for i in range(lead)), x.shape[:-1], {"x": row_projection(x.shape), **extra},
                     row_projection(x.shape), x, flops_per_elem * x.shape[-1])


class Softmax(Kernel):
    name = "softmax"
    inputs = ("x",)
    kernel_class = "rowwise"

    def base_signature(self, ins, params):
        return _row_signature(ins["x"], 5.0, {})

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        e = xp.exp(x - xp.max(x, axis=-1, keepdims=True))
        return e / xp.sum(e, axis=-1, keepdims=True)


class LayerNorm(Kernel):
    """``(x - mean) / sqrt(var + eps) · gamma + beta`` over the last dimension."""

    name = "layernorm"
    inputs = ("x", "gamma", "beta")
    kernel_class = "rowwise"
    params_defaults = {"eps": 1e-5}

    def base_signature(self, ins, params):
        x = ins["x"]
        n = x.shape[-1]
        for port in ("gamma", "beta"):
            if ins[port].shape != (n,):
                raise SignatureError(f"layernorm {port} must have shape ({n},), got {ins[port].shape}")
        lead = len(x.shape) - 1
        vec = Projection((zero_row(lead),), (0,), (n,))
        return _row_signature(x, 8.0, {"gamma": vec, "beta": vec})

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        mu = xp.mean(x, axis=-1, keepdims=True)
        var = xp.mean((x - mu) ** 2, axis=-1, keepdims=True)
        return (x - mu) / xp.sqrt(var + params["eps"]) * blocks["gamma"] + blocks["beta"]


KERNELS = (Softmax, LayerNorm)
