"""Built-in workloads: ``build(name, **params)`` for ``mlp``, ``transformer`` and ``convnet``.

Operation names are deterministic (``fc1``, ``act1``, ``attn_qk``, ``conv1``, ...), so plans,
configs and tests can refer to them.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Sequence

from ir.builder import GraphBuilder
from ir.graph import Graph


class WorkloadError(ValueError):
    """Unknown workload or parameter, or parameters that make no program."""


def mlp(batch: int = 8, widths: Sequence[int] = (64, 256, 64), activation: str = "relu",
        dtype: str = "float32") -> Graph:
    """``x[batch, w0] → fc1 → act1 → fc2 → … → fcN``: linear layers with activations between."""
    widths = [int(w) for w in widths]
    if len(widths) < 2:
        raise WorkloadError("mlp widths needs at least two entries (input and output width)")
    if activation not in ("relu", "gelu", "tanh"):
        raise WorkloadError(f"mlp activation {activation!r} must be relu, gelu or tanh")
    b = GraphBuilder(dtype)
    h = b.input("x", (batch, widths[0]))
    for i, (fi, fo) in enumerate(zip(widths[:-1], widths[1:]), start=1):
        h = b.linear(h, b.parameter(f"W{i}", (fi, fo)), b.parameter(f"b{i}", (fo,)), name=f"fc{i}")
        if i < len(widths) - 1:
            h = b.op(activation, f"act{i}", {"x": h})
    return b.build()


def transformer(batch: int = 2, seq: int = 16, d_model: int = 32, heads: int = 4, d_ff: int = 64,
                dtype: str = "float32") -> Graph:
    """One pre-norm transformer block (attention + feed-forward, residual adds)."""
    if d_model % heads:
        raise WorkloadError(f"transformer d_model {d_model} must be divisible by heads {heads}")
    dh = d_model // heads
    b = GraphBuilder(dtype)
    x = b.input("x", (batch, seq, d_model))
    ln1 = b.layernorm(x, b.parameter("ln1_g", (d_model,)), b.parameter("ln1_b", (d_model,)), name="ln1")
    proj = {}
    for n in ("q", "k", "v"):
        proj[n] = b.einsum(ln1, b.parameter(f"W{n}", (d_model, heads, dh)), name=f"{n}_proj",
                           equation="bsd,dhe->bhse")
    kt = b.permute(proj["k"], name="k_t", perm=[0, 1, 3, 2])
    scores = b.bmm(proj["q"], kt, name="attn_qk", alpha=1.0 / math.sqrt(dh))
    probs = b.softmax(scores, name="attn_softmax")
    ctx = b.bmm(probs, proj["v"], name="attn_av")
    o = b.einsum(ctx, b.parameter("Wo", (heads, dh, d_model)), name="o_proj", equation="bhse,hed->bsd")
    r1 = b.add(x, o, name="resid1")
    ln2 = b.layernorm(r1, b.parameter("ln2_g", (d_model,)), b.parameter("ln2_b", (d_model,)), name="ln2")
    f1 = b.linear(ln2, b.parameter("W1", (d_model, d_ff)), b.parameter("b1", (d_ff,)), name="ff1")
    a = b.gelu(f1, name="ff_act")
    f2 = b.linear(a, b.parameter("W2", (d_ff, d_model)), b.parameter("b2", (d_model,)), name="ff2")
    b.add(r1, f2, name="resid2")
    return b.build()


def convnet(batch: int = 2, channels: Sequence[int] | int = (3, 8, 8), size: int = 16, layers: int | None = None,
            classes: int = 10, dtype: str = "float32") -> Graph:
    """``conv{i}`` (3×3, padding 1) + ``relu{i}`` layers, a sum pool, and a linear head ``fc``."""
    if isinstance(channels, int):
        channels = [3] + [channels] * (layers or 2)
    channels = [int(c) for c in channels]
    if layers is not None and len(channels) != layers + 1:
        raise WorkloadError(f"convnet channels {channels} must list layers+1 = {layers + 1} entries")
    b = GraphBuilder(dtype)
    h = b.input("x", (batch, channels[0], size, size))
    for i, (ci, co) in enumerate(zip(channels[:-1], channels[1:]), start=1):
        h = b.conv2d(h, b.parameter(f"w{i}", (co, ci, 3, 3)), name=f"conv{i}", padding=1)
        h = b.relu(h, name=f"relu{i}")
    h = b.reduce_sum(h, name="pool_w", dim=3)
    h = b.reduce_sum(h, name="pool_h", dim=2)
    b.linear(h, b.parameter("Wfc", (channels[-1], classes)), b.parameter("bfc", (classes,)), name="fc")
    return b.build()


WORKLOADS: dict[str, Callable[..., Graph]] = {"mlp": mlp, "transformer": transformer, "convnet": convnet}


def workload_params(name: str) -> dict[str, Any]:
    """The parameters of a workload and their defaults."""
    return {k: p.default for k, p in inspect.signature(WORKLOADS[name]).parameters.items()}


def build(name: str, **params: Any) -> Graph:
    """Build a built-in workload; unknown names or parameters raise ``WorkloadError``."""
    if name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r}; built-in workloads are {sorted(WORKLOADS)}")
    known = workload_params(name)
    for k in params:
        if k not in known:
            raise WorkloadError(f"workload {name!r} has no parameter {k!r}; its parameters are {sorted(known)}")
    try:
        return WORKLOADS[name](**params)
    except WorkloadError:
        raise
    except (ValueError, TypeError) as e:
        raise WorkloadError(f"workload {name!r} cannot be built with {params}: {e}") from None
