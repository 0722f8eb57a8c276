"""Elementwise math that imported programs use: sigmoid, sqrt, reciprocal, erf, exact GELU, pow,
clip, leaky ReLU, softplus, abs, log, ELU, Mish.

Same index space and projections as ``ir.kernels.elementwise.Unary`` (identity), so they shard,
fuse and verify like the built-in unary maps. ``gelu_erf`` is the exact GELU
``0.5·x·(1 + erf(x/√2))`` (Hendrycks & Gimpel 2016, eq. 1), which ONNX exports of BERT and GPT-2
spell as an Erf subgraph; the built-in ``gelu`` is the tanh approximation and differs by up to
~1e-3, too much for an import that must equal the ONNX reference.

Constants are parameters of the op, never tensors: ``pow``'s exponent, ``clip``'s bounds (``None``
where a side is unbounded: ``torch.clamp(x, min=0)``), ``leaky_relu``'s slope, ``elu``'s ``alpha``.
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


def _number(kernel: str, name: str, v: Any, optional: bool = False) -> None:
    """A parameter that must be a finite number (``None`` allowed when ``optional``)."""
    if v is None and optional:
        return
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        what = "a finite number or None (unbounded)" if optional else "a finite number"
        raise SignatureError(f"{kernel} {name} must be {what}, got {v!r}")


def check_clip_bounds(kernel: str, params: Any) -> None:
    """``min`` and ``max`` of ``clip`` and ``clip_grad``: finite numbers, or ``None``."""
    _number(kernel, "min", params["min"], optional=True)
    _number(kernel, "max", params["max"], optional=True)


def check_slope(kernel: str, params: Any) -> None:
    """``alpha`` of ``leaky_relu``, ``elu`` and their gradients: a finite number."""
    _number(kernel, "alpha", params["alpha"])


class Clip(Unary):
    """``min(max(x, min), max)``, ONNX's ``Clip`` (``torch.clamp``, ``ReLU6``, ``Hardtanh``); a bound
    of ``None`` is no bound. With ``min > max`` every cell is ``max``, as ONNX and torch say."""

    name = "clip"
    flops = 2.0
    params_defaults = {"min": None, "max": None}

    def base_signature(self, ins, params):
        check_clip_bounds(self.name, params)
        return super().base_signature(ins, params)

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        if params["min"] is not None:
            x = xp.maximum(x, x.dtype.type(params["min"]))
        if params["max"] is not None:
            x = xp.minimum(x, x.dtype.type(params["max"]))
        return x


class LeakyRelu(Unary):
    """``x`` where ``x > 0``, else ``alpha·x`` (ONNX's default slope 0.01, PyTorch's too)."""

    name = "leaky_relu"
    flops = 2.0
    params_defaults = {"alpha": 0.01}

    def base_signature(self, ins, params):
        check_slope(self.name, params)
        return super().base_signature(ins, params)

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        return xp.where(x > 0, x, x * x.dtype.type(params["alpha"]))


class Softplus(Unary):
    """``log(1 + eˣ)`` as ``logaddexp(0, x)``: no overflow for large ``x`` (where it is ``x``), no
    lost digits for very negative ``x`` (where it is ``eˣ``)."""

    name = "softplus"
    flops = 4.0

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        return xp.logaddexp(x.dtype.type(0), x)


class Abs(Unary):
    name = "abs"

    def compute(self, xp, blocks, params):
        return xp.abs(blocks["x"])


class Log(Unary):
    """The natural logarithm (``-inf`` at 0 and NaN below, as NumPy's, ONNX's and torch's)."""

    name = "log"
    flops = 4.0

    def compute(self, xp, blocks, params):
        return xp.log(blocks["x"])


class Elu(Unary):
    """``x`` where ``x > 0``, else ``alpha·(eˣ - 1)`` (ONNX's and PyTorch's default ``alpha`` 1.0),
    the ``eˣ - 1`` as ``expm1`` of ``min(x, 0)``: exact near 0, no overflow in the branch not taken."""

    name = "elu"
    flops = 4.0
    params_defaults = {"alpha": 1.0}

    def base_signature(self, ins, params):
        check_slope(self.name, params)
        return super().base_signature(ins, params)

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        neg = xp.expm1(xp.minimum(x, x.dtype.type(0))) * x.dtype.type(params["alpha"])
        return xp.where(x > 0, x, neg)


class Mish(Unary):
    """``x·tanh(softplus(x))`` (Misra 2019), the softplus as ``logaddexp(0, x)`` like ``softplus``'s."""

    name = "mish"
    flops = 8.0

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        return x * xp.tanh(xp.logaddexp(x.dtype.type(0), x))


KERNELS = (Sigmoid, Sqrt, Reciprocal, Erf, GeluErf, Pow, Clip, LeakyRelu, Softplus, Abs, Log, Elu, Mish)
