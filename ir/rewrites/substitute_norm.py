"""Substitution: a layernorm/rmsnorm fused into the contractions that read it; ``unfuse_norm`` undoes it.

``fuse_norm(g, "ln2")`` on ``ff1 = linear(ln2(r1), W1, b1)``::

    ln2: ln2.out = layernorm(resid1.out, ln2_g, ln2_b)
    ff1: ff1.out = linear(ln2.out, W1, b1)
 -> ln2+ff1: ff1.out = norm_matmul[layernorm → linear](x=resid1.out, n.gamma=ln2_g, n.beta=ln2_b,
                                                       m.W=W1, m.b=b1)

With ``consumer`` given, only that reader is fused; without, every reader (all must qualify:
einsum/matmul/bmm/linear contracting the normalised dim). The norm op and its output disappear
once no reader is left. Conditions: both ops plain (not fused, reduction not split), the
normalised tensor is not a graph output. The fused op keeps the consumer's shards. Where it
pays: the normalised activations are neither written nor read back, and the norm's launch is
saved; each shard repeats the normalisation of its rows (see ``ir.kernels.prenorm``).

The consumer may also be a fused op whose first stage is such a contraction (``ff1+ff_act =
fused[linear → gelu]``): the norm becomes that stage's prologue, ``ln2+ff1+ff_act =
fused[norm_matmul → gelu]`` (one kernel for layernorm, fc1 and GELU, as TransformerEngine's
``LayerNormMLP`` runs them), the same as fusing the norm first and the activation after.

``unfuse_norm(g, "ln2+ff1")`` restores the consumer and, if it is gone, the norm op (one whole
shard on the fused op's first device) and its output tensor; on ``ln2+ff1+ff_act`` it restores
``ff1+ff_act``.
"""

from __future__ import annotations

from ir.graph import Graph, Op, Shards, Tensor
from ir.kernels import SignatureError, get_kernel
from ir.kernels.prenorm import INNERS, NORMS
from ir.rewrites.errors import RewriteError
from ir.rewrites.shard import get_op


def fusable_norm(g: Graph, norm: str, consumer: str) -> str | None:
    """Why ``consumer`` cannot absorb ``norm``, or ``None`` when it can."""
    n, c = g.ops.get(norm), g.ops.get(consumer)
    if n is None or c is None:
        return f"no operation {norm if n is None else consumer!r}"
    if n.kernel not in NORMS or n.params.get("split"):
        return f"{norm} ({n.kernel}) is not a plain {' or '.join(NORMS)}"
    inner = _head(c)
    if inner is None:
        return (f"{consumer} ({c.kernel}) is not a plain {'/'.join(INNERS)}, nor a fused op whose first stage "
                f"is one")
    if g.tensors[n.output].role == "output":
        return f"{n.output} is a graph output and must stay materialised"
    ports = [p for p, t in inner.inputs if t == n.output]
    if len(ports) != 1 or sum(t == n.output for _, t in c.inputs) != 1:
        return f"{consumer} does not read {n.output} through exactly one port of its contraction"
    try:
        get_kernel("norm_matmul").signature(_ins(g, n, inner, ports[0]), _params(n, inner, ports[0]))
    except SignatureError as e:
        return str(e)
    if f"{norm}+{consumer}" in g.ops:
        return f"an operation named {norm}+{consumer} exists"
    return None


def _head(c: Op) -> Op | None:
    """The contraction a norm can be fused into: ``c`` itself, or a fused op's first stage (as an
    op with that stage's own ports); None if there is none."""
    if c.kernel == "fused":
        st = c.params["stages"][0]
        c = Op(st["op"], st["kernel"], tuple((p[2:], t) for p, t in c.inputs if p.startswith("0.")), c.output,
               dict(st.get("params", {})), c.shards)
    return c if c.kernel in INNERS and not c.params.get("split") else None


def _params(n: Op, c: Op, chain: str) -> dict:
    return {"norm": {"op": n.name, "kernel": n.kernel, "params": dict(n.params), "output": n.output},
            "inner": {"op": c.name, "kernel": c.kernel, "params": dict(c.params), "chain": chain}}


def _inputs(n: Op, c: Op, chain: str) -> tuple[tuple[str, str], ...]:
    return ((("x", n.input_map["x"]),) + tuple((f"n.{p}", t) for p, t in n.inputs if p != "x")
            + tuple((f"m.{p}", t) for p, t in c.inputs if p != chain))


def _ins(g: Graph, n: Op, c: Op, chain: str) -> dict:
    return {p: g.tensors[t].spec for p, t in _inputs(n, c, chain)}


def fuse_norm(g: Graph, norm: str, consumer: str | None = None) -> Graph:
    """Fuse ``norm`` into ``consumer`` (default: into every reader of its output)."""
    n = get_op(g, norm)
    readers = [r for r, _ in g.consumers.get(n.output, [])]
    targets = [consumer] if consumer is not None else readers
    if not targets:
        raise RewriteError(f"cannot fuse {norm}: nothing reads {n.output}")
    for c in targets:
        why = fusable_norm(g, norm, c)
        if why:
            raise RewriteError(f"cannot fuse {norm} into {c}: {why}")
    replace: dict[str, Op | None] = {}
    for c in targets:
        o = g.ops[c]
        inner = _head(o)
        chain = next(p for p, t in inner.inputs if t == n.output)
        if o.kernel == "fused":  # the norm_matmul becomes the first stage
            stages = [{"op": f"{norm}+{inner.name}", "kernel": "norm_matmul", "params": _params(n, inner, chain),
                       "chain": None, "via": None}] + [dict(st) for st in o.params["stages"][1:]]
            ins = tuple((f"0.{p}", t) for p, t in _inputs(n, inner, chain)) + tuple(
                (p, t) for p, t in o.inputs if not p.startswith("0."))
            replace[c] = Op(f"{norm}+{c}", "fused", ins, o.output, {"stages": stages}, o.shards)
        else:
            replace[c] = Op(f"{norm}+{c}", "norm_matmul", _inputs(n, o, chain), o.output, _params(n, o, chain),
                            o.shards)
    tensors: dict[str, Tensor | None] = {}
    if set(readers) <= set(targets):  # nobody reads the normalised tensor any more
        replace[norm] = None
        tensors[n.output] = None
    return g.with_ops(replace, tensors=tensors)


def unfuse_norm(g: Graph, op: str) -> Graph:
    """Restore the contraction (and, if it is gone, the norm op) that ``op`` replaced."""
    o = get_op(g, op)
    fused = _fused_with_norm(o)
    if o.kernel != "norm_matmul" and not fused:
        raise RewriteError(f"{op} is not a norm_matmul op, nor a fused op whose first stage is one")
    head = o.params["stages"][0] if fused else None
    p0 = head["params"] if fused else o.params
    norm, inner = p0["norm"], p0["inner"]
    ins = {p[2:]: t for p, t in o.inputs if p.startswith("0.")} if fused else o.input_map
    c_inputs = tuple((p, norm["output"] if p == inner["chain"] else ins[f"m.{p}"])
                     for p in get_kernel(inner["kernel"]).inputs)
    if fused:  # the fused op again, its first stage the contraction
        stages = [{"op": inner["op"], "kernel": inner["kernel"], "params": dict(inner["params"]), "chain": None,
                   "via": None}] + [dict(st) for st in o.params["stages"][1:]]
        restored = Op("+".join(st["op"] for st in stages), "fused",
                      tuple((f"0.{p}", t) for p, t in c_inputs) + tuple((p, t) for p, t in o.inputs
                                                                        if not p.startswith("0.")),
                      o.output, {"stages": stages}, o.shards)
    else:
        restored = Op(inner["op"], inner["kernel"], c_inputs, o.output, dict(inner["params"]), o.shards)
    if restored.name in g.ops:
        raise RewriteError(f"cannot unfuse {op}: an operation named {restored.name} exists")
    if norm["op"] in g.ops:
        n = g.ops[norm["op"]]
        if n.output != norm["output"] or n.kernel != norm["kernel"]:
            raise RewriteError(f"cannot unfuse {op}: {norm['op']} is not the norm it replaced")
        return g.with_ops({op: restored})
    if norm["output"] in g.tensors:
        raise RewriteError(f"cannot unfuse {op}: a tensor named {norm['output']} exists")
    nk = get_kernel(norm["kernel"])
    n_inputs = tuple((p, ins["x"] if p == "x" else ins[f"n.{p}"]) for p in nk.inputs)
    spec = nk.signature({p: g.tensors[t].spec for p, t in n_inputs}, norm["params"])
    n_op = Op(norm["op"], norm["kernel"], n_inputs, norm["output"], dict(norm["params"]),
              Shards.whole(spec.extents, int(o.shards.device[0])))
    return g.with_ops({op: n_op}, insert_after={op: [restored]},
                      tensors={norm["output"]: Tensor(norm["output"], spec.out_spec.shape, spec.out_spec.dtype,
                                                      "intermediate")})


def norm_sites(g: Graph) -> list[str]:
    """Norm ops that ``fuse_norm`` can fuse into all their readers (the search's candidates)."""
    out = []
    for name, o in g.ops.items():
        if o.kernel in NORMS:
            readers = [r for r, _ in g.consumers.get(o.output, [])]
            if readers and all(fusable_norm(g, name, r) is None for r in readers):
                out.append(name)
    return out


def fused_norms(g: Graph) -> list[str]:
    """Ops that ``unfuse_norm`` applies to: norm_matmul ops and fused ops that start with one."""
    return [n for n, o in g.ops.items() if o.kernel == "norm_matmul" or _fused_with_norm(o)]


def _fused_with_norm(o: Op) -> bool:
    """Whether ``o`` is a fused op whose first stage is a norm_matmul."""
    return o.kernel == "fused" and o.params["stages"][0]["kernel"] == "norm_matmul"
