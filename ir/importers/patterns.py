"""Peephole patterns over an imported program: op sequences of exports -> the kernels we shard.

Each pattern finds its anchor op, checks that every intermediate it swallows has that one reader
and is not a graph output, and replaces the sequence by one op that writes the last op's output
tensor (so readers and outputs are untouched). Patterns (before -> after):

- ``y = matmul|einsum(x, W); z = add(y, b)`` with ``W`` a 2-D parameter, ``b`` a ``[O]``
  parameter -> ``z = linear(x, W, b)`` (then data/tensor parallel shard as on built-in MLPs);
- ``s = scale(x, 1/√2); e = erf(s); a = add(e, 1); m = mul(x, a); z = scale(m, 0.5)`` (and the
  orders exports use: ``0.5·x`` first, or the half applied to ``a``) -> ``z = gelu_erf(x)``;
- ``p = pow(x, 2); r = reduce_mean(p, -1); k = reshape(r, [..., 1]); v = add(k, eps);
  q = sqrt(v); i = reciprocal(q); n = mul(x, i); z = mul(n, gamma)`` (or ``n = div(x, q)``)
  -> ``z = rmsnorm(x, gamma, eps)``;
- ``s = sigmoid(x); z = mul(x, s)`` -> ``z = silu(x)``;
- ``s = softplus(x); t = tanh(s); z = mul(x, t)`` -> ``z = mish(x)`` (``nn.Mish`` exported
  before opset 18, which has a ``Mish`` op);
- ``t = permute(W, [1, 0]); z = matmul|einsum(x, t)`` with ``W`` a 2-D parameter ->
  ``z = einsum(x, W)`` reading ``W`` transposed (a weight tied to another use of it, such as an
  embedding table reused as the output projection: no copy of the table each step).
"""

from __future__ import annotations

import math

from ir.importers.program import PendingOp, Program


def _only_reader(prog: Program, tensor: str, outputs: set[str]) -> PendingOp | None:
    if tensor in outputs:
        return None
    r = prog.readers(tensor)
    return r[0] if len(r) == 1 else None


def _other(op: PendingOp, tensor: str) -> str | None:
    """The other input of a two-input op that reads ``tensor``."""
    vals = list(op.inputs.values())
    if len(vals) != 2 or tensor not in vals:
        return None
    return vals[1] if vals[0] == tensor else vals[0]


def _replace(prog: Program, old: list[PendingOp], new: PendingOp) -> None:
    """Drop ``old`` ops; ``new`` takes the place (order) of the last of them."""
    names = {o.name for o in old}
    ops = {}
    for n, o in prog.ops.items():
        if n == old[-1].name:
            ops[new.name] = new
        elif n not in names:
            ops[n] = o
    prog.ops = ops


def _linear(prog: Program, outputs: set[str]) -> bool:
    for a in list(prog.ops.values()):
        if a.kernel not in ("matmul", "einsum") or a.params.get("alpha", 1.0) != 1.0:
            continue
        if a.kernel == "einsum":
            eq = a.params.get("equation", "").replace(" ", "")
            lhs, _, out = eq.partition("->")
            ta, _, tb = lhs.partition(",")
            if not (tb == "kn" and ta.endswith("mk") and out == ta[:-2] + "mn"):
                continue
        w = a.inputs["b"]
        if w not in prog.values or len(prog.spec(w).shape) != 2:
            continue
        add = _only_reader(prog, a.output, outputs)
        if add is None or add.kernel != "add":
            continue
        b = _other(add, a.output)
        if b is None or b not in prog.values or prog.spec(b).shape != (prog.spec(w).shape[1],):
            continue
        _replace(prog, [a, add], PendingOp(a.name, "linear", {"x": a.inputs["a"], "W": w, "b": b}, {}, add.output))
        return True
    return False


def _scale_of(op: PendingOp | None, alpha: float) -> bool:
    return op is not None and op.kernel == "scale" and math.isclose(op.params.get("alpha", 1.0), alpha, rel_tol=1e-6)


def _gelu(prog: Program, outputs: set[str]) -> bool:
    for e in list(prog.ops.values()):
        if e.kernel != "erf":
            continue
        s = prog.producer(e.inputs["x"])
        if not _scale_of(s, 1 / math.sqrt(2)) or _only_reader(prog, s.output, outputs) is not e:
            continue
        x = s.inputs["x"]
        a = _only_reader(prog, e.output, outputs)
        if a is None or a.kernel != "add" or prog.scalar(_other(a, e.output) or "") != 1.0:
            continue
        m = _only_reader(prog, a.output, outputs)
        if m is None:
            continue
        chain = None
        if m.kernel == "mul":
            f = _other(m, a.output)
            if f == x:  # 0.5 applied last
                z = _only_reader(prog, m.output, outputs)
                if _scale_of(z, 0.5):
                    chain = [s, e, a, m, z]
            else:  # 0.5·x first
                h = prog.producer(f) if f else None
                if _scale_of(h, 0.5) and h.inputs["x"] == x and _only_reader(prog, h.output, outputs) is m:
                    chain = [s, e, a, h, m]
        elif _scale_of(m, 0.5):  # the half applied to (1 + erf)
            z = _only_reader(prog, m.output, outputs)
            if z is not None and z.kernel == "mul" and _other(z, m.output) == x:
                chain = [s, e, a, m, z]
        if chain:
            last = chain[-1]
            _replace(prog, chain, PendingOp(e.name, "gelu_erf", {"x": x}, {}, last.output))
            return True
    return False


def _rmsnorm(prog: Program, outputs: set[str]) -> bool:
    for r in list(prog.ops.values()):
        if r.kernel != "reduce_mean":
            continue
        rank = len(prog.spec(r.inputs["x"]).shape)
        if r.params.get("dim", -1) % rank != rank - 1:
            continue
        p = prog.producer(r.inputs["x"])
        if p is None or _only_reader(prog, p.output, outputs) is not r:
            continue
        if p.kernel == "pow" and p.params.get("exponent") == 2.0:
            x = p.inputs["x"]
        elif p.kernel == "mul" and p.inputs["a"] == p.inputs["b"]:
            x = p.inputs["a"]
        else:
            continue
        chain = [p, r]
        k = _only_reader(prog, r.output, outputs)
        if k is not None and k.kernel == "reshape":
            chain.append(k)
            k = _only_reader(prog, k.output, outputs)
        if k is None or k.kernel != "add":
            continue
        eps = prog.scalar(_other(k, chain[-1].output) or "")
        if eps is None:
            continue
        chain.append(k)
        q = _only_reader(prog, k.output, outputs)
        if q is None or q.kernel != "sqrt":
            continue
        chain.append(q)
        n = _only_reader(prog, q.output, outputs)
        if n is not None and n.kernel == "reciprocal":
            chain.append(n)
            n = _only_reader(prog, n.output, outputs)
            ok = n is not None and n.kernel == "mul" and _other(n, chain[-1].output) == x
        else:
            ok = n is not None and n.kernel == "div" and n.inputs["a"] == x and n.inputs["b"] == q.output
        if not ok:
            continue
        chain.append(n)
        g = _only_reader(prog, n.output, outputs)
        gamma = _other(g, n.output) if g is not None and g.kernel == "mul" else None
        if gamma is None or gamma not in prog.values or prog.spec(gamma).shape != (prog.spec(x).shape[-1],):
            continue
        chain.append(g)
        _replace(prog, chain, PendingOp(r.name, "rmsnorm", {"x": x, "gamma": gamma}, {"eps": eps}, g.output))
        return True
    return False


def _silu(prog: Program, outputs: set[str]) -> bool:
    for s in list(prog.ops.values()):
        if s.kernel != "sigmoid":
            continue
        m = _only_reader(prog, s.output, outputs)
        if m is not None and m.kernel == "mul" and _other(m, s.output) == s.inputs["x"]:
            _replace(prog, [s, m], PendingOp(m.name, "silu", {"x": s.inputs["x"]}, {}, m.output))
            return True
    return False


def _mish(prog: Program, outputs: set[str]) -> bool:
    for s in list(prog.ops.values()):
        if s.kernel != "softplus":
            continue
        t = _only_reader(prog, s.output, outputs)
        if t is None or t.kernel != "tanh":
            continue
        m = _only_reader(prog, t.output, outputs)
        if m is not None and m.kernel == "mul" and _other(m, t.output) == s.inputs["x"]:
            _replace(prog, [s, t, m], PendingOp(m.name, "mish", {"x": s.inputs["x"]}, {}, m.output))
            return True
    return False


def _transposed_operand(prog: Program, outputs: set[str]) -> bool:
    for t in list(prog.ops.values()):
        if t.kernel != "permute" or t.params.get("perm") != [1, 0] or t.inputs["x"] not in prog.values:
            continue
        c = _only_reader(prog, t.output, outputs)
        if c is None or c.kernel not in ("matmul", "einsum") or len(c.inputs) != 2:
            continue
        eq = c.params.get("equation", "mk,kn->mn").replace(" ", "")
        lhs, _, out = eq.partition("->")
        terms = lhs.split(",")
        port = next(p for p in ("a", "b") if c.inputs[p] == t.output)
        i = "ab".index(port)
        if c.inputs["a"] == c.inputs["b"] or len(terms[i]) != 2:
            continue
        terms[i] = terms[i][::-1]
        params = {**c.params, "equation": f"{','.join(terms)}->{out}"}
        _replace(prog, [t, c], PendingOp(c.name, "einsum", {**c.inputs, port: t.inputs["x"]}, params, c.output))
        return True
    return False


PATTERNS = (_transposed_operand, _linear, _gelu, _rmsnorm, _silu, _mish)


def apply_patterns(prog: Program, outputs: set[str]) -> dict[str, int]:
    """Apply every pattern until none matches; returns how often each matched."""
    hits = {p.__name__.lstrip("_"): 0 for p in PATTERNS}
    changed = True
    while changed:
        changed = False
        for p in PATTERNS:
            while p(prog, outputs):
                hits[p.__name__.lstrip("_")] += 1
                changed = True
    prog.prune(outputs)
    return hits
