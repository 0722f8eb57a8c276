"""Row-wise kernels over the last dimension: softmax, log-softmax, layernorm, rmsnorm and their backward.

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


class LogSoftmax(Softmax):
    """``x - logsumexp(x)`` over the last dimension (the log-probabilities of a classifier head),
    shifted by the row's maximum so no ``exp`` overflows; softmax's index space and cost."""

    name = "log_softmax"

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        s = x - xp.max(x, axis=-1, keepdims=True)
        return s - xp.log(xp.sum(xp.exp(s), axis=-1, keepdims=True))


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
        vec = _vector(x.shape)
        return _row_signature(x, 8.0, {"gamma": vec, "beta": vec})

    def compute(self, xp, blocks, params):
        return normalized(xp, blocks["x"], "layer", params["eps"]) * blocks["gamma"] + blocks["beta"]


class RMSNorm(Kernel):
    """``x / sqrt(mean(x²) + eps) · gamma`` over the last dimension (Zhang & Sennrich 2019)."""

    name = "rmsnorm"
    inputs = ("x", "gamma")
    kernel_class = "rowwise"
    params_defaults = {"eps": 1e-6}

    def base_signature(self, ins, params):
        x = ins["x"]
        n = x.shape[-1]
        if ins["gamma"].shape != (n,):
            raise SignatureError(f"rmsnorm gamma must have shape ({n},), got {ins['gamma'].shape}")
        return _row_signature(x, 4.0, {"gamma": _vector(x.shape)})

    def compute(self, xp, blocks, params):
        return normalized(xp, blocks["x"], "rms", params["eps"]) * blocks["gamma"]


def _vector(shape: tuple[int, ...]) -> Projection:
    """Every row reads the whole per-feature vector (gamma, beta)."""
    return Projection((zero_row(len(shape) - 1),), (0,), (shape[-1],))


def normalized(xp, x, kind: str, eps: float):
    """``x̂``: (x - mean)/std for layernorm, x/rms for rmsnorm, over the last axis."""
    if kind == "rms":
        return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)
    mu = xp.mean(x, axis=-1, keepdims=True)
    return (x - mu) / xp.sqrt(xp.mean((x - mu) ** 2, axis=-1, keepdims=True) + eps)


class Normalize(Kernel):
    """``x̂`` of layernorm (``kind="layer"``) or rmsnorm (``kind="rms"``): what the gamma gradient reads."""

    name = "normalize"
    inputs = ("x",)
    kernel_class = "rowwise"
    params_defaults = {"kind": "layer", "eps": 1e-5}

    def base_signature(self, ins, params):
        if params["kind"] not in ("layer", "rms"):
            raise SignatureError(f"normalize kind {params['kind']!r} must be 'layer' or 'rms'")
        return _row_signature(ins["x"], 5.0, {})

    def compute(self, xp, blocks, params):
        return normalized(xp, blocks["x"], params["kind"], params["eps"])


class RowGrad(Kernel):
    """Backward of a row-wise kernel: every port reads whole rows of a tensor shaped like ``dy``."""

    kernel_class = "rowwise"
    flops = 8.0

    def base_signature(self, ins, params):
        dy = ins["dy"]
        extra = {}
        for port in self.inputs[1:]:
            spec = ins[port]
            if port == "gamma":
                if spec.shape != dy.shape[-1:]:
                    raise SignatureError(f"{self.name} gamma must have shape ({dy.shape[-1]},), got {spec.shape}")
                extra[port] = _vector(dy.shape)
            elif spec.shape != dy.shape:
                raise SignatureError(f"{self.name} needs {port} shaped like dy {dy.shape}, got {spec.shape}")
            else:
                extra[port] = row_projection(dy.shape)
        sig = _row_signature(dy, self.flops, extra)
        return Signature(sig.dims, sig.extents, {"dy": sig.inputs["x"], **extra}, sig.output, sig.out_spec,
                         sig.flops_per_point)


class SoftmaxGrad(RowGrad):
    """``dx = y · (dy - Σ dy·y)`` with ``y`` the softmax output."""

    name = "softmax_grad"
    inputs = ("dy", "y")

    def compute(self, xp, blocks, params):
        dy, y = blocks["dy"], blocks["y"]
        return y * (dy - xp.sum(dy * y, axis=-1, keepdims=True))


class LogSoftmaxGrad(RowGrad):
    """``dx = dy - softmax(x) · Σ dy`` with ``softmax(x) = exp(y)``, ``y`` the log-softmax output."""

    name = "log_softmax_grad"
    inputs = ("dy", "y")

    def compute(self, xp, blocks, params):
        dy, y = blocks["dy"], blocks["y"]
        return dy - xp.exp(y) * xp.sum(dy, axis=-1, keepdims=True)


class NormGrad(RowGrad):
    """``dx`` of layernorm / rmsnorm from ``dy``, the forward input ``x`` and ``gamma``.

    With ``g = dy·gamma`` and ``r = 1/std`` (or ``1/rms``): layernorm
    ``dx = r·(g - mean(g) - x̂·mean(g·x̂))``, rmsnorm ``dx = r·(g - x̂·mean(g·x̂))``.
    """

    name = "norm_grad"
    inputs = ("dy", "x", "gamma")
    params_defaults = {"kind": "layer", "eps": 1e-5}

    def compute(self, xp, blocks, params):
        x, g = blocks["x"], blocks["dy"] * blocks["gamma"]
        eps = params["eps"]
        if params["kind"] == "rms":
            r = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)
            xh = x * r
            return r * (g - xh * xp.mean(g * xh, axis=-1, keepdims=True))
        mu = xp.mean(x, axis=-1, keepdims=True)
        r = 1.0 / xp.sqrt(xp.mean((x - mu) ** 2, axis=-1, keepdims=True) + eps)
        xh = (x - mu) * r
        return r * (g - xp.mean(g, axis=-1, keepdims=True) - xh * xp.mean(g * xh, axis=-1, keepdims=True))


KERNELS = (Softmax, LogSoftmax, LayerNorm, RMSNorm, Normalize, SoftmaxGrad, LogSoftmaxGrad, NormGrad)
