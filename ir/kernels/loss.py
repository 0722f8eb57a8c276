"""Loss kernels and their gradients: mean squared error and token cross-entropy.

A loss writes a one-cell tensor ``loss[1]``; the mean over examples hides in the projection
shapes, and the sum over the batch (dim 0) is a splittable ``sum`` reduction, so a data-parallel
loss is a ``split_reduction`` like any other. Partials divide by the *whole* count (the chunk's
size times the number of blocks), so they add up to the mean.

The gradient kernels take the count of averaged elements as a parameter (a block alone cannot
know it) and write ``dL/dy`` for the seed of the backward walk (``dL = 1``).
"""

from __future__ import annotations

from ir.kernels.base import ELEMENTWISE, Kernel, Reduction, Signature, SignatureError, TensorSpec, zero_row
from ir.kernels.elementwise import elementwise_dims
from ir.kernels.rowwise import row_projection
from ir.zspace import Projection, identity_projection


def _whole(shape: tuple[int, ...]) -> Projection:
    """The one index point reads the whole tensor."""
    return Projection(tuple(zero_row(1) for _ in shape), (0,) * len(shape), shape)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for e in shape:
        n *= e
    return n


class MseLoss(Kernel):
    """``loss = mean((y - target)²)``."""

    name = "mse_loss"
    inputs = ("y", "target")
    kernel_class = "reduction"

    def base_signature(self, ins, params):
        y, t = ins["y"].shape, ins["target"].shape
        if y != t:
            raise SignatureError(f"mse_loss needs target shaped like y {list(y)}, got {list(t)}")
        return Signature(("l",), (1,), {"y": _whole(y), "target": _whole(t)}, identity_projection(1),
                         TensorSpec((1,), ins["y"].dtype), 3.0 * _count(y),
                         (Reduction("n", y[0], "sum", (("y", 0), ("target", 0))),))

    def compute(self, xp, blocks, params):
        d = blocks["y"] - blocks["target"]
        return (xp.sum(d * d) / d.size).reshape(1)

    def partial_compute(self, xp, blocks, params, block):
        d = blocks["y"] - blocks["target"]
        return (xp.sum(d * d) / (d.size * params["split"]["parts"])).reshape(1)


class MseLossGrad(Kernel):
    """``dy = 2 (y - target) / count``."""

    name = "mse_loss_grad"
    inputs = ("y", "target")
    properties = frozenset({ELEMENTWISE})
    kernel_class = "elementwise"
    params_defaults = {"count": 1}

    def base_signature(self, ins, params):
        y = ins["y"]
        if ins["target"].shape != y.shape:
            raise SignatureError(f"mse_loss_grad needs target shaped like y {list(y.shape)}")
        n = len(y.shape)
        return Signature(elementwise_dims(n), y.shape, {"y": identity_projection(n), "target": identity_projection(n)},
                         identity_projection(n), y, 3.0)

    def compute(self, xp, blocks, params):
        return (blocks["y"] - blocks["target"]) * (2.0 / params["count"])


class CrossEntropy(Kernel):
    """``loss = mean_tokens(logsumexp(logits) - logits[label])`` over ``logits[*n, V]``, ``labels[*n]``."""

    name = "cross_entropy"
    inputs = ("logits", "labels")
    index_ports = ("labels",)
    kernel_class = "reduction"

    def base_signature(self, ins, params):
        lg, lb = ins["logits"].shape, ins["labels"].shape
        if len(lg) < 2 or lg[:-1] != lb:
            raise SignatureError(f"cross_entropy needs logits[*n, V] and labels[*n]; got {list(lg)}, {list(lb)}")
        return Signature(("l",), (1,), {"logits": _whole(lg), "labels": _whole(lb)}, identity_projection(1),
                         TensorSpec((1,), ins["logits"].dtype), 6.0 * _count(lg),
                         (Reduction("n", lg[0], "sum", (("logits", 0), ("labels", 0))),))

    def value_range(self, port, ins, params):
        return (0, ins["logits"].shape[-1]) if port == "labels" else None

    def _token_losses(self, xp, blocks):
        x, lab = blocks["logits"], blocks["labels"]
        m = xp.max(x, axis=-1, keepdims=True)
        lse = xp.log(xp.sum(xp.exp(x - m), axis=-1)) + m[..., 0]
        picked = xp.take_along_axis(x, lab[..., None].astype(xp.int64), axis=-1)[..., 0]
        return lse - picked

    def compute(self, xp, blocks, params):
        t = self._token_losses(xp, blocks)
        return (xp.sum(t) / t.size).reshape(1)

    def partial_compute(self, xp, blocks, params, block):
        t = self._token_losses(xp, blocks)
        return (xp.sum(t) / (t.size * params["split"]["parts"])).reshape(1)


class CrossEntropyGrad(Kernel):
    """``dlogits = (softmax(logits) - onehot(labels)) / count``, row by row."""

    name = "cross_entropy_grad"
    inputs = ("logits", "labels")
    index_ports = ("labels",)
    kernel_class = "rowwise"
    params_defaults = {"count": 1}

    def base_signature(self, ins, params):
        lg, lb = ins["logits"].shape, ins["labels"].shape
        if len(lg) < 2 or lg[:-1] != lb:
            raise SignatureError(f"cross_entropy_grad needs logits[*n, V] and labels[*n]; got {list(lg)}, {list(lb)}")
        n = len(lb)
        return Signature(tuple(f"d{i}" for i in range(n)), lb,
                         {"logits": row_projection(lg), "labels": identity_projection(n)},
                         row_projection(lg), TensorSpec(lg, ins["logits"].dtype), 6.0 * lg[-1])

    def value_range(self, port, ins, params):
        return (0, ins["logits"].shape[-1]) if port == "labels" else None

    def compute(self, xp, blocks, params):
        x, lab = blocks["logits"], blocks["labels"]
        e = xp.exp(x - xp.max(x, axis=-1, keepdims=True))
        p = e / xp.sum(e, axis=-1, keepdims=True)
        onehot = (lab[..., None] == xp.arange(x.shape[-1])[None, :]).astype(x.dtype)
        return (p - onehot) / params["count"]


KERNELS = (MseLoss, MseLossGrad, CrossEntropy, CrossEntropyGrad)
