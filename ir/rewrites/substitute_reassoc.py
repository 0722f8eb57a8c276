"""Substitution: reassociate a chain of two contractions, ``(A·B)·R -> A·(B·R)``; and back.

``reassociate(g, "up")`` on a low-rank chain ``down = x[n, d] · Wd[d, r]``, ``up = down · Wu[r, d]``::

    down: down.out = einsum(x, Wd, "nd,dr->nr")             down.re: down.re.out = einsum(Wd, Wu, "dr,re->de")
    up:   up.out = einsum(down.out, Wu, "nr,re->ne")   ->   up:      up.out = einsum(x, down.re.out, "nd,de->ne")

Both are einsums over the same letters, summed in another order: ``Σ_r Σ_d x·Wd·Wu``. The inner
op's other operand (``keep``: ``"a"`` keeps ``A`` outside and pairs ``B`` with ``R``, ``"b"`` keeps
``B``) decides which pair is contracted first. Which order is cheaper depends only on the
extents: ``reassociation_flops`` gives both, and the search only proposes the cheaper one. Where
``B`` and ``R`` are both weights of an inference program (a low-rank adapter's ``Wd·Wu``), the new
inner op is weights-only: the cost model folds it at load time (``ir.folding``), as merging an
adapter into its base weight does.

Conditions: both ops are plain einsum/matmul ops (not fused, reduction not split); the inner
output is read only by the outer op and is not a graph output. Letters of the outer equation
are renamed into the inner's so the two equations share one alphabet. The outer op keeps its
name, output and shards and records both originals in ``params["origin"]`` (the einsum kernel's
record slot), so ``unreassociate`` (and ``unshard``) restores them exactly.
"""

from __future__ import annotations

import string

from ir.graph import Graph, Op, Shards, Tensor
from ir.kernels import SignatureError, get_kernel
from ir.rewrites.errors import RewriteError
from ir.rewrites.shard import get_op
from ir.rewrites.substitute_attention import contraction_letters

KERNELS = ("einsum", "matmul")


def _plan(g: Graph, op: str, keep: str) -> tuple | str:
    """``(inner, outer, eq_t, eq_o, t_ins, o_ins, alpha, t_shape)`` for ``reassociate`` or why not."""
    o = g.ops.get(op)
    if o is None:
        return f"no operation {op!r}"
    if keep not in ("a", "b"):
        return f"keep must be 'a' or 'b', got {keep!r}"
    if o.kernel not in KERNELS or contraction_letters(o, g) is None or o.params.get("origin"):
        return f"{op} ({o.kernel}) is not a plain einsum/matmul"
    la2, lb2, lz, alpha2 = contraction_letters(o, g)
    inner_port = next((p for p, t in o.inputs if t in g.producers and g.ops[g.producers[t]].kernel in KERNELS), None)
    if inner_port is None:
        return f"neither operand of {op} is produced by an einsum/matmul"
    y = o.input_map[inner_port]
    i = g.ops[g.producers[y]]
    view = contraction_letters(i, g)
    if view is None or i.params.get("origin"):
        return f"{i.name} ({i.kernel}) is not a plain einsum/matmul"
    readers = g.consumers.get(y, [])
    if g.tensors[y].role == "output" or len(readers) != 1:
        return f"{y} is read by {[r for r, _ in readers]} or is an output; the chain must be private"
    la, lb, ly, alpha1 = view
    lyo, lr = (la2, lb2) if inner_port == "a" else (lb2, la2)
    r_tensor = o.input_map["b" if inner_port == "a" else "a"]
    rename = {L: ly[k] for k, L in enumerate(lyo)}
    fresh = iter(c for c in string.ascii_lowercase if c not in set(la + lb + ly))
    for L in lr + lz:
        if L not in rename:
            rename[L] = next(fresh)
    lr_, lz_ = "".join(rename[L] for L in lr), "".join(rename[L] for L in lz)
    (lk, k_tensor), (lp, p_tensor) = (((la, i.input_map["a"]), (lb, i.input_map["b"])) if keep == "a"
                                      else ((lb, i.input_map["b"]), (la, i.input_map["a"])))
    lt = "".join(dict.fromkeys(L for L in lp + lr_ if L in lk or L in lz_))
    if not lt:
        return "the pair would contract to a scalar"
    eq_t, eq_o = f"{lp},{lr_}->{lt}", f"{lk},{lt}->{lz_}"
    try:
        ts = get_kernel("einsum").signature({"a": g.tensors[p_tensor].spec, "b": g.tensors[r_tensor].spec},
                                            {"equation": eq_t})
        get_kernel("einsum").signature({"a": g.tensors[k_tensor].spec, "b": ts.out_spec}, {"equation": eq_o})
    except SignatureError as e:
        return f"the reassociated equations {eq_t} and {eq_o} do not apply: {e}"
    return i, o, eq_t, eq_o, (p_tensor, r_tensor), k_tensor, alpha1 * alpha2, ts


def chain_of(g: Graph, op: str, keep: str = "a") -> tuple[str, str] | None:
    """``(inner, outer)``: the ops of the chain ``reassociate(g, op, keep)`` rewrites, or None
    where it does not apply."""
    plan = _plan(g, op, keep)
    return None if isinstance(plan, str) else (plan[0].name, plan[1].name)


def reassociation_flops(g: Graph, op: str, keep: str = "a") -> tuple[float, float] | None:
    """FLOPs of the chain ending at ``op`` as written and reassociated (None where it does not apply)."""
    plan = _plan(g, op, keep)
    if isinstance(plan, str):
        return None
    i, o, eq_t, eq_o, _, k_tensor, _, ts = plan
    before = sum(g.signature(x).flops_per_point * g.signature(x).index.size for x in (i, o))
    so = get_kernel("einsum").signature({"a": g.tensors[k_tensor].spec, "b": ts.out_spec}, {"equation": eq_o})
    return before, ts.flops_per_point * ts.index.size + so.flops_per_point * so.index.size


def _record(x: Op) -> dict:
    return {"op": x.name, "kernel": x.kernel, "params": dict(x.params), "inputs": [[p, t] for p, t in x.inputs],
            "output": x.output}


def reassociate(g: Graph, op: str, keep: str = "a") -> Graph:
    """``(A·B)·R -> A·(B·R)`` (``keep="a"``) or ``(A·R)·B`` (``keep="b"``) for the chain ending at ``op``."""
    get_op(g, op)
    plan = _plan(g, op, keep)
    if isinstance(plan, str):
        raise RewriteError(f"cannot reassociate {op}: {plan}")
    i, o, eq_t, eq_o, (p_tensor, r_tensor), k_tensor, alpha, ts = plan
    t_name = f"{i.name}.re"
    if t_name in g.ops or f"{t_name}.out" in g.tensors:
        raise RewriteError(f"cannot reassociate {op}: an operation named {t_name} exists")
    dev = int(o.shards.device[0])
    t_op = Op(t_name, "einsum", (("a", p_tensor), ("b", r_tensor)), f"{t_name}.out", {"equation": eq_t},
              Shards.whole(ts.extents, dev))
    new_o = Op(o.name, "einsum", (("a", k_tensor), ("b", f"{t_name}.out")), o.output,
               {"equation": eq_o, "alpha": alpha, "origin": {"inner": _record(i), "outer": _record(o)}}, o.shards)
    return g.with_ops({i.name: t_op, o.name: new_o},
                      tensors={i.output: None, f"{t_name}.out": Tensor(f"{t_name}.out", ts.out_spec.shape,
                                                                       ts.out_spec.dtype, "intermediate")})


def unreassociate(g: Graph, op: str) -> Graph:
    """Restore the chain that ``reassociate`` rewrote (the outer op's ``origin``)."""
    o = get_op(g, op)
    origin = o.params.get("origin") if o.kernel == "einsum" else None
    if not origin:
        raise RewriteError(f"{op} is not a reassociated einsum")
    inner, outer = origin["inner"], origin["outer"]
    t_name = o.input_map["b"][: -len(".out")]
    if g.producers.get(o.input_map["b"]) != t_name or len(g.consumers.get(o.input_map["b"], [])) != 1:
        raise RewriteError(f"cannot unreassociate {op}: its paired contraction {t_name} is not private to it")
    if inner["op"] != t_name[: -len(".re")] or inner["output"] in g.tensors:
        raise RewriteError(f"cannot unreassociate {op}: {inner['op']} or {inner['output']} is taken")
    i_ins = tuple((p, t) for p, t in inner["inputs"])
    isig = get_kernel(inner["kernel"]).signature({p: g.tensors[t].spec for p, t in i_ins}, inner["params"])
    dev = int(o.shards.device[0])
    i_op = Op(inner["op"], inner["kernel"], i_ins, inner["output"], dict(inner["params"]),
              Shards.whole(isig.extents, dev))
    o_op = Op(outer["op"], outer["kernel"], tuple((p, t) for p, t in outer["inputs"]), outer["output"],
              dict(outer["params"]), o.shards)
    return g.with_ops({t_name: i_op, op: o_op},
                      tensors={o.input_map["b"]: None,
                               inner["output"]: Tensor(inner["output"], isig.out_spec.shape, isig.out_spec.dtype,
                                                       "intermediate")})


def reassociation_sites(g: Graph) -> list[tuple[str, str]]:
    """``(op, keep)`` where reassociating lowers the FLOPs (the search's candidates)."""
    out = []
    for n, o in g.ops.items():
        if o.kernel not in KERNELS or o.params.get("origin"):
            continue
        for keep in ("a", "b"):
            f = reassociation_flops(g, n, keep)
            if f is not None and f[1] < f[0]:
                out.append((n, keep))
    return out


def reassociated(g: Graph) -> list[str]:
    return [n for n, o in g.ops.items() if o.kernel == "einsum" and o.params.get("origin")]
