"""Hand-built reference plans: single device, data parallel, Megatron tensor parallel (MLP).

They seed the search's first population and are the yardsticks in ``summary.md`` and tests.
"""

from __future__ import annotations

from ir.graph import Graph
from ir.rewrites import RewriteError, place, retile, split_reduction, unshard


def single_device(g: Graph) -> Graph:
    """Every op as one shard on device 0."""
    return unshard(g)


def data_parallel(g: Graph, n: int) -> Graph:
    """Every op split along its first index dim (batch rows) over devices ``0..n-1``.

    Weights are read whole by every shard, i.e. replicated. Ops whose first dim is shorter than
    ``n`` are split as far as it goes.
    """
    g = unshard(g)
    for name in list(g.ops):
        sig = g.signature(name)
        if not sig.dims:
            continue
        k = min(n, sig.extents[0])
        if k > 1:
            g = retile(g, name, [k] + [1] * (len(sig.dims) - 1), list(range(k)))
    return g


def megatron_mlp(g: Graph, n: int) -> Graph:
    """Megatron tensor parallelism for an MLP: odd layers split by output columns, the next layer
    by its reduction (the same columns), one accumulation, all over ``0..n-1``."""
    g = unshard(g)
    layers = sorted((name for name in g.ops if name.startswith("fc")), key=lambda s: int(s[2:]))
    for i, name in enumerate(layers):
        if i % 2 == 0:
            g = retile(g, name, [1, n], list(range(n)))
            act = f"act{name[2:]}"
            if act in g.ops:
                g = retile(g, act, [1, n], list(range(n)))
        else:
            g = split_reduction(g, name, n)
            g = retile(g, name, [n, 1, 1], list(range(n)))
            acc = f"{name}.acc"
            rows = g.signature(acc).extents[0]
            k = min(n, rows)
            g = retile(g, acc, [k, 1], list(range(k)))
    return g


def baselines(g: Graph, n_devices: int) -> dict[str, Graph]:
    """The baselines that apply to ``g`` (Megatron only for MLPs with an even layer count)."""
    out = {"single-device": single_device(g), f"data-parallel-{n_devices}": data_parallel(g, n_devices)}
    if all(o.kernel in ("linear", "relu", "gelu", "tanh") for o in unshard(g).ops.values()):
        try:
            out[f"megatron-{n_devices}"] = megatron_mlp(g, n_devices)
        except RewriteError:
            pass
    return out


__all__ = ["baselines", "data_parallel", "megatron_mlp", "place", "single_device"]
