"""Gradients of the imported-program math kernels (``ir.kernels.mathfn``) and of ``where``.

Each ``*_grad(dy, x)`` computes ``dy · f'(·)`` elementwise from the forward input, or from the
forward output where that is cheaper (the port is still called ``x``; the rule in
``ir.autodiff.rules`` says which tensor it passes): sigmoid ``y(1-y)``, sqrt ``1/(2y)``,
reciprocal ``-y²``, erf ``2/√π·e^{-x²}``, exact GELU ``Φ(x) + x·φ(x)``, pow ``p·x^{p-1}``,
clip ``1`` where ``min <= x <= max`` (bounds included, as ``torch.clamp``'s backward), leaky ReLU
``1`` or ``alpha``, softplus ``sigmoid(x)``, abs ``sign(x)``, log ``1/x``, ELU ``1`` or
``alpha·eˣ``, Mish ``tanh(sp) + x·sigmoid(x)·(1 - tanh(sp)²)`` with ``sp = softplus(x)``. At the
kinks the values are torch's: abs ``0`` at ``x == 0``, ELU ``alpha`` at ``x == 0``.
``where_grad(dy, c)`` passes ``dy`` where the condition picks the branch (``take="a"``:
``c != 0``; ``"b"``: ``c == 0``) and 0 elsewhere, with ``c`` broadcast to ``dy``.
"""

from __future__ import annotations

import math

from ir.kernels.base import ELEMENTWISE, Kernel, Signature, SignatureError, TensorSpec
from ir.kernels.elementwise import GradBinary, broadcast_projection, elementwise_dims
from ir.kernels.mathfn import check_clip_bounds, check_slope, erf
from ir.zspace import identity_projection


class SigmoidGrad(GradBinary):
    name = "sigmoid_grad"

    def compute(self, xp, blocks, params):
        y = blocks["x"]
        return blocks["dy"] * y * (1.0 - y)


class SqrtGrad(GradBinary):
    name = "sqrt_grad"

    def compute(self, xp, blocks, params):
        return blocks["dy"] * 0.5 / blocks["x"]


class ReciprocalGrad(GradBinary):
    name = "reciprocal_grad"

    def compute(self, xp, blocks, params):
        y = blocks["x"]
        return -blocks["dy"] * y * y


class ErfGrad(GradBinary):
    name = "erf_grad"

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        return blocks["dy"] * (2.0 / math.sqrt(math.pi)) * xp.exp(-x * x)


class GeluErfGrad(GradBinary):
    name = "gelu_erf_grad"

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        cdf = 0.5 * (1.0 + erf(xp, x * (1.0 / math.sqrt(2.0))))
        pdf = xp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
        return blocks["dy"] * (cdf + x * pdf)


class PowGrad(GradBinary):
    name = "pow_grad"
    params_defaults = {"exponent": 2.0}

    def compute(self, xp, blocks, params):
        e = params["exponent"]
        x = blocks["x"]
        return blocks["dy"] * (e * x if e == 2 else e * xp.power(x, x.dtype.type(e - 1)))


class ClipGrad(GradBinary):
    """``dy`` where ``min <= x <= max``, else 0 (an absent bound passes everything on its side).

    The bounds themselves pass ``dy``: that is what ``torch.autograd`` does for ``torch.clamp``
    (at ``x == min`` exactly its gradient is 1, checked on torch 2.13). ``F.relu6`` and
    ``F.hardtanh`` export to the same ONNX ``Clip`` but their own backward gives 0 at the
    bounds; the import cannot tell them apart, so those differ from torch at exactly ``x == min``
    or ``x == max`` (a set of measure zero for float activations)."""

    name = "clip_grad"
    params_defaults = {"min": None, "max": None}

    def base_signature(self, ins, params):
        check_clip_bounds(self.name, params)
        return super().base_signature(ins, params)

    def compute(self, xp, blocks, params):
        x, dy = blocks["x"], blocks["dy"]
        keep = xp.ones(x.shape, dtype=bool)
        if params["min"] is not None:
            keep &= x >= x.dtype.type(params["min"])
        if params["max"] is not None:
            keep &= x <= x.dtype.type(params["max"])
        return xp.where(keep, dy, xp.zeros_like(dy))


class LeakyReluGrad(GradBinary):
    """``dy`` where ``x > 0``, else ``alpha·dy`` (at ``x == 0`` the slope is ``alpha``, as torch's)."""

    name = "leaky_relu_grad"
    params_defaults = {"alpha": 0.01}

    def base_signature(self, ins, params):
        check_slope(self.name, params)
        return super().base_signature(ins, params)

    def compute(self, xp, blocks, params):
        x, dy = blocks["x"], blocks["dy"]
        return xp.where(x > 0, dy, dy * dy.dtype.type(params["alpha"]))


class SoftplusGrad(GradBinary):
    """``dy · sigmoid(x)``, the sigmoid as ``exp(-softplus(-x))`` (no overflow either way)."""

    name = "softplus_grad"

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        return blocks["dy"] * xp.exp(-xp.logaddexp(x.dtype.type(0), -x))


class AbsGrad(GradBinary):
    """``dy · sign(x)``: 0 at ``x == 0``, as ``torch.abs``'s backward (``sgn``) gives there."""

    name = "abs_grad"

    def compute(self, xp, blocks, params):
        return blocks["dy"] * xp.sign(blocks["x"])


class LogGrad(GradBinary):
    """``dy / x``."""

    name = "log_grad"

    def compute(self, xp, blocks, params):
        return blocks["dy"] / blocks["x"]


class EluGrad(GradBinary):
    """``dy`` where ``x > 0``, else ``dy·alpha·eˣ`` (from the forward input: at ``x == 0`` that is
    ``alpha·dy``, as torch's ``elu_backward`` gives; ``eˣ`` of ``min(x, 0)``, no overflow)."""

    name = "elu_grad"
    params_defaults = {"alpha": 1.0}

    def base_signature(self, ins, params):
        check_slope(self.name, params)
        return super().base_signature(ins, params)

    def compute(self, xp, blocks, params):
        x, dy = blocks["x"], blocks["dy"]
        neg = dy * xp.exp(xp.minimum(x, x.dtype.type(0))) * x.dtype.type(params["alpha"])
        return xp.where(x > 0, dy, neg)


class MishGrad(GradBinary):
    """``dy · (t + x·sigmoid(x)·(1 - t²))``, ``t = tanh(softplus(x))``: torch's ``mish_backward``,
    with the softplus as ``logaddexp(0, x)`` and the sigmoid as ``exp(-softplus(-x))`` (finite
    everywhere; ``1 - t²`` is in ``[0, 1]``)."""

    name = "mish_grad"
    flops = 12.0

    def compute(self, xp, blocks, params):
        x = blocks["x"]
        zero = x.dtype.type(0)
        t = xp.tanh(xp.logaddexp(zero, x))
        sig = xp.exp(-xp.logaddexp(zero, -x))
        return blocks["dy"] * (t + x * sig * (1.0 - t * t))


class WhereGrad(Kernel):
    name = "where_grad"
    inputs = ("dy", "c")
    properties = frozenset({ELEMENTWISE})
    kernel_class = "elementwise"
    params_defaults = {"take": "a"}

    def base_signature(self, ins, params):
        dy, c = ins["dy"].shape, ins["c"].shape
        if params["take"] not in ("a", "b"):
            raise SignatureError(f"where_grad take {params['take']!r} must be 'a' or 'b'")
        try:
            proj = broadcast_projection(c, dy)
        except (ValueError, IndexError):
            raise SignatureError(f"where_grad condition {list(c)} does not broadcast to dy {list(dy)}") from None
        n = len(dy)
        return Signature(elementwise_dims(n), dy, {"dy": identity_projection(n), "c": proj}, identity_projection(n),
                         TensorSpec(dy, ins["dy"].dtype), 1.0)

    def compute(self, xp, blocks, params):
        keep = blocks["c"] != 0 if params["take"] == "a" else blocks["c"] == 0
        return xp.where(keep, blocks["dy"], xp.zeros_like(blocks["dy"]))


KERNELS = (SigmoidGrad, SqrtGrad, ReciprocalGrad, ErfGrad, GeluErfGrad, PowGrad, ClipGrad, LeakyReluGrad, SoftplusGrad,
           AbsGrad, LogGrad, EluGrad, MishGrad, WhereGrad)
