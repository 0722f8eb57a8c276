"""Fusion: a producer and an elementwise consumer become one op; ``unfuse`` undoes it.

``fuse(g, "fc1", "act1")`` where ``act1 = relu(fc1.out)`` and nobody else reads ``fc1.out``::

    fc1:  fc1.out = linear(x, W1, b1)        ->  fc1+act1: act1.out = fused[linear → relu](x, W1, b1)
    act1: act1.out = relu(fc1.out)

The fused op keeps the producer's shards; the intermediate tensor disappears. Conditions: the
consumer is elementwise, reads the intermediate through exactly one port with the identity
projection (aligned, not broadcast), the intermediate has no other reader and is not an output.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Mapping

from ir.graph import Graph, Op, Shards, Tensor
from ir.kernels import ELEMENTWISE, get_kernel
from ir.kernels.fused import Fused, stage_port
from ir.rewrites.errors import RewriteError
from ir.rewrites.shard import get_op
from ir.zspace import identity_projection, project_boxes


def _stages_of(o: Op) -> tuple[list[dict], dict[str, str]]:
    """Stage list and port→tensor map of ``o`` viewed as a (possibly one-stage) fused op."""
    if o.kernel == "fused":
        return [dict(s) for s in o.params["stages"]], dict(o.inputs)
    stage = {"op": o.name, "kernel": o.kernel, "params": dict(o.params), "chain": None, "via": None}
    return [stage], {stage_port(0, p): t for p, t in o.inputs}


def fusable(g: Graph, producer: str, consumer: str) -> str | None:
    """Why ``producer`` and ``consumer`` cannot be fused, or ``None`` when they can."""
    p, c = g.ops.get(producer), g.ops.get(consumer)
    if p is None or c is None:
        return f"no operation {producer if p is None else consumer!r}"
    if c.kernel == "fused" or ELEMENTWISE not in get_kernel(c.kernel).properties:
        return f"{consumer} ({c.kernel}) is not an elementwise kernel"
    if p.params.get("split"):
        return f"{producer} produces partials; only its accumulate may read them"
    if p.kernel not in ("fused", "norm_matmul") and not get_kernel(p.kernel).inputs:
        return f"{producer} ({p.kernel}) has named stage ports of its own; it cannot be a fused stage"
    t = p.output
    if g.tensors[t].role == "output":
        return f"{t} is a graph output and must stay materialised"
    readers = g.consumers.get(t, [])
    if len(readers) != 1 or readers[0][0] != consumer:
        return f"{t} is read by {[r for r, _ in readers]}, not by {consumer} alone"
    port = readers[0][1]
    sig = g.signature(c)
    if sig.inputs[port] != identity_projection(len(sig.dims)) or sig.out_spec.shape != g.tensors[t].shape:
        return f"{consumer} does not read {t} aligned (it broadcasts it)"
    if f"{producer}+{consumer}" in g.ops:
        return f"an operation named {producer}+{consumer} exists"
    return None


def fuse(g: Graph, producer: str, consumer: str) -> Graph:
    """Fuse ``producer`` with its elementwise ``consumer``; the result keeps the producer's shards."""
    get_op(g, producer), get_op(g, consumer)
    why = fusable(g, producer, consumer)
    if why:
        raise RewriteError(f"cannot fuse {producer} into {consumer}: {why}")
    p, c = g.ops[producer], g.ops[consumer]
    stages, inputs = _stages_of(p)
    i = len(stages)
    chain = next(port for port, t in c.inputs if t == p.output)
    stages.append({"op": c.name, "kernel": c.kernel, "params": dict(c.params), "chain": chain, "via": p.output})
    for port, t in c.inputs:
        if port != chain:
            inputs[stage_port(i, port)] = t
    fused = Op(f"{producer}+{consumer}", "fused", tuple(inputs.items()), c.output, {"stages": stages}, p.shards)
    # placed right after the last op it waits for (the producer, or the last producer of the
    # consumer's other inputs): where program order (``Graph.topo_order``) runs it, so op order
    # stays program order (consumers rely on that; the cost model derives structures from it)
    pos = {n: i for i, n in enumerate(g.ops)}
    prods = g.producers
    after = max((prods[t] for port, t in c.inputs if port != chain and t in prods), key=pos.__getitem__,
                default=producer)
    if pos[after] < pos[producer]:
        after = producer
    return g.with_ops({producer: None, consumer: None}, insert_after={after: [fused]}, tensors={p.output: None})


#: fused op -> (its input tensors, (producer, consumer, intermediate tensor)): ``unshard`` unfuses the
#: same (shared) fused ops of every plan of a search; the same split-off ops also keep their memos
#: (signatures, canonical text) from one call to the next
_UNFUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unfuse(g: Graph, op: str) -> Graph:
    """Split the last stage off fused ``op``: restores the intermediate tensor and both ops."""
    producer, consumer, mid = _unfused(g.ops, g.tensors, op)
    return g.with_ops({op: producer}, insert_after={op: [consumer]}, tensors={mid.name: mid})


def unfuse_each(g: Graph, ops: Iterable[str]) -> tuple[Graph, int]:
    """``unfuse`` of each of ``ops`` in turn, skipping those it refuses, and how many it unfused: the
    graph that chain of ``unfuse`` calls makes, with one copy of the op table instead of one per op."""
    cur, tensors = dict(g.ops), dict(g.tensors)  # the chain's graph so far, for the checks
    replace: dict[str, Op] = {}
    insert: dict[str, list[Op]] = {}
    mids: dict[str, Tensor] = {}
    for op in ops:
        try:
            producer, consumer, mid = _unfused(cur, tensors, op)
        except RewriteError:
            continue
        del cur[op]
        cur[producer.name], cur[consumer.name] = producer, consumer
        tensors[mid.name] = mids[mid.name] = mid
        replace[op], insert[op] = producer, [consumer]
    return (g.with_ops(replace, insert_after=insert, tensors=mids) if replace else g), len(replace)


def _unfused(ops: Mapping[str, Op], tensors: Mapping[str, Tensor], op: str) -> tuple[Op, Op, Tensor]:
    """``unfuse``'s checks and (producer, consumer, intermediate tensor) in a graph of ``ops`` and ``tensors``."""
    o = ops.get(op)
    if o is None:
        raise RewriteError(f"no operation {op!r}; operations are {list(ops)}")
    if o.kernel != "fused":
        raise RewriteError(f"{op} is not a fused operation")
    from ir.rewrites.recompute import SUFFIX

    if op + SUFFIX in ops:  # the copy keeps the fused stages' names, which the unfused ops take
        raise RewriteError(f"cannot unfuse {op}: it has a recomputed copy; unrecompute{{op={op}}} first")
    ts = tuple([tensors.get(t) for _, t in o.inputs])
    hit = _UNFUSED.get(o)
    if hit is not None and hit[0] == ts:
        producer, consumer, mid = hit[1]
    else:
        producer, consumer, mid = _split_last(tensors, o)
        _UNFUSED[o] = (ts, (producer, consumer, mid))
    for name in (producer.name, consumer.name):
        if name in ops and name != op:
            raise RewriteError(f"cannot unfuse {op}: an operation named {name} exists")
    return producer, consumer, mid


def _split_last(tensors: Mapping[str, Tensor], o: Op) -> tuple[Op, Op, Tensor]:
    """``unfuse``'s new ops and intermediate tensor: what ``o`` and its input tensors decide."""
    stages, inputs = _stages_of(o)
    last = stages[-1]
    stage_sigs = Fused().stage_signatures({p: tensors[t].spec for p, t in o.inputs}, o.params)
    mid_spec = stage_sigs[-2][1].out_spec
    M = stage_sigs[-1][2]
    via = last["via"]
    k = len(stages) - 1
    head = stages[:-1]
    head_inputs = tuple((p, t) for p, t in o.inputs if int(p.split(".", 1)[0]) < k)
    if len(head) == 1:
        s0 = head[0]
        producer = Op(s0["op"], s0["kernel"], tuple((p.split(".", 1)[1], t) for p, t in head_inputs), via,
                      dict(s0["params"]), o.shards)
    else:
        producer = Op("+".join(s["op"] for s in head), "fused", head_inputs, via, {"stages": head}, o.shards)
    ck = get_kernel(last["kernel"])
    c_inputs = tuple((port, via if port == last["chain"] else dict(o.inputs)[stage_port(k, port)])
                     for port in ck.inputs)
    lo, hi = project_boxes(M, o.shards.lo, o.shards.hi)
    consumer = Op(last["op"], last["kernel"], c_inputs, o.output, dict(last["params"]),
                  Shards(lo, hi, o.shards.device))
    return producer, consumer, Tensor(via, mid_spec.shape, mid_spec.dtype, "intermediate")
