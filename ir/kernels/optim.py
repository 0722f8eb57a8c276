"""Optimizer update kernels: elementwise ops over a parameter's index space.

Each writes the next value of one loop-carried tensor (``P.next``, ``P.m.next``, ...; see
``ir.graph``), so the sharding of these ops *is* the layout of parameters and optimizer state:
replicated over the data-parallel group = plain data parallelism, sharded = ZeRO/FSDP.

Formulas follow PyTorch's ``torch.optim.SGD`` (momentum without dampening) and
``torch.optim.AdamW`` (Loshchilov & Hutter 2019, decoupled weight decay; bias correction with
the step number ``step``).
"""

from __future__ import annotations

from ir.kernels.base import ELEMENTWISE, Kernel, Signature, SignatureError
from ir.kernels.elementwise import elementwise_dims
from ir.zspace import identity_projection


class StateUpdate(Kernel):
    """Same-shaped inputs, identity projections, one output of that shape."""

    properties = frozenset({ELEMENTWISE})
    kernel_class = "elementwise"
    flops = 3.0

    def base_signature(self, ins, params):
        first = ins[self.inputs[0]]
        for port in self.inputs[1:]:
            if ins[port].shape != first.shape:
                raise SignatureError(f"{self.name} needs {port} shaped like {self.inputs[0]} {list(first.shape)}, "
                                     f"got {list(ins[port].shape)}")
        n = len(first.shape)
        return Signature(elementwise_dims(n), first.shape, {p: identity_projection(n) for p in self.inputs},
                         identity_projection(n), first, self.flops)


class SgdUpdate(StateUpdate):
    """``p - lr · (g + weight_decay · p)`` (``g`` is the momentum buffer when momentum is on)."""

    name = "sgd_update"
    inputs = ("p", "g")
    params_defaults = {"lr": 0.01, "weight_decay": 0.0}

    def compute(self, xp, blocks, params):
        p = blocks["p"]
        return p - params["lr"] * (blocks["g"] + params["weight_decay"] * p)


class MomentumUpdate(StateUpdate):
    """``momentum · buf + g``: SGD's momentum buffer."""

    name = "momentum_update"
    inputs = ("buf", "g")
    params_defaults = {"momentum": 0.9}

    def compute(self, xp, blocks, params):
        return params["momentum"] * blocks["buf"] + blocks["g"]


class MomentumDecayUpdate(StateUpdate):
    """``momentum · buf + g + weight_decay · p``: SGD's momentum buffer with weight decay, which
    PyTorch adds to the gradient before the buffer (``torch.optim.SGD``: ``d_p = g + wd · p``,
    ``buf = momentum · buf + d_p``, ``p -= lr · buf``)."""

    name = "momentum_decay_update"
    inputs = ("buf", "g", "p")
    params_defaults = {"momentum": 0.9, "weight_decay": 0.0}
    flops = 4.0

    def compute(self, xp, blocks, params):
        return params["momentum"] * blocks["buf"] + blocks["g"] + params["weight_decay"] * blocks["p"]


class AdamMoment(StateUpdate):
    """``beta · m + (1 - beta) · g^power``: AdamW's first (power 1) or second (power 2) moment."""

    name = "adam_moment"
    inputs = ("m", "g")
    params_defaults = {"beta": 0.9, "power": 1}

    def base_signature(self, ins, params):
        if params["power"] not in (1, 2):
            raise SignatureError(f"adam_moment power must be 1 or 2, got {params['power']!r}")
        return super().base_signature(ins, params)

    def value_range(self, port, ins, params):
        return (0.0, 1.0) if port == "m" and params["power"] == 2 else None

    def compute(self, xp, blocks, params):
        g = blocks["g"]
        b = params["beta"]
        return b * blocks["m"] + (1.0 - b) * (g if params["power"] == 1 else g * g)


class AdamwUpdate(StateUpdate):
    """``p·(1 - lr·wd) - lr · m̂ / (sqrt(v̂) + eps)`` with ``m̂ = m/(1-β1^t)``, ``v̂ = v/(1-β2^t)``."""

    name = "adamw_update"
    inputs = ("p", "m", "v")
    flops = 8.0
    params_defaults = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "step": 1}

    def value_range(self, port, ins, params):
        return (0.0, 1.0) if port == "v" else None

    def compute(self, xp, blocks, params):
        t = params["step"]
        mhat = blocks["m"] / (1.0 - params["beta1"] ** t)
        vhat = blocks["v"] / (1.0 - params["beta2"] ** t)
        p = blocks["p"]
        return p * (1.0 - params["lr"] * params["weight_decay"]) - params["lr"] * mhat / (xp.sqrt(vhat) + params["eps"])


KERNELS = (SgdUpdate, MomentumUpdate, MomentumDecayUpdate, AdamMoment, AdamwUpdate)
