"""Optimizer update ops appended to a training step, one group per parameter.

- ``sgd``: ``P.next = sgd_update(P, g)``; with ``momentum`` > 0, a state ``P.momentum`` and
  ``P.momentum.next = momentum_update(P.momentum, g)`` (``momentum_decay_update(P.momentum, g, P)``
  with weight decay, which joins the gradient before the buffer), then ``P.next =
  sgd_update(P, P.momentum.next)`` (PyTorch's SGD without dampening).
- ``adamw``: states ``P.m``, ``P.v``; ``P.m.next = adam_moment(P.m, g)``,
  ``P.v.next = adam_moment(P.v, g, power=2)``, ``P.next = adamw_update(P, P.m.next, P.v.next)``.

State tensors take the parameter's dtype (fp32 under master weights). A gradient in another
dtype (bf16 activations) is cast first.
"""

from __future__ import annotations

from typing import Any

from ir.autodiff.errors import AutodiffError, op_name
from ir.builder import GraphBuilder
from ir.graph import next_name

OPTIMIZERS = {
    "sgd": {"lr": 0.01, "weight_decay": 0.0, "momentum": 0.0},
    "adamw": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "step": 1},
}


def append_updates(b: GraphBuilder, grads: dict[str, str], optimizer: str, params: dict[str, Any]) -> list[str]:
    """Add the update ops for every ``parameter -> gradient``; returns the ``.next`` tensors written."""
    known = OPTIMIZERS[optimizer]
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise AutodiffError(f"optimizer {optimizer!r} has no parameter {unknown[0]!r}; its parameters are "
                            f"{sorted(known)}")
    hp = {**known, **params}
    nexts: list[str] = []
    for p, g in grads.items():
        pt = b.tensor(p)
        if b.tensor(g).dtype != pt.dtype:
            g = b.op("cast", op_name(p, ".grad.cast"), {"x": g}, dtype=pt.dtype)
        if optimizer == "sgd":
            step, wd = g, hp["weight_decay"]
            if hp["momentum"]:
                buf = b.state(f"{p}.momentum", pt.shape, pt.dtype)
                if wd:  # the decay joins the gradient before the buffer, as in torch.optim.SGD
                    step = b.op("momentum_decay_update", op_name(buf, ".update"), {"buf": buf, "g": g, "p": p},
                                out=next_name(buf), momentum=hp["momentum"], weight_decay=wd)
                    wd = 0.0
                else:
                    step = b.op("momentum_update", op_name(buf, ".update"), {"buf": buf, "g": g}, out=next_name(buf),
                                momentum=hp["momentum"])
                nexts.append(step)
            nexts.append(b.op("sgd_update", op_name(p, ".update"), {"p": p, "g": step}, out=next_name(p), lr=hp["lr"],
                              weight_decay=wd))
        else:
            m, v = b.state(f"{p}.m", pt.shape, pt.dtype), b.state(f"{p}.v", pt.shape, pt.dtype)
            m1 = b.op("adam_moment", op_name(m, ".update"), {"m": m, "g": g}, out=next_name(m), beta=hp["beta1"])
            v1 = b.op("adam_moment", op_name(v, ".update"), {"m": v, "g": g}, out=next_name(v), beta=hp["beta2"],
                      power=2)
            nexts += [m1, v1, b.op("adamw_update", op_name(p, ".update"), {"p": p, "m": m1, "v": v1},
                                   out=next_name(p),
                                   **{k: hp[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "step")})]
    return nexts
