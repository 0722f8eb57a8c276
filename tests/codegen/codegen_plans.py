"""Three 4-device plans of the imported ONNX MLP (fc1 linear, act1, fc2 einsum + fc2.bias, act2, fc3):
data parallel, Megatron (column- then row-parallel with a split reduction) and a pipeline."""

from __future__ import annotations

from ir.graph import Graph
from ir.rewrites import place, split, split_reduction
from ir.rewrites.reduction import acc_name


def data_parallel(g: Graph, n: int = 4) -> Graph:
    for op in g.topo_order:
        g = place(split(g, op, 0, n), op, list(range(n)))
    return g


def megatron(g: Graph, n: int = 4) -> Graph:
    """fc1 and act1 split along the hidden features; fc2 contracts them: a split reduction whose
    partials live where their features are, then one accumulate (the all-reduce) on device 0."""
    for op in ("fc1", "act1"):
        g = place(split(g, op, 1, n), op, list(range(n)))
    g = split_reduction(g, "fc2", n)
    g = place(split(g, "fc2", 0, n), "fc2", list(range(n)))
    g = place(split(g, acc_name("fc2"), 0, n), acc_name("fc2"), list(range(n)))
    return g


def pipeline(g: Graph, microbatches: int = 2) -> Graph:
    """Layers on different devices, the batch in microbatches."""
    stage = {"fc1": 0, "act1": 0, "fc2": 1, "fc2.bias": 1, "act2": 2, "fc3": 3}
    for op in g.topo_order:
        g = split(g, op, 0, microbatches)
        if stage[op]:
            g = place(g, op, [stage[op]] * microbatches)
    return g


def zero_sharded(step: Graph, n: int = 4) -> Graph:
    """A training step with every op whose first index dim divides by ``n`` split along it: the
    batch for the forward and backward, the rows of each parameter for its update (ZeRO/FSDP:
    parameters live sharded at their update's shards and are gathered where read)."""
    for op in step.topo_order:
        sig = step.signature(op)
        if sig.dims and sig.extents[0] % n == 0:
            step = place(split(step, op, 0, n), op, list(range(n)))
    return step
