"""The reverse walk: gradients of a scalar loss with respect to chosen source tensors.

``backward(b, g, seeds, wrt)`` walks ``g``'s ops once in reverse topological order. A tensor
read by several ops (fan-out) gets the *sum* of their contributions (a chain of ``add`` ops,
``<tensor>.gsum<k>``) before its producer's rule runs. Only tensors that depend on a ``wrt``
source get gradients; ops on no such path emit nothing. Integer tensors computed from a source
(``argmax`` indices) pass no gradient: a loss that depends on a source through one is refused,
naming the op that computed them. Forward activations that a rule reads
are ordinary tensors of the graph, alive until their last backward reader (the cost model sees
their real lifetimes).
"""

from __future__ import annotations

from ir.autodiff.errors import AutodiffError, op_name
from ir.autodiff.rules import RULES, VJP
from ir.builder import GraphBuilder
from ir.graph import Graph
from ir.kernels import INDEX_DTYPE


def depends_on(g: Graph, sources: set[str]) -> set[str]:
    """Tensors whose value depends on any of ``sources`` (the sources included)."""
    live = set(sources)
    for name in g.topo_order:
        o = g.ops[name]
        if any(t in live for _, t in o.inputs):
            live.add(o.output)
    return live


def backward(b: GraphBuilder, g: Graph, seeds: dict[str, str], wrt: list[str]) -> dict[str, str]:
    """Emit the backward of ``g`` into ``b``; returns ``{source: gradient tensor}`` for ``wrt``.

    ``seeds`` maps forward tensors to their given gradients (the loss gradient). A ``wrt`` source
    the loss does not depend on is left out of the result. Each gradient is named ``<source>.grad``.
    """
    live = depends_on(g, set(wrt))
    contrib: dict[str, list[str]] = {t: [v] for t, v in seeds.items()}

    def total(t: str) -> str:
        parts = contrib[t]
        acc = parts[0]
        for k, p in enumerate(parts[1:], start=1):
            acc = b.op("add", op_name(t, f".gsum{k}"), {"a": acc, "b": p})
        contrib[t] = [acc]
        return acc

    for name in reversed(g.topo_order):
        o = g.ops[name]
        if o.output not in contrib or o.output not in live:
            continue
        for _, t in o.inputs:  # integers computed from a source (argmax): no gradient passes them
            if t in live and b.tensor(t).dtype == INDEX_DTYPE:
                src = g.producers[t]
                if g.ops[src].kernel == "float_to_index":  # integer arithmetic on ids (and integer constants,
                    continue  # which an import holds as float parameters): a gradient of zero, not a mistake
                raise AutodiffError(f"op {src!r}: kernel {g.ops[src].kernel!r} has no gradient (its output {t!r} "
                                    f"is integer indices, piecewise constant in its input), and the loss depends "
                                    f"on the trained tensors through it (via op {name!r})")
        need = frozenset(p for p, t in o.inputs if t in live and b.tensor(t).dtype != INDEX_DTYPE)
        if not need:
            continue
        fn = RULES.get(o.kernel)
        if fn is None:
            raise AutodiffError(f"op {name!r}: kernel {o.kernel!r} has no vector-Jacobian rule; differentiable "
                                f"kernels are {sorted(RULES)} (unfuse and merge split reductions first)")
        grads = fn(VJP(b, o, need), total(o.output))
        for port, gname in grads.items():
            contrib.setdefault(o.input_map[port], []).append(gname)
    totals = {p: total(p) for p in wrt if p in contrib}
    count: dict[str, int] = {}
    for g in totals.values():
        count[g] = count.get(g, 0) + 1
    # A tensor that is the gradient of one source is renamed; one shared by several is copied.
    b.rename_outputs({g: f"{p}.grad" for p, g in totals.items() if count[g] == 1})
    for p, g in totals.items():
        if count[g] > 1:
            b.op("scale", op_name(p, ".grad"), {"x": g}, out=f"{p}.grad", alpha=1.0)
    return {p: f"{p}.grad" for p in totals}
