"""Substitution: contractions that share an input become one (QKV, SwiGLU's gate and up), and back.

``merge_matmuls(g, ["q_proj", "k_proj", "v_proj"])`` on three einsums ``bsd,dhe->bhse`` reading
``ln1.out`` with weights ``Wq``, ``Wk``, ``Wv`` [d, h, e]::

    q_proj: q_proj.out = einsum(ln1.out, Wq)            q_proj+k_proj+v_proj.wcat1: concat(Wq, Wk, axis=1)
    k_proj: k_proj.out = einsum(ln1.out, Wk)      ->    q_proj+k_proj+v_proj.wcat2: concat(…wcat1.out, Wv, axis=1)
    v_proj: v_proj.out = einsum(ln1.out, Wv)            q_proj+k_proj+v_proj: einsum(ln1.out, …wcat2.out)  [b, 3h, s, e]
                                                        q_proj: q_proj.out = slice(…, axis=1, 0:h)  (k_proj, v_proj alike)

Why this formulation. The IR has one output per op and no views, and ``verify`` feeds a plan and
its program the same random values *by tensor name*. A merged op that read a new stacked
parameter would need values the program does not have (its inputs ``Wq``, ``Wk``, ``Wv`` are not
``W_qkv``), and consumers cannot read a part of one output tensor without an op. So the stacked
weight is computed (``concat`` of the original parameters: ``Wq`` … stay the program's inputs,
in training their gradients flow through the concat), and the consumers read ``slice`` ops that
keep the original op names and output tensors: the rest of the graph is untouched, and
``split_matmuls`` (which ``unshard`` calls) restores the original ops exactly from the structure
(the merged op's name is ``"+".join(ops)``, its concats ``<name>.wcat<i>``).

Conditions: at least two einsum or matmul ops (plain: unfused, unsplit) with one kernel, equation
and alpha, reading the same tensor on port ``a``; their ``b`` operands are parameters of one shape
with a letter kept in the output and absent from ``a`` (the stacking axis ``along``: ``h`` above,
``f`` for ``bsd,df->bsf``). Stacked along the head dim ``e`` instead (``along="e"``), each head's
k and v sit side by side, as in Megatron-LM's fused QKV weight, so a split over the heads gives
every device its own heads' k and v in one GEMM. What it buys: the shared input is read once and
one launch replaces n, and the GEMM's shape changes (under the efficiency curves, fewer or fuller
waves). What it costs in the cost model: in an inference program, nothing for the concat (a
weights-only op, folded at load time: ``ir.folding``) nor for the slices (views); in a training
step the concat runs every step (the weights change).
"""

from __future__ import annotations

from itertools import combinations
from typing import Sequence

from ir.graph import Graph, Op, Shards, Tensor
from ir.rewrites.errors import RewriteError
from ir.rewrites.recompute import is_copy, with_copies
from ir.rewrites.shard import get_op
from ir.rewrites.substitute_attention import contraction_letters

KERNELS = ("einsum", "matmul")


def _stack_letters(la: str, lb: str, lo: str) -> list[str]:
    """The letters a merge can stack along: the weight's, kept in the output, not in ``a``."""
    return [L for L in lb if L in lo and L not in la]


def stack_letters(g: Graph, op: str) -> list[str]:
    """The letters ``merge_matmuls`` can stack ``op``'s weights along (``along``)."""
    view = contraction_letters(g.ops[op], g)
    return _stack_letters(*view[:3]) if view is not None else []


def mergeable(g: Graph, ops: Sequence[str], along: str | None = None) -> str | None:
    """Why ``ops`` cannot be merged, or ``None`` when they can."""
    if len(ops) < 2 or len(set(ops)) != len(ops):
        return f"needs at least two distinct ops, got {list(ops)}"
    os_ = []
    for n in ops:
        o = g.ops.get(n)
        if o is None:
            return f"no operation {n!r}"
        if o.kernel not in KERNELS or contraction_letters(o, g) is None:
            return f"{n} ({o.kernel}) is not a plain {' or '.join(KERNELS)}"
        os_.append(o)
    first = os_[0]
    for o in os_[1:]:
        if o.kernel != first.kernel or o.params_key != first.params_key:
            return f"{o.name} and {first.name} differ in kernel or params ({o.params_key} vs {first.params_key})"
        if o.input_map["a"] != first.input_map["a"]:
            return f"{o.name} reads {o.input_map['a']}, {first.name} reads {first.input_map['a']}: no shared input"
    ws = [g.tensors[o.input_map["b"]] for o in os_]
    if any(w.role != "parameter" for w in ws):
        return f"the weights {[w.name for w in ws if w.role != 'parameter']} are not parameters"
    if len({w.shape for w in ws}) != 1 or len({w.dtype for w in ws}) != 1:
        return f"the weights differ in shape or dtype: {[(w.name, list(w.shape)) for w in ws]}"
    la, lb, lo, _ = contraction_letters(first, g)
    letters = _stack_letters(la, lb, lo)
    if not letters:
        return f"{first.name}'s weight has no output letter to stack along ({la},{lb}->{lo})"
    if along is not None and along not in letters:
        return f"cannot stack along {along!r}: the letters of {first.name}'s weight kept in its output are {letters}"
    name = "+".join(ops)
    if name in g.ops or f"{name}.out" in g.tensors:
        return f"an operation or tensor named {name} exists"
    return None


def merge_matmuls(g: Graph, ops: Sequence[str], along: str | None = None) -> Graph:
    """Merge contractions sharing their input ``a`` into one over the concatenated weights,
    stacked along the weight letter ``along`` (default: the first one it can be; see the module
    docstring). When the ops are laid out alike and none splits that letter, the merged op keeps
    their layout (each shard grown along it) and the slices keep theirs."""
    why = mergeable(g, ops, along)
    if why:
        raise RewriteError(f"cannot merge {list(ops)}: {why}")
    copies = [n for n in ops if is_copy(g.ops, n)]
    if copies:  # unshard drops copies before it splits merges: the merge would lose its inputs
        raise RewriteError(f"cannot merge {list(ops)}: {copies[0]} is a recomputed copy (recompute{{...}}); merge "
                           f"the originals first, then recompute")
    os_ = [g.ops[n] for n in ops]
    first = os_[0]
    la, lb, lo, _ = contraction_letters(first, g)
    letter = along or _stack_letters(la, lb, lo)[0]
    wax, oax = lb.index(letter), lo.index(letter)
    name = "+".join(ops)
    w0 = g.tensors[first.input_map["b"]]
    ext = w0.shape[wax]
    dev = int(first.shards.device[0])
    new_ops: list[Op] = []
    tensors: dict[str, Tensor | None] = {}
    prev = w0.name
    for i, o in enumerate(os_[1:], start=1):
        cname = f"{name}.wcat{i}"
        shape = w0.shape[:wax] + ((i + 1) * ext,) + w0.shape[wax + 1:]
        tensors[f"{cname}.out"] = Tensor(f"{cname}.out", shape, w0.dtype, "intermediate")
        new_ops.append(Op(cname, "concat", (("a", prev), ("b", o.input_map["b"])), f"{cname}.out", {"axis": wax},
                          Shards.whole(shape[:wax] + shape[wax + 1:], dev)))
        prev = f"{cname}.out"
    out0 = g.tensors[first.output]
    oext = out0.shape[oax]
    mshape = out0.shape[:oax] + (len(os_) * oext,) + out0.shape[oax + 1:]
    tensors[f"{name}.out"] = Tensor(f"{name}.out", mshape, out0.dtype, "intermediate")
    new_ops.append(Op(name, first.kernel, (("a", first.input_map["a"]), ("b", prev)), f"{name}.out",
                      dict(first.params), _grown(g, os_, letter, len(os_)) or Shards.whole(mshape, dev)))
    replace = {o.name: Op(o.name, "slice", (("x", f"{name}.out"),), o.output,
                          {"axis": oax, "start": i * oext, "stop": (i + 1) * oext, "step": 1}, o.shards)
               for i, o in enumerate(os_)}
    # the merged op waits for every weight, and each slice for the merged op: op order follows
    return g.with_ops(replace, insert_after={first.name: new_ops}, tensors=tensors).in_program_order()


def _grown(g: Graph, os_: list[Op], letter: str, n: int) -> Shards | None:
    """The shards of the ops ``os_`` (all alike, none splitting the index dim of ``letter``) with
    that dim ``n`` times as long: the merged op laid out as they were; None if they differ."""
    sh = os_[0].shards
    if any(not (o.shards is sh or o.shards == sh) for o in os_[1:]):
        return None
    sig = g.signature(os_[0])
    d = sig.dims.index(letter) if letter in sig.dims else -1
    if d < 0 or not ((sh.lo[:, d] == 0) & (sh.hi[:, d] == sig.extents[d])).all():
        return None
    hi = sh.hi.copy()
    hi[:, d] = sig.extents[d] * n
    return Shards(sh.lo, hi, sh.device)


def _weights_of(g: Graph, op: str) -> list[str] | None:
    """The parameters a merged op's concat chain stacks, in order, or None if ``op`` is not merged."""
    o = g.ops[op]
    t = o.input_map.get("b")
    leaves: list[str] = []
    i = 0
    while t in g.producers and g.producers[t].startswith(f"{op}.wcat"):
        c = g.ops[g.producers[t]]
        if c.kernel != "concat":
            return None
        leaves.insert(0, c.input_map["b"])
        t = c.input_map["a"]
        i += 1
    return [t] + leaves if i else None


def split_matmuls(g: Graph, op: str) -> Graph:
    """Undo ``merge_matmuls``: the slices become the original contractions again."""
    o = get_op(g, op)
    ws = _weights_of(g, op) if o.kernel in KERNELS else None
    if not ws:
        raise RewriteError(f"{op} is not a merged contraction (no {op}.wcat<i> concat of weights feeds it)")
    copies = with_copies(g, [op])
    if copies:
        raise RewriteError(f"cannot split {op}: it is recomputed or a recomputed copy; unrecompute{{op=...}} first")
    outside = _outside_readers(g, op, len(ws))
    if outside:
        raise RewriteError(f"{op}'s stacked weights are read by {outside[0]} too (a training step of a program with "
                           f"merged matmuls differentiates the merged op): splitting it would orphan that reader")
    readers = g.consumers.get(o.output, [])
    slices = sorted((g.ops[r] for r, _ in readers), key=lambda s: s.params.get("start", 0))
    if len(slices) != len(ws) or any(s.kernel != "slice" for s in slices):
        raise RewriteError(f"{op}'s output must be read by exactly {len(ws)} slice ops, one per weight")
    ext = g.tensors[o.output].shape[slices[0].params["axis"]] // len(ws)
    for i, s in enumerate(slices):
        if (s.params.get("start"), s.params.get("stop"), s.params.get("step", 1)) != (i * ext, (i + 1) * ext, 1):
            raise RewriteError(f"{s.name} does not slice block {i} of {op}'s output")
    replace: dict[str, Op | None] = {s.name: Op(s.name, o.kernel, (("a", o.input_map["a"]), ("b", w)), s.output,
                                                dict(o.params), s.shards) for s, w in zip(slices, ws)}
    tensors: dict[str, Tensor | None] = {o.output: None}
    replace[op] = None
    for i in range(1, len(ws)):
        replace[f"{op}.wcat{i}"] = None
        tensors[f"{op}.wcat{i}.out"] = None
    return g.with_ops(replace, tensors=tensors)


def merge_sites(g: Graph) -> list[tuple[str, ...]]:
    """Groups of contractions that ``merge_matmuls`` can merge: all readers of one input alike
    (Q, K and V), and each pair of them (K and V alone make one GEMM of a better shape for some
    layouts)."""
    groups: dict[tuple, list[str]] = {}
    for n, o in g.ops.items():
        if o.kernel in KERNELS and "a" in o.input_map and not is_copy(g.ops, n):
            groups.setdefault((o.input_map["a"], o.kernel, o.params_key), []).append(n)
    out = []
    for v in groups.values():
        if len(v) > 1 and mergeable(g, v) is None:
            out.append(tuple(v))
            if len(v) > 2:
                out += list(combinations(v, 2))
    return out


def _outside_readers(g: Graph, op: str, n_weights: int) -> list[str]:
    """Readers of ``op``'s concat chain other than the chain and ``op`` itself."""
    chain = {op} | {f"{op}.wcat{i}" for i in range(1, n_weights)}
    return [r for i in range(1, n_weights) for r, _ in g.consumers.get(f"{op}.wcat{i}.out", []) if r not in chain]


def merged_matmuls(g: Graph) -> list[str]:
    """Merged contractions that ``split_matmuls`` can split: not those of a training step built from
    a program with merged matmuls, whose backward reads the stacked weights (they are its program)."""
    out = []
    for n, o in g.ops.items():
        ws = _weights_of(g, n) if o.kernel in KERNELS else None
        if ws and not _outside_readers(g, n, len(ws)):
            out.append(n)
    return out
