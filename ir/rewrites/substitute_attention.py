"""Substitution: the attention pattern becomes one ``attention`` op; ``unfuse_attention`` undoes it.

``fuse_attention(g, "attn_qk")`` on the built-in transformer's form (``bmm`` with a permuted k)::

    k_t:          k_t.out = permute(k_proj.out, perm=[0,1,3,2])        [b, h, e, t]
    attn_qk:      attn_qk.out = bmm(q_proj.out, k_t.out, alpha=c)      [b, h, s, t]
    attn_softmax: attn_softmax.out = softmax(attn_qk.out)               [b, h, s, t]
    attn_av:      attn_av.out = bmm(attn_softmax.out, v_proj.out)      [b, h, s, e]
 -> attn_qk+attn_av: attn_av.out = attention(q_proj.out, k_proj.out, v_proj.out, scale=c)

and on the einsum form of the gpt/llama workloads (``einsum(q, k) → [scale] → [causal_mask] →
softmax → einsum(·, v)``, grouped-query heads included: ``q[b, kvh, g, s, e]`` with
``k[b, kvh, t, e]``; multi-query heads: ``q[b, h, s, e]`` with ``k[b, t, e]``). The scores,
probabilities and the transposed k disappear; the attention op's ``origin`` param records the
replaced ops (names, kernels, params, inputs, outputs) so ``unfuse_attention`` restores them exactly
(``unshard`` does, so a plan's logical program is the program the user wrote).

The pattern, checked op by op (each refusal names the failing condition):
- the scores op is an einsum/matmul/bmm (not fused, reduction not split) whose only contracted
  letter is the head dim ``e``; its first operand is ``q[*L, s, e]`` and its output ``[*L, s, t]``;
  its second operand is ``k[*Lk, t, e]`` (``Lk`` a prefix of ``L``) or a relayout of it: ``permute``
  ops and ``reshape`` ops that only drop size-1 dims (squeezes), each read by nothing else;
- ``scale`` ops on either operand, each read only by the next op of the chain, are absorbed (their
  factors multiply into the attention's ``scale``): torch's exporter writes
  ``scaled_dot_product_attention`` as ``bmm(scale(q, √c), scale(permute(k), √c))``. On the k side
  they may sit anywhere between the relayouts. The k side is walked up until k is ``[*Lk, t, e]``
  or, once a relayout is absorbed, one op brings it there; then the fused graph keeps that op
  (``<attention>.k``; in a training step its inverse brings k's gradient back, ``<attention>.dk_t``),
  and ``origin`` records it: ``origin["k_perm"]``, the permute to ``[*Lk, t, e]`` of torch's
  ``permute(reshape(k_proj), [0, 2, 3, 1])`` from ``[b, t, h, e]``; ``origin["k_shape"]``, the
  squeeze of multi-query attention's single k head (Falcon: kᵀ ``[b, 1, e, t]`` is squeezed to
  ``[b, e, t]`` for ``einsum(q[b, h, s, e], ·)``, so a squeeze of k ``[b, 1, t, e]`` to ``[b, t, e]``
  stays). A k that only a permute and a squeeze together bring to ``[*Lk, t, e]`` is refused;
- then, each the only reader of the previous tensor: ``scale`` ops (factors multiply into the
  attention's ``scale``), at most one ``causal_mask`` with ``fill`` -inf, at most one ``add`` of a
  bias onto the scores (T5's relative-position bias, ALiBi, a padding mask: its other operand
  broadcasts onto the scores, which keep their shape; it becomes the attention's ``bias``; a scale
  after it, which would scale the bias too, is refused), and a ``softmax``;
- optionally torch's NaN guard on the probabilities ``p`` (``Where(IsNaN(p), 0, p)``, imported as
  ``masked_fill(x=p, c=compare(p, p, op="ne"), value=0)``), ``p`` read by those two only and the
  test by the ``masked_fill`` only. It is absorbed only when no row can be fully masked (no mask,
  or a causal mask with offset >= 0): then it is the identity on finite scores; over a fully masked
  row it turns NaNs into zeros, which the fused attention would not, so the match is refused;
- the values op contracts exactly ``t``: ``probs[*L, s, t] · v[*Lk, t, ev] -> [*L, s, ev]``
  with ``alpha`` 1 (v is read as it is: Falcon's squeeze of its single v head stays outside);
- no intermediate is a graph output; every replaced op is plain (unfused, unsplit).

The attention op takes the values op's shards when they keep ``ev`` whole (its index dims are
the first ones of the values op), else one shard on the values op's first device; ``unfuse``
maps its shards back the same way.

In a training step (``ir.autodiff``), the pattern's intermediates are also read by its backward
ops, named ``<op>.d<tag>`` by the VJP rules. They are replaced too: ``attention_lse`` and
``attention_grad_q/k/v`` (scores recomputed, FlashAttention's backward) write the tensors that
held the gradient contributions of q, k and v, so the rest of the backward is untouched; every
other backward result must stay inside the set, and the output gradient must come from outside
it. The gradients of q and k leave through the VJPs of the outermost absorbed op on their side
(``<q scale>.dx``, ``<k permute, squeeze or scale>.dx``), else the scores op's (``.da``/``.db``); the
absorbed scales' and guard's VJPs (``scale``, ``where_grad``; ``compare`` has none) are replaced
with the rest. ``origin["backward"]`` records the replaced backward ops for ``unfuse_attention``.
A trainable bias's gradient contribution leaves through the add's ``reduce_to`` (``<add>.d<port>``,
a broadcast bias) or, for a bias of the scores' shape, through the gradient of the add's output
(``<next op>.dx``, which the add passes on unchanged); ``attention_grad_bias`` writes that tensor.
"""

from __future__ import annotations

import re
import weakref
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ir.graph import Graph, Op, Shards, Tensor
from ir.kernels import SignatureError, get_kernel
from ir.rewrites.errors import RewriteError
from ir.rewrites.shard import get_op

_BATCH = "abcdefgh"


def contraction_letters(o: Op, g: Graph) -> tuple[str, str, str, float] | None:
    """``(letters of a, letters of b, letters of the output, alpha)`` of a plain contraction op."""
    if o.params.get("split"):
        return None
    if o.kernel == "einsum":
        m = re.fullmatch(r"([a-z]+),([a-z]+)->([a-z]+)", str(o.params.get("equation", "")).replace(" ", ""))
        return (m.group(1), m.group(2), m.group(3), float(o.params.get("alpha", 1.0))) if m else None
    if o.kernel == "matmul":
        return "mk", "kn", "mn", float(o.params.get("alpha", 1.0))
    if o.kernel == "bmm":
        r = len(g.tensors[o.input_map["a"]].shape)
        bl = _BATCH[: r - 2]
        return bl + "mk", bl + "kn", bl + "mn", float(o.params.get("alpha", 1.0))
    return None


@dataclass(frozen=True)
class AttentionMatch:
    """A matched attention pattern: the tensors the attention op reads, its params, the ops it replaces."""

    q: str
    k: str
    v: str
    scale: float
    causal: bool
    offset: int
    ops: tuple[tuple[str, str], ...]  # (role, op name) in data-flow order
    output: str
    backward: tuple[str, ...] = ()  # in a training step: the pattern's backward ops, in data-flow order
    grads: tuple[tuple[str, str], ...] = ()  # (q|k|v, backward op writing that input's gradient contribution)
    dy: str | None = None  # the gradient of the attention's output
    # the one relayout of ``k`` to [*Lk, t, e] the fused graph keeps, if any: ("permute", perm) or ("reshape", shape)
    k_relayout: tuple[str, tuple[int, ...]] | None = None
    bias: str | None = None  # the tensor an absorbed ``add`` put onto the scores

    @property
    def k_perm(self) -> tuple[int, ...] | None:
        """The kept relayout's ``perm`` when it is a permute."""
        return self.k_relayout[1] if self.k_relayout is not None and self.k_relayout[0] == "permute" else None


#: roles of the absorbed ops on k's side: the relayouts (kᵀ, the squeeze of a single k head) and the scales
K_RELAYOUTS = ("k_t", "k_squeeze")
_K_SIDE = ("k_scale",) + K_RELAYOUTS
#: the kernels of the relayout of k a fused graph may keep, and the ``origin`` key that records its argument
_KEPT_ORIGIN = {"permute": "k_perm", "reshape": "k_shape"}
_UNIT = "1"  # the letter of a size-1 dim of k that a squeeze drops

_BACKWARD = re.compile(r"^(?P<op>.+)\.d[a-z_]+(\.\d+)?$")


def backward_of(g: Graph, op: str) -> str | None:
    """The forward op whose VJP emitted ``op`` (``ir.autodiff`` names them ``<op>.d<tag>``), or None."""
    m = _BACKWARD.match(op)
    return m.group("op") if m and m.group("op") in g.ops and m.group("op") != op else None


def _backward_index(g: Graph) -> dict[str, list[tuple[int, str]]]:
    """forward op -> [(program position, backward op)] of the ops ``ir.autodiff`` emitted for it,
    memoised on the graph (as its cached properties are): ``attention_sites`` matches every
    scores candidate, and one scan of the ops per candidate was most of a 32-layer model's
    rewrite time."""
    idx = g.__dict__.get("_backward_index")
    if idx is None:
        idx = {}
        for i, n in enumerate(g.topo_order):
            f = backward_of(g, n)
            if f is not None:
                idx.setdefault(f, []).append((i, n))
        g.__dict__["_backward_index"] = idx
    return idx


def _sole_reader(g: Graph, t: str) -> tuple[str, str] | str:
    """The one forward ``(op, port)`` reading intermediate ``t`` (backward ops aside), or why not one."""
    if g.tensors[t].role == "output":
        return f"{t} is a graph output and must stay materialised"
    readers = [(r, p) for r, p in g.consumers.get(t, []) if backward_of(g, r) is None]
    if len(readers) != 1:
        return f"{t} is read by {[r for r, _ in readers]}, not by one op"
    return readers[0]


def _plain(o: Op) -> bool:
    return not o.params.get("split")


def _absorb_scales(g: Graph, t: str, role: str, ops: list[tuple[str, str]]) -> tuple[str, float]:
    """Walk up from ``t`` through ``scale`` ops that nothing else reads (torch's exporter scales q and
    kᵀ each by √scale), prepending them to ``ops``: the first tensor that is not such a scale's
    output, and the product of their factors."""
    factor = 1.0
    while True:
        prod = g.producers.get(t)
        p = g.ops.get(prod) if prod else None
        if p is None or p.kernel != "scale" or not _plain(p) or isinstance(_sole_reader(g, t), str):
            return t, factor
        factor *= float(p.params.get("alpha", 1.0))
        ops.insert(0, (role, prod))
        t = p.input_map["x"]


def _nan_guard(g: Graph, p: str) -> tuple[str, str, str] | str | None:
    """torch's guard on the probabilities ``p`` (``Where(IsNaN(p), 0, p)``, imported as
    ``masked_fill(x=p, c=compare(p, p, op="ne"), value=0)``): ``(compare op, masked_fill op, its
    output)`` when it is there and ``p`` feeds nothing else; None when ``p`` has a single reader (no
    guard to look for); the reason when the readers look like the guard but are not exactly it."""
    if g.tensors[p].role == "output":
        return f"{p} is a graph output and must stay materialised"
    readers = [(r, pt) for r, pt in g.consumers.get(p, []) if backward_of(g, r) is None]
    if len(readers) == 1:
        return None
    cmp_ = sorted({r for r, _ in readers if g.ops[r].kernel == "compare"})  # it reads p on both ports
    fill = [r for r, pt in readers if g.ops[r].kernel == "masked_fill" and pt == "x"]
    if len(readers) != 3 or len(cmp_) != 1 or len(fill) != 1:
        return f"{p} is read by {[r for r, _ in readers]}, not by one op (nor by a NaN guard alone)"
    c, f = g.ops[cmp_[0]], g.ops[fill[0]]
    if (c.input_map.get("a") != p or c.input_map.get("b") != p or c.params.get("op", "eq") != "ne"
            or not _plain(c)):
        return f"{c.name} is not the NaN test compare({p}, {p}, op='ne') of a NaN guard"
    sole = _sole_reader(g, c.output)
    if isinstance(sole, str):
        return f"cannot absorb the NaN guard {c.name}: {sole}"
    if sole != (f.name, "c"):
        return f"{c.output} (the NaN test) is read by {sole[0]}, not as the condition of {f.name}"
    value = f.params.get("value")
    if (not isinstance(value, (int, float)) or float(value) != 0.0 or f.params.get("fill_where", "nonzero") != "nonzero"
            or not _plain(f)):
        return f"{f.name} is not the NaN guard masked_fill(x={p}, c=isnan, value=0, fill_where='nonzero')"
    return c.name, f.name, f.output


def _unsqueezed(letters: str, src: tuple[int, ...], dst: tuple[int, ...]) -> str | None:
    """The letters of the input ``[src]`` of a reshape whose output ``[dst]`` has ``letters``, when the
    reshape only drops size-1 dims (a squeeze; each dropped dim is ``_UNIT``), else None."""
    out, j = [], 0
    for n in src:  # the kept dims in order; a size-1 dim matched greedily (size-1 dims hold the same data)
        if j < len(dst) and n == dst[j]:
            out.append(letters[j])
            j += 1
        elif n == 1:
            out.append(_UNIT)
        else:
            return None
    return "".join(out) if j == len(dst) else None


def _kept_relayout(letters: str, shape: tuple[int, ...], lead: str, t: str, e: str
                   ) -> tuple[str, tuple[int, ...]] | str | None:
    """The one op bringing a k with dims ``letters`` (``_UNIT``: a size-1 dim a squeeze dropped) and
    ``shape`` to ``[*Lk, t, e]``: None when it is in that layout already, ``("permute", perm)``, or
    ``("reshape", shape)`` dropping its size-1 dims; else why no single op does."""
    if _is_k_layout(letters, lead, t, e):
        return None
    dims = letters.replace(_UNIT, "")
    nk = len(dims) - 2
    want = lead[:nk] + t + e
    if nk < 0 or sorted(dims) != sorted(want):
        return f"letters {letters}, not a layout of k[*Lk, t, e] with Lk a prefix of {lead}"
    if dims == letters:
        return "permute", tuple(letters.index(x) for x in want)
    if dims == want:
        return "reshape", tuple(n for x, n in zip(letters, shape) if x != _UNIT)
    return f"letters {letters}, which no single permute or squeeze brings to k[*Lk, t, e]"


def _relayout(kernel: str, arg: tuple[int, ...] | list[int], src: tuple[int, ...]
              ) -> tuple[dict, tuple[int, ...], dict]:
    """``(params, output shape, params of the inverse)`` of the kept relayout ``(kernel, arg)`` of a
    k of shape ``src`` (``_kept_relayout``)."""
    if kernel == "permute":
        back = [0] * len(arg)
        for i, x in enumerate(arg):
            back[x] = i
        return {"perm": list(arg)}, tuple(src[i] for i in arg), {"perm": back}
    return {"shape": list(arg), "from": list(src)}, tuple(arg), {"shape": list(src), "from": list(arg)}


def _whole(kernel: str, params: dict, x: Any, device: int) -> Shards:
    """One shard on ``device`` of a one-input op reading ``x`` (a reshape's index space is not its output's shape)."""
    return Shards.whole(get_kernel(kernel).signature({"x": x}, params).extents, device)


def _origin_relayout(origin: dict) -> tuple[str, list[int]] | None:
    """The relayout of k the fused graph kept, as the attention op's ``origin`` records it."""
    return next(((kernel, origin[key]) for kernel, key in _KEPT_ORIGIN.items() if origin.get(key) is not None), None)


def _match_k(g: Graph, op: str, lb: str, lead: str, t: str, e: str, ops: list[tuple[str, str]]
             ) -> tuple[str, float, tuple[str, tuple[int, ...]] | None, int] | str:
    """The k side of scores op ``op`` (second operand letters ``lb``, scores ``[*lead, s, t]``):
    ``(k, product of the absorbed scales, the relayout of k the fused graph keeps, len(Lk))``,
    the absorbed ops prepended to ``ops``; or why it is not ``k[*Lk, t, e]``. Walks up through
    scales, permutes and squeezes (each read by the next op only) until k is in that layout or,
    after at least one relayout, one kept op brings it there: torch's kᵀ of ``reshape(k_proj)``
    ``[b, t, h, e]`` is one permute ``[0, 2, 3, 1]`` (a permute to ``[b, h, t, e]`` stays), a
    multi-query kᵀ ``[b, 1, e, t]`` is squeezed to ``[b, e, t]`` (a squeeze of ``[b, 1, t, e]`` stays)."""
    k, factor = _absorb_scales(g, g.ops[op].input_map["b"], "k_scale", ops)
    letters, moved = lb, False
    while True:
        kept = _kept_relayout(letters, g.tensors[k].shape, lead, t, e)
        if kept is None or (moved and not isinstance(kept, str)):
            break
        prod = g.producers.get(k)
        p = g.ops.get(prod) if prod else None
        if p is not None and p.kernel == "permute" and p.params.get("perm") is not None:
            xl = [""] * len(p.params["perm"])
            for i, src in enumerate(p.params["perm"]):
                xl[src] = letters[i]
            up, role = "".join(xl), "k_t"
        elif p is not None and p.kernel == "reshape":
            up, role = _unsqueezed(letters, g.tensors[p.input_map["x"]].shape, g.tensors[k].shape), "k_squeeze"
            if up is None:
                break
        else:
            break
        sole = _sole_reader(g, k)
        if isinstance(sole, str):
            return f"cannot absorb the {p.kernel} {prod}: {sole}"
        if not _plain(p):
            return f"cannot absorb the {p.kernel} {prod}: its work is split"
        letters, moved = up, True
        ops.insert(0, (role, prod))
        k, f = _absorb_scales(g, p.input_map["x"], "k_scale", ops)
        factor *= f
    if not moved and kept is not None:
        return f"{op}'s second operand must be k[*Lk, t, e] or a permute or squeeze of it; its letters are {lb}"
    if isinstance(kept, str):
        return f"{op}'s second operand is a permute or squeeze of a tensor with {kept}"
    return k, factor, kept, len(letters.replace(_UNIT, "")) - 2


def match_attention(g: Graph, op: str) -> AttentionMatch | str:
    """The attention pattern whose scores op is ``op``, or the reason it does not match."""
    o = g.ops.get(op)
    if o is None:
        return f"no operation {op!r}"
    view = contraction_letters(o, g)
    if view is None:
        return f"{op} ({o.kernel}) is not a plain einsum/matmul/bmm"
    la, lb, lo, alpha = view
    contracted = set(la + lb) - set(lo)
    if len(lo) < 2 or len(contracted) != 1:
        return f"{op} must contract exactly one letter (the head dim) into scores [..., s, t]; it is {la},{lb}->{lo}"
    (e,) = contracted
    s_, t_ = lo[-2], lo[-1]
    lead = lo[:-2]
    if la != lead + s_ + e:
        return f"{op}'s first operand must be q[*L, s, e] for scores [*L, s, t] = {lo}; its letters are {la}"
    q_ops: list[tuple[str, str]] = []
    q_tensor, q_factor = _absorb_scales(g, o.input_map["a"], "q_scale", q_ops)
    k_ops: list[tuple[str, str]] = []
    k_side = _match_k(g, op, lb, lead, t_, e, k_ops)
    if isinstance(k_side, str):
        return k_side
    k_tensor, k_factor, k_relayout, nk = k_side
    ops: list[tuple[str, str]] = q_ops + k_ops + [("qk", op)]
    scale, causal, offset, bias = alpha * q_factor * k_factor, False, 0, None
    t = o.output
    while True:
        sole = _sole_reader(g, t)
        if isinstance(sole, str):
            return sole
        name, _port = sole
        c = g.ops[name]
        if c.kernel == "scale" and bias is not None:
            return f"{name} scales the scores after the bias add; the attention's scale would scale the bias too"
        if c.kernel == "add" and bias is None:
            other = c.input_map["b" if _port == "a" else "a"]
            if not _plain(c) or g.tensors[c.output].shape != g.tensors[t].shape or other == t:
                return f"{name} is not an add of a bias onto the scores {t} (the scores keep their shape)"
            bias = other
            ops.append(("bias", name))
        elif c.kernel == "scale" and not causal:
            scale *= float(c.params.get("alpha", 1.0))
            ops.append(("scale", name))
        elif c.kernel == "causal_mask" and not causal:
            if c.params.get("fill") is not None:
                return f"{name} fills masked scores with {c.params['fill']}, not -inf"
            causal, offset = True, int(c.params.get("offset", 0))
            ops.append(("mask", name))
        elif c.kernel == "softmax":
            ops.append(("softmax", name))
            t = c.output
            break
        else:
            return f"{name} ({c.kernel}) between the scores and the softmax is not a scale, causal_mask or bias add"
        t = c.output
    guard = _nan_guard(g, t)
    if isinstance(guard, str):
        return guard
    if guard is not None:
        # the guard zeroes the NaN rows of a softmax over a fully masked row; the fused attention
        # computes the same values only where no row can be fully masked
        if causal and offset < 0:
            return (f"the NaN guard {guard[0]} → {guard[1]} after the softmax cannot be absorbed: the causal mask's "
                    f"offset {offset} masks whole query rows, whose NaNs the guard turns into zeros")
        ops += [("nan_test", guard[0]), ("nan_guard", guard[1])]
        t = guard[2]
    sole = _sole_reader(g, t)
    if isinstance(sole, str):
        return sole
    av_name, port = sole
    av = g.ops[av_name]
    view = contraction_letters(av, g)
    if view is None:
        return f"{av_name} ({av.kernel}) reading the probabilities is not a plain einsum/matmul/bmm"
    pa, pb, po, av_alpha = view
    lp, lv = (pa, pb) if port == "a" else (pb, pa)
    if av_alpha != 1.0:
        return f"{av_name} scales its output by {av_alpha}; the attention pattern needs alpha 1"
    ev = [x for x in lv if x not in lp]
    if (len(lp) != len(lo) or len(ev) != 1 or set(lp + lv) - set(po) != {lp[-1]}
            or lv != lp[:nk] + lp[-1] + ev[0] or po != lp[:-1] + ev[0]):
        return (f"{av_name} must contract only the key dim: probs[*L, s, t]·v[*Lk, t, ev] -> [*L, s, ev]; "
                f"its letters are {pa},{pb}->{po}")
    ops.append(("av", av_name))
    m = AttentionMatch(q_tensor, k_tensor, av.input_map["b" if port == "a" else "a"], scale, causal, offset,
                       tuple(ops), av.output, k_relayout=k_relayout, bias=bias)
    bwd = _match_backward(g, m, port)
    if isinstance(bwd, str):
        return bwd
    m = bwd
    k_spec = g.tensors[m.k].spec
    if m.k_relayout is not None:
        k_spec = type(k_spec)(_relayout(*m.k_relayout, k_spec.shape)[1], k_spec.dtype)
    try:
        get_kernel("attention").signature({"q": g.tensors[m.q].spec, "k": k_spec, "v": g.tensors[m.v].spec,
                                           **({"bias": g.tensors[m.bias].spec} if m.bias else {})},
                                          _params(m, None))
    except SignatureError as err:
        return f"the matched tensors do not make an attention: {err}"
    return m


def _match_backward(g: Graph, m: AttentionMatch, p_port: str) -> AttentionMatch | str:
    """In a training step, the pattern's backward ops: the ones ``ir.autodiff`` emitted for the pattern
    ops (``<op>.d<tag>``). Their results that leave the set are the gradients of q, k and v; every
    other result (dP, the softmax and mask gradients, dS) must be read inside the set only."""
    names = {n for _, n in m.ops}
    roles = dict(m.ops)
    idx = _backward_index(g)
    backward = [n for _, n in sorted(x for f in names for x in idx.get(f, ()))]
    for role, n in m.ops:  # the forward intermediates: read by the pattern and its backward only
        if role == "av":
            continue
        for r, _ in g.consumers.get(g.ops[n].output, []):
            if r not in names and r not in backward:
                return f"{g.ops[n].output} is read by {r}, outside the attention pattern and its backward"
    if not backward:
        return m
    v_port = "b" if p_port == "a" else "a"
    # q's and k's gradients leave the set through the VJP of the outermost op on their side (the
    # first one in data-flow order: a scale torch put on q, the permute or a scale of k), else the
    # scores op's
    q_out = next((n for r, n in m.ops if r == "q_scale"), None)
    k_out = next((n for r, n in m.ops if r in _K_SIDE), None)
    wanted = {"q": f"{q_out}.dx" if q_out else f"{roles['qk']}.da",
              "k": f"{k_out}.dx" if k_out else f"{roles['qk']}.db",
              "v": f"{roles['av']}.d{v_port}"}
    if m.bias is not None:  # the add's reduce_to of a broadcast bias, else the add's output gradient (passed on)
        add = roles["bias"]
        port = "b" if g.ops[add].input_map["a"] != m.bias else "a"
        after = [n for r, n in m.ops][[n for _, n in m.ops].index(add) + 1]
        wanted["bias"] = f"{add}.d{port}" if f"{add}.d{port}" in backward else f"{after}.dx"
        if wanted["bias"] in backward and not _read_outside(g, wanted["bias"], backward):
            del wanted["bias"]  # a bias without a gradient (a mask): its add's output gradient stays inside
    grads = tuple((x, n) for x, n in wanted.items() if n in backward)
    dp = f"{roles['av']}.d{p_port}"
    if dp not in g.ops:
        if any(x in ("q", "k") for x, _ in grads):
            return f"the backward of {roles['av']} has no {dp} (the probabilities' gradient)"
        dy_op = wanted["v"]
        dy = g.ops[dy_op].input_map["b" if v_port == "a" else "a"] if dy_op in g.ops else None
    else:
        dy = g.ops[dp].input_map[p_port]
    if dy is None:
        return "the pattern's backward computes no gradient of q, k or v"
    kept = {n for _, n in grads}
    for n in backward:
        if n in kept:
            continue
        for r, _ in g.consumers.get(g.ops[n].output, []):
            if r not in backward:
                return f"{g.ops[n].output} (backward of the pattern) is read by {r} outside it"
        if g.tensors[g.ops[n].output].role == "output":
            return f"{g.ops[n].output} (backward of the pattern) is a graph output"
    if dy in {g.ops[n].output for n in backward}:
        return f"the output gradient {dy} is computed inside the pattern's backward"
    return dataclasses.replace(m, backward=tuple(backward), grads=grads, dy=dy)


def _read_outside(g: Graph, op: str, inside: list[str]) -> bool:
    """Whether ``op``'s output is a graph output or read by an op outside ``inside``."""
    out = g.ops[op].output
    return g.tensors[out].role == "output" or any(r not in inside for r, _ in g.consumers.get(out, []))


def _is_k_layout(letters: str, lead: str, t: str, e: str) -> bool:
    nk = len(letters) - 2
    return nk >= 0 and letters[-2:] == t + e and letters[:nk] == lead[:nk]


def _params(m: AttentionMatch, origin: dict | None) -> dict:
    return {"scale": m.scale, "causal": m.causal, "offset": m.offset, "origin": origin}


def attention_name(m: AttentionMatch) -> str:
    roles = dict(m.ops)
    return f"{roles['qk']}+{roles['av']}"


def fuse_attention(g: Graph, op: str) -> Graph:
    """Replace the attention pattern whose scores op is ``op`` by one ``attention`` op; in a
    training step its backward ops too, by ``attention_grad_*`` ops placed whole (a backward op
    whose reduction is split, such as a context-parallel plan's key gradients, is merged first:
    it writes the partials of its sum, not the gradient)."""
    get_op(g, op)
    m = match_attention(g, op)
    if isinstance(m, str):
        raise RewriteError(f"cannot fuse attention at {op}: {m}")
    from ir.rewrites.recompute import SUFFIX, is_copy

    # its records would name what unrecompute drops (a copy, or a copy's output that the backward
    # reads), so unshard could not undo it
    copies = [n for _, n in m.ops if is_copy(g.ops, n)]
    copies += [g.producers[t] for n in m.backward for _, t in g.ops[n].inputs
               if g.producers.get(t, "").endswith(SUFFIX)]
    if copies:
        raise RewriteError(f"cannot fuse attention at {op}: {copies[0]} is a recomputed copy (recompute{{...}}) the "
                           f"pattern or its backward reads; fuse the forward's attention first, then recompute it")
    split = [n for n in m.backward if g.ops[n].params.get("split")]
    if split:  # a split op writes the partials of its sum, not the gradient: merged first (the fused
        # gradient ops are placed whole, as the rest of the pattern's backward)
        g = _merged(g, split, f"cannot fuse attention at {op}")
        m = match_attention(g, op)
        if isinstance(m, str):
            raise RewriteError(f"cannot fuse attention at {op}: {m}")
    name = attention_name(m)
    if name in g.ops:
        raise RewriteError(f"cannot fuse attention at {op}: an operation named {name} exists")
    records = []
    for role, n in m.ops:
        x = g.ops[n]
        records.append({"role": role, "op": n, "kernel": x.kernel, "params": dict(x.params),
                        "inputs": [[p, t] for p, t in x.inputs], "output": x.output})
    av = g.ops[dict(m.ops)["av"]]
    sh = av.shards
    n_idx = sh.ndim - 1
    ev = g.tensors[av.output].shape[-1]
    if np.all(sh.lo[:, -1] == 0) and np.all(sh.hi[:, -1] == ev):
        shards = Shards(sh.lo[:, :n_idx], sh.hi[:, :n_idx], sh.device)
    else:
        shards = Shards.whole(g.tensors[av.output].shape[:-1], int(sh.device[0]))
    origin: dict = {"ops": records}
    drop: dict[str, Op | None] = {n: None for _, n in m.ops}
    gone = {g.ops[n].output: None for _, n in m.ops if n != av.name}
    insert: dict[str, list[Op]] = {}
    tensors: dict[str, Tensor | None] = dict(gone)
    k_in = m.k  # the tensor the attention reads as k: m.k, or its relayout
    bias_in = (("bias", m.bias),) if m.bias else ()
    back: dict = {}  # the params of the kept relayout's inverse (dk back to k's layout)
    if m.k_relayout is not None:  # one relayout of k stays, to [*Lk, t, e] (named after the attention op)
        rel = f"{name}.k"
        k_in = f"{rel}.out"
        if rel in g.ops or k_in in g.tensors or f"{name}.dk_t" in g.ops or f"{name}.dk.out" in g.tensors:
            raise RewriteError(f"cannot fuse attention at {op}: an operation or tensor named {rel}, {k_in}, "
                               f"{name}.dk_t or {name}.dk.out exists")
        kernel, arg = m.k_relayout
        ks = g.tensors[m.k]
        params, shape, back = _relayout(kernel, arg, ks.shape)
        tensors[k_in] = Tensor(k_in, shape, ks.dtype, "intermediate")
        origin[_KEPT_ORIGIN[kernel]] = list(arg)
        # in place of the outermost absorbed relayout (it reads k, or a scale of it, so comes after k)
        outer = next(n for r, n in m.ops if r in K_RELAYOUTS)
        drop[outer] = Op(rel, kernel, (("x", m.k),), k_in, params,
                         _whole(kernel, params, ks.spec, int(shards.device[0])))
    if m.backward:  # a training step: the backward recomputes the scores too (attention_grad_*)
        origin["backward"] = [_record(g.ops[n], "backward") for n in m.backward]
        origin["grads"] = [list(x) for x in m.grads]
        p = {k: v for k, v in _params(m, None).items() if k != "origin"}
        q_spec = g.tensors[m.q]
        lse_name = f"{name}.dlse"
        if lse_name in g.ops or f"{lse_name}.out" in g.tensors:
            raise RewriteError(f"cannot fuse attention at {op}: an operation named {lse_name} exists")
        tensors[f"{lse_name}.out"] = Tensor(f"{lse_name}.out", q_spec.shape[:-1], q_spec.dtype, "intermediate")
        dev = int(shards.device[0])
        lse_op = Op(lse_name, "attention_lse", (("q", m.q), ("k", k_in)) + bias_in, f"{lse_name}.out", p,
                    Shards.whole(q_spec.shape[:-1], dev))
        grad_ops = [lse_op]
        rows = {"q": m.q, "k": k_in, "v": m.v, "o": m.output, "dy": m.dy, "lse": f"{lse_name}.out",
                **({"bias": m.bias} if m.bias else {})}
        for x, n in m.grads:
            kernel = f"attention_grad_{x}"
            ports = get_kernel(kernel).inputs
            ins = tuple((pt, rows[pt]) for pt in ports if pt in rows)  # a bias only where the pattern has one
            sig = get_kernel(kernel).signature({pt: (tensors[t] or g.tensors[t]).spec if t in tensors
                                                else g.tensors[t].spec for pt, t in ins}, p)
            out = g.ops[n].output
            if x == "k" and m.k_relayout is not None:  # dk in the relayout, brought back to k's layout
                out = f"{name}.dk.out"
                tensors[out] = Tensor(out, sig.out_spec.shape, sig.out_spec.dtype, "intermediate")
            grad_ops.append(Op(f"{name}.d{x}", kernel, ins, out, p, Shards.whole(sig.extents, dev)))
            if out != g.ops[n].output:
                grad_ops.append(Op(f"{name}.dk_t", m.k_relayout[0], (("x", out),), g.ops[n].output, back,
                                   _whole(m.k_relayout[0], back, sig.out_spec, dev)))
        kept = {g.ops[n].output for _, n in m.grads}
        first = m.backward[0]
        for n in m.backward:
            drop[n] = None
            if g.ops[n].output not in kept:
                tensors[g.ops[n].output] = None
        drop[first] = grad_ops[0]
        insert[first] = grad_ops[1:]
    new = Op(name, "attention", (("q", m.q), ("k", k_in), ("v", m.v)) + bias_in, m.output, _params(m, origin),
             shards)
    drop[av.name] = new
    return g.with_ops(drop, insert_after=insert, tensors=tensors)


def _merged(g: Graph, ops: list[str], what: str) -> Graph:
    """``g`` with the split reductions of ``ops`` merged back (``merge_reduction``)."""
    from ir.rewrites.reduction import merge_reduction

    for n in ops:
        try:
            g = merge_reduction(g, n)
        except RewriteError as e:
            raise RewriteError(f"{what}: the reduction of {n} is split and does not merge back ({e})") from None
    return g


def _record(o: Op, role: str) -> dict:
    return {"role": role, "op": o.name, "kernel": o.kernel, "params": dict(o.params),
            "inputs": [[p, t] for p, t in o.inputs], "output": o.output}


def unfuse_attention(g: Graph, op: str) -> Graph:
    """Restore the ops a ``fuse_attention`` replaced (the attention op's ``origin``)."""
    o = get_op(g, op)
    if o.kernel != "attention":
        raise RewriteError(f"{op} is not an attention op")
    origin = o.params.get("origin")
    if not origin:
        raise RewriteError(f"{op} was written as attention (no origin to restore)")
    if o.params.get("split"):
        raise RewriteError(f"{op}: its key reduction is split (merge_reduction first)")
    split = [n for n, x in g.ops.items() if n.startswith(f"{op}.d") and x.kernel.startswith("attention_grad_")
             and x.params.get("split")]
    if split:  # the records restore unsplit gradient ops (placed whole): the split ones merged first
        g = _merged(g, split, f"cannot unfuse {op}")
    kept = _origin_relayout(origin)
    if kept is not None:  # the relayouts of k fuse_attention added go; fused away, they could not
        for n in (f"{op}.k", f"{op}.dk_t") if origin.get("backward") else (f"{op}.k",):
            if g.ops.get(n) is None or g.ops[n].kernel != kept[0]:
                raise RewriteError(f"cannot unfuse {op}: its relayout {kept[0]} {n} is gone (fused into another op? "
                                   f"unfuse it first)")
    records = origin["ops"]
    for r in records:
        if r["op"] != op and r["op"] in g.ops:
            raise RewriteError(f"cannot unfuse {op}: an operation named {r['op']} exists")
        if r["role"] != "av" and r["output"] in g.tensors:
            raise RewriteError(f"cannot unfuse {op}: a tensor named {r['output']} exists")
    try:
        key = tuple([g.tensors.get(t) for t in _read_by(o)])
    except (KeyError, TypeError, ValueError):  # malformed records: _restored raises as it always did
        key = None
    hit = _RESTORED.get(o)
    if key is None or hit is None or hit[0] != key:
        hit = _RESTORED[o] = (key, _restored(g, o))
    new_ops, bwd, new_tensors = hit[1]
    first, rest = new_ops[0], new_ops[1:]
    replace: dict[str, Op | None] = {op: first}
    insert = {op: rest}
    if kept is not None:  # the relayout of k the fused graph kept (and its gradient's)
        replace[f"{op}.k"] = None
        replace[f"{op}.dk_t"] = None
    if bwd:
        lse = f"{op}.dlse"
        grad_ops = [n for n in g.ops if n == lse or (n.startswith(f"{op}.d") and g.ops[n].kernel.startswith(
            "attention_grad_"))]
        for n in grad_ops:
            replace[n] = None
        replace[lse] = bwd[0]
        insert[lse] = bwd[1:]
    return g.with_ops(replace, insert_after=insert, tensors=dict(new_tensors))


#: attention op -> (the tensors its records and itself read, what ``_restored`` makes of them): the
#: plans of a search share their ops, and the restored ops keep their memos from call to call
_RESTORED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _read_by(o: Op) -> list[str]:
    """The tensors that attention op ``o`` and the records in its ``origin`` read."""
    origin = o.params["origin"]
    return [t for rs in (origin["ops"], origin.get("backward") or ()) for r in rs for _, t in r["inputs"]] \
        + [t for _, t in o.inputs]


def _restored(g: Graph, o: Op) -> tuple[list[Op], list[Op], dict[str, Tensor | None]]:
    """``unfuse_attention``'s forward ops, backward ops (empty in a forward program) and tensor edits:
    what ``o`` and the tensors it and its records read decide."""
    origin = o.params["origin"]
    records = origin["ops"]
    made: dict[str, Any] = {}  # specs of the tensors the records make (the others: the graph's)

    def spec(t: str) -> Any:
        return made[t] if t in made else g.tensors[t].spec

    sh = o.shards
    new_tensors: dict[str, Tensor | None] = {}
    new_ops: list[Op] = []
    for r in records:
        inputs = tuple((p, t) for p, t in r["inputs"])
        sig = get_kernel(r["kernel"]).signature({p: spec(t) for p, t in inputs}, r["params"])
        if r["role"] != "av":
            made[r["output"]] = sig.out_spec
            new_tensors[r["output"]] = Tensor(r["output"], sig.out_spec.shape, sig.out_spec.dtype, "intermediate")
        n = sh.ndim
        if r["role"] in _K_SIDE or tuple(sig.extents[:n]) != tuple(g.signature(o).extents):
            shards = Shards.whole(sig.extents, int(sh.device[0]))
        else:
            extra = np.array(sig.extents[n:], np.int64)
            lo = np.concatenate([sh.lo, np.zeros((len(sh), extra.size), np.int64)], axis=1)
            hi = np.concatenate([sh.hi, np.tile(extra, (len(sh), 1))], axis=1)
            shards = Shards(lo, hi, sh.device)
        new_ops.append(Op(r["op"], r["kernel"], inputs, r["output"], dict(r["params"]), shards))
    relayout = _origin_relayout(origin) is not None
    if relayout:
        new_tensors[f"{o.name}.k.out"] = None
    bwd: list[Op] = []
    if origin.get("backward"):
        kept = {dict(origin["grads"])[x] for x in dict(origin["grads"])}
        new_tensors[f"{o.name}.dlse.out"] = None
        if relayout:
            new_tensors[f"{o.name}.dk.out"] = None
        for r in origin["backward"]:
            inputs = tuple((p, t) for p, t in r["inputs"])
            sig = get_kernel(r["kernel"]).signature({p: spec(t) for p, t in inputs}, r["params"])
            made[r["output"]] = sig.out_spec
            if r["op"] not in kept:
                new_tensors[r["output"]] = Tensor(r["output"], sig.out_spec.shape, sig.out_spec.dtype, "intermediate")
            bwd.append(Op(r["op"], r["kernel"], inputs, r["output"], dict(r["params"]),
                          Shards.whole(sig.extents, int(sh.device[0]))))
    return new_ops, bwd, new_tensors


def attention_sites(g: Graph) -> list[str]:
    """Scores ops where ``fuse_attention`` applies (the search's candidates)."""
    out = []
    for n, o in g.ops.items():
        if o.kernel in ("einsum", "matmul", "bmm") and not isinstance(match_attention(g, n), str):
            out.append(n)
    return out


def fused_attentions(g: Graph) -> list[str]:
    """Attention ops that ``unfuse_attention`` can restore."""
    return [n for n, o in g.ops.items() if o.kernel == "attention" and o.params.get("origin")
            and not o.params.get("split")]


def substitution_summary(g: Graph) -> dict[str, int]:
    """Counts of substituted ops in a plan (``attention``: patterns replaced by fused attention) and
    of patterns still unfused (``attention_sites``): what a campaign summary reports."""
    fused = sum(1 for o in g.ops.values() if o.kernel == "attention" and o.params.get("origin"))
    return {"attention": fused, "attention_sites": len(attention_sites(g))}
