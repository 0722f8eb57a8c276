"""Elementwise math that imported programs use: sigmoid, sqrt, reciprocal, erf, exact GELU, pow.

Same index space and projections as ``ir.kernels.elementwise.Unary`` (identity), so they shard,
fuse and verify like the built-in unary maps. ``gelu_erf`` is the exact GELU
``0.5·x·(1 + erf(x/√2))`` (Hendrycks & Gimpel 2016, eq. 1), which ONNX exports of BERT and GPT-2
spell as an Erf subgraph; the built-in ``gelu`` is the tanh approximation and differs by up to
~1e-3, too much for an import that must equal the ONNX reference.
"""

from __future__ import annotations

import math
from typing import Any

from ir.kernels.base import SignatureError
from ir.kernels.elementwise import Unary


def erf(xp: Any, x: Any) -> Any:
    """The error function on NumPy (SciPy) or CuPy (cupyx), elementwise."""
    if xp.__name__ == "numpy":
        from scipy.special import erf as _erf  # noqa: PLC0415  (SciPy is a dependency; imported when used)

        return _erf(x).astype(x.dtype, copy=False)
    from cupyx.scipy.special import erf as _cerf  # noqa: PLC0415  (optional GPU dependency)

    return _cerf(x)


class Sigmoid(Unary):
    name = "sigmoid"
    flops = 4.0

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        return 1.0 / (1.0 + xp.exp(-x))


class Sqrt(Unary):
    name = "sqrt"
    flops = 1.0

    def compute(self, xp, blocks, params):
        return xp.sqrt(blocks["x"])


class Reciprocal(Unary):
    name = "reciprocal"

    def compute(self, xp, blocks, params):
        return 1.0 / blocks["x"]


class Erf(Unary):
    name = "erf"
    flops = 8.0

    def compute(self, xp, blocks, params):
        return erf(xp, blocks["x"])


class GeluErf(Unary):
    """Exact GELU ``0.5·x·(1 + erf(x/√2))``."""

    name = "gelu_erf"
    flops = 10.0

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        return 0.5 * x * (1.0 + erf(xp, x * (1.0 / math.sqrt(2.0))))


class Pow(Unary):
    """``x ** exponent`` for a constant exponent (``Pow(x, 2)`` of RMSNorm and LayerNorm exports)."""

    name = "pow"
    flops = 2.0
    params_defaults = {"exponent": 2.0}

    def base_signature(self, ins, params):
        if not isinstance(params["exponent"], (int, float)) or isinstance(params["exponent"], bool):
            raise SignatureError(f"pow exponent must be a number, got {params['exponent']!r}")
        return super().base_signature(ins, params)

    def compute(self, xp, blocks, params):
        e = params["exponent"]
        x = blocks["x"]
        return x * x if e == 2 else xp.power(x, x.dtype.type(e))


KERNELS = (Sigmoid, Sqrt, Reciprocal, Erf, GeluErf, Pow)
