"""Fused attention (the FlashAttention recurrence) and the combine of its split key reduction.

``attention(q, k, v)``::

    y[*L, s, :] = Σ_t softmax_t(scale · q[*L, s, :] · k[*Lk, t, :] + mask[s, t]) · v[*Lk, t, :]

Shapes: ``q[*L, s, e]``, ``k[*Lk, t, e]``, ``v[*Lk, t, ev]`` with ``Lk`` a prefix of ``L``: the
usual ``q[b, h, s, e]`` / ``k[b, h, t, e]``, or grouped-query attention written as
``q[b, kvh, g, s, e]`` with ``k[b, kvh, t, e]`` (the extra dims of ``q`` broadcast over ``k``/``v``).
Params: ``scale``; ``causal`` with ``offset``: query row ``i`` sees key ``j`` iff
``j <= i + offset`` (absolute positions: the rows and key blocks a shard covers come from its
index box, so ``run`` is overridden); ``origin``: the unfused ops a substitution replaced
(``ir.rewrites.substitute_attention`` restores them), ``None`` for an attention written as such.

``bias`` (optional): an additive bias on the scores, ``softmax(scale · q·kᵀ + bias + mask)``: T5's
relative-position bias ``[1, h, s, t]``, ALiBi ``[b·h, 1, t]``, a padding mask ``[b, 1, 1, t]``. Its
dims broadcast onto the scores ``[*L, s, t]`` as NumPy's do (right-aligned, each dim the scores'
size or 1, leading dims may be missing), except its key dim, which must be ``t``: a bias constant
over the keys cancels in the softmax (refused rather than read for nothing). As xformers'
``attn_bias``: the kernel reads the bias tile of its rows and keys from HBM (bytes ∝ s·t per bias
head, what the projection says) and still never writes the probabilities.

Index space: the leading dims of ``q`` and its query rows (``b, h[, g], s``). The key dim ``t``
hides in the projections of ``k``, ``v`` and ``bias`` and is the splittable reduction, with the softmax
monoid: ``split_reduction`` gives a partial op writing ``p[kb, *L, s, ev + 1]`` (per key block,
the block-normalised output and its log-sum-exp) and an ``attention_combine`` op that merges the
partials. The pair (o_k / l_k, m_k + log l_k) carries exactly the (running max m, sum of exponents
l, weighted sum o) triple of the online softmax: ``lse = log Σ_k exp(lse_k)`` and
``y = Σ_k exp(lse_k − lse) · o_k`` is associative with identity (0, −inf), which is what
FlashAttention-2's and ring attention's block combines compute (Dao 2023, §3.1; Liu et al. 2023).
One extra channel instead of two, and no unnormalised sums to overflow in 16-bit storage.

Cost (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with
IO-Awareness", Alg. 1 and Thm 2). FLOPs per query row: ``2·t·e`` (scores) + ``2·t·ev`` (P·V) +
``5·t`` (scale, max, exp, sum, divide: the same count as the unfused softmax kernel) [+ ``t``: the
bias add], times the
fraction of keys a causal row sees (the whole index space's mean, so totals are exact; shards of
early rows are charged a little more than they do, late rows a little less). Bytes: Thm 2 counts
``Θ(N²·d²/M)`` HBM accesses for on-chip memory ``M``; once a head's K and V fit in the cache that
serves the re-reads (``N·d ≤ M``: 1 MiB per head at N = 2048, d = 128 in bfloat16, against 50 MiB
of L2 on an H100), this is ``Θ(N·d)``: each shard reads its q rows and its heads' k and v once and
writes its output rows. That is what the projections below say, so the cost model's byte count
(projected boxes) is the FlashAttention count, and no ``s × t`` tensor exists anywhere.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ir.kernels.base import (Kernel, Reduction, Signature, SignatureError, TensorSpec, split_signature, unit_row,
                             zero_row)
from ir.zspace import Projection, ZRange

SOFTMAX_MONOID = "softmax"  # the (max, sum of exp, weighted sum) monoid of attention's key reduction
COMBINE_KERNEL = "attention_combine"  # combines the partials of a split attention (see ``split_reduction``)
KEY_BLOCK = 512  # keys per step of the online-softmax loop (B_c of Alg. 1): bounds the s × B_c scratch
SOFTMAX_FLOPS = 5.0  # per score: as the ``softmax`` kernel counts them
_LEAD_NAMES = {0: (), 1: ("b",), 2: ("b", "h"), 3: ("b", "h", "g")}


def lead_dim_names(n: int) -> tuple[str, ...]:
    return _LEAD_NAMES.get(n, tuple(f"d{i}" for i in range(n)))


def visible_keys(s: int, t: int, causal: bool, offset: int) -> int:
    """Number of (query, key) pairs the mask lets through: query i sees keys j <= i + offset."""
    if not causal:
        return s * t
    rows = np.clip(np.arange(s, dtype=np.int64) + offset + 1, 0, t)
    return int(rows.sum())


def _proj(cols: tuple[int | None, ...], sizes: tuple[int, ...], n: int) -> Projection:
    """A projection reading one cell along index column ``cols[i]`` per point, or where None the whole dim."""
    return Projection(tuple(unit_row(n, c) if c is not None else zero_row(n) for c in cols), (0,) * len(cols),
                      tuple(1 if c is not None else z for c, z in zip(cols, sizes)))


def bias_cols(bias: tuple[int, ...], scores: tuple[int, ...]) -> tuple[int | None, ...]:
    """For each dim of ``bias``, the dim of the scores ``[*L, s, t]`` it runs along, None where it
    broadcasts (size 1 against a larger dim); or ``SignatureError`` saying why it is not a bias."""
    off = len(scores) - len(bias)
    if off < 0 or any(z not in (1, x) for z, x in zip(bias, scores[off:])):
        raise SignatureError(f"attention bias{list(bias)} must broadcast onto the scores [*L, s, t] = {list(scores)}: "
                             f"right-aligned, each dim the scores' size or 1")
    if bias[-1] != scores[-1]:
        raise SignatureError(f"attention bias{list(bias)} must run along the keys (last dim {scores[-1]}): a bias "
                             f"constant over the keys cancels in the softmax")
    return tuple(c + off if z == scores[c + off] else None for c, z in enumerate(bias))


def bias_projection(bias: tuple[int, ...], scores: tuple[int, ...], index: dict[int, int], n: int) -> Projection:
    """The bias box a point reads: along the scores dims in ``index`` (scores dim -> index column) one
    cell, unless the bias broadcasts there; the whole bias dim along the others (hidden or broadcast)."""
    return _proj(tuple(index.get(c) if c is not None else None for c in bias_cols(bias, scores)), bias, n)


def bias_flops(ins: Mapping[str, TensorSpec]) -> float:
    """One add per score when the op reads a bias."""
    return 1.0 if "bias" in ins else 0.0


def attention_shapes(ins: Mapping[str, TensorSpec]) -> tuple[tuple[int, ...], int, int, int, int, int]:
    """``(L, len(Lk), s, e, t, ev)`` of attention inputs, or ``SignatureError`` naming the mismatch."""
    q, k, v = ins["q"].shape, ins["k"].shape, ins["v"].shape
    if len(q) < 2 or len(k) < 2 or len(v) != len(k) or len(k) > len(q):
        raise SignatureError(f"attention needs q[*L, s, e], k[*Lk, t, e], v[*Lk, t, ev] with Lk a prefix of L; "
                             f"got q{list(q)}, k{list(k)}, v{list(v)}")
    lead, nk = q[:-2], len(k) - 2
    if tuple(k[:-2]) != tuple(lead[:nk]) or tuple(v[:-2]) != tuple(lead[:nk]):
        raise SignatureError(f"attention k{list(k)} and v{list(v)} must lead with q's leading dims {list(lead[:nk])}")
    if k[-1] != q[-1]:
        raise SignatureError(f"attention q and k must share the head dim e: q{list(q)}, k{list(k)}")
    if v[-2] != k[-2]:
        raise SignatureError(f"attention k and v must have the same key length t: k{list(k)}, v{list(v)}")
    return tuple(lead), nk, q[-2], q[-1], k[-2], v[-1]


class Attention(Kernel):
    """``softmax(scale · q kᵀ [+ causal mask]) v`` without materialising the scores (see module doc)."""

    name = "attention"
    inputs = ("q", "k", "v", "bias")
    optional_inputs = ("bias",)
    # tensor-core bound like a GEMM (FlashAttention-2 reaches 50-73 % of peak); its own subclass
    # because NumPy runs it as scores, softmax and a second product (costmodel.hardware: a
    # hardware without a "matmul.attention" entry charges it as "matmul")
    kernel_class = "matmul.attention"
    params_defaults = {"scale": 1.0, "causal": False, "offset": 0, "origin": None}

    def base_signature(self, ins, params):
        lead, nk, s, e, t, ev = attention_shapes(ins)
        if not isinstance(params["causal"], bool) or not isinstance(params["offset"], int):
            raise SignatureError(f"attention causal must be true/false and offset an integer; got "
                                 f"{params['causal']!r}, {params['offset']!r}")
        if not isinstance(params["scale"], (int, float)) or isinstance(params["scale"], bool):
            raise SignatureError(f"attention scale must be a number, got {params['scale']!r}")
        n = len(lead) + 1  # index dims: *L, s
        q_rows = [unit_row(n, c) for c in range(n)] + [zero_row(n)]
        kv_rows = [unit_row(n, c) for c in range(nk)] + [zero_row(n), zero_row(n)]
        inputs = {
            "q": Projection(tuple(q_rows), (0,) * (n + 1), (1,) * n + (e,)),
            "k": Projection(tuple(kv_rows), (0,) * (nk + 2), (1,) * nk + (t, e)),
            "v": Projection(tuple(kv_rows), (0,) * (nk + 2), (1,) * nk + (t, ev)),
        }
        spans = (("k", nk), ("v", nk))
        if "bias" in ins:
            scores = lead + (s, t)
            inputs["bias"] = bias_projection(ins["bias"].shape, scores, {c: c for c in range(n)}, n)
            spans += (("bias", len(ins["bias"].shape) - 1),)
        out = Projection(tuple(q_rows), (0,) * (n + 1), (1,) * n + (ev,))
        seen = visible_keys(s, t, params["causal"], params["offset"]) / s
        flops = seen * (2.0 * e + 2.0 * ev + SOFTMAX_FLOPS + bias_flops(ins))
        red = Reduction("t", t, SOFTMAX_MONOID, spans)
        return Signature(lead_dim_names(len(lead)) + ("s",), lead + (s,), inputs, out,
                         TensorSpec(lead + (s, ev), ins["q"].dtype), flops, (red,))

    def signature(self, ins, params):
        split = params.get("split")
        sig = super().signature(ins, {k: v for k, v in params.items() if k != "split"})
        if not split:
            return sig
        part = split_signature(sig, split)
        # The partial carries one more channel: the block's log-sum-exp beside its normalised output.
        o = part.output
        out = Projection(o.A, o.b, o.s[:-1] + (o.s[-1] + 1,))
        shape = part.out_spec.shape
        return Signature(part.dims, part.extents, part.inputs, out,
                         TensorSpec(shape[:-1] + (shape[-1] + 1,), part.out_spec.dtype),
                         part.flops_per_point, (), part.in_specs, part.split_from)

    def compute(self, xp, blocks, params):
        if params["causal"]:
            raise SignatureError("causal attention needs its index box (absolute query rows): call run()")
        o, _ = flash_forward(xp, blocks["q"], blocks["k"], blocks["v"], params["scale"], False, 0, 0, 0,
                             bias=blocks.get("bias"))
        return o.astype(blocks["q"].dtype)

    def run(self, xp: Any, blocks: Mapping[str, Any], params: Mapping[str, Any], box: ZRange,
            sig: Signature) -> Any:
        q, k, v, bias = blocks["q"], blocks["k"], blocks["v"], blocks.get("bias")
        q0 = box.start[-1]  # absolute position of the block's first query row
        split = params.get("split")
        if not split:
            o, _ = flash_forward(xp, q, k, v, params["scale"], params["causal"], q0, 0, params["offset"], bias=bias)
            return o.astype(q.dtype)
        chunk = sig.split_from.extent // split["parts"]
        parts = []
        for j in range(box.start[0], box.end[0]):
            local = slice((j - box.start[0]) * chunk, (j - box.start[0] + 1) * chunk)
            kj, vj = k[..., local, :], v[..., local, :]
            o, lse = flash_forward(xp, q, kj, vj, params["scale"], params["causal"], q0, j * chunk,
                                   params["offset"], bias=None if bias is None else bias[..., local])
            parts.append(xp.concatenate([o, lse[..., None]], axis=-1).astype(q.dtype))
        return xp.stack(parts, axis=0)


def _broadcast_kv(x: Any, q_rank: int) -> Any:
    """``k[*Lk, t, e]`` viewed as ``[*Lk, 1.., t, e]`` so it broadcasts over q's extra (group) dims."""
    extra = q_rank - x.ndim
    return x.reshape(x.shape[:-2] + (1,) * extra + x.shape[-2:]) if extra else x


def flash_forward(xp: Any, q: Any, k: Any, v: Any, scale: float, causal: bool, q0: int, k0: int, offset: int,
                  block: int = KEY_BLOCK, bias: Any = None) -> tuple[Any, Any]:
    """Online-softmax attention over key blocks (Dao et al. 2022, Alg. 1, lines 9-12).

    ``q0``/``k0`` are the absolute positions of the first query row and key; ``bias`` (or None)
    broadcasts onto the scores of these rows and keys. Returns the
    normalised output ``o[*L, s, ev]`` and the log-sum-exp ``lse[*L, s]`` of the scaled (masked)
    scores, both in float32 or wider; rows that see no key give ``o = 0`` and ``lse = -inf``.
    """
    f32 = xp.promote_types(q.dtype, xp.float32)  # 16-bit inputs accumulate in float32, as on GPUs
    qs = q.astype(f32) * f32.type(scale)
    k, v = _broadcast_kv(k.astype(f32), q.ndim), _broadcast_kv(v.astype(f32), q.ndim)
    s, t = q.shape[-2], k.shape[-2]
    lead = tuple(q.shape[:-2])
    m = xp.full(lead + (s,), -xp.inf, dtype=f32)
    l = xp.zeros(lead + (s,), dtype=f32)  # noqa: E741  (the paper's name)
    acc = xp.zeros(lead + (s, v.shape[-1]), dtype=f32)
    rows = q0 + xp.arange(s)
    for j in range(0, t, block):
        kb, vb = k[..., j:j + block, :], v[..., j:j + block, :]
        S = qs @ xp.swapaxes(kb, -1, -2)
        if bias is not None:
            S = S + bias[..., j:j + block].astype(f32)
        if causal:
            cols = k0 + j + xp.arange(kb.shape[-2])
            visible = cols[None, :] <= rows[:, None] + offset
            if not bool(visible.any()):
                continue
            S = xp.where(visible, S, -xp.inf)
        m_new = xp.maximum(m, S.max(axis=-1))
        m_safe = xp.where(xp.isfinite(m_new), m_new, f32.type(0))  # a row that saw nothing yet stays at -inf
        P = xp.exp(S - m_safe[..., None])
        corr = xp.exp(m - m_safe)
        l = l * corr + P.sum(axis=-1)  # noqa: E741
        acc = acc * corr[..., None] + P @ vb
        m = m_new
    seen = l > 0
    l_safe = xp.where(seen, l, f32.type(1))
    o = acc / l_safe[..., None]
    lse = xp.where(seen, m + xp.log(l_safe), -xp.inf)
    return o, lse


def combine_partials(xp: Any, p: Any) -> Any:
    """``y`` from partials ``p[kb, ..., ev + 1]`` = (block-normalised output, block log-sum-exp)."""
    ct = xp.promote_types(p.dtype, xp.float32)
    p32 = p.astype(ct)
    o, lse = p32[..., :-1], p32[..., -1]
    top = lse.max(axis=0)
    top = xp.where(xp.isfinite(top), top, ct.type(0))
    w = xp.exp(lse - top)  # blocks that saw no key weigh 0
    den = w.sum(axis=0)
    y = (w[..., None] * o).sum(axis=0) / xp.where(den > 0, den, ct.type(1))[..., None]
    return y.astype(p.dtype)


class AttentionCombine(Kernel):
    """``y[*M, ev]`` from split-attention partials ``p[kb, *M, ev + 1]`` (the softmax monoid)."""

    name = COMBINE_KERNEL
    inputs = ("p",)
    kernel_class = "elementwise"

    def base_signature(self, ins, params):
        shape = ins["p"].shape
        if len(shape) < 3 or shape[-1] < 2:
            raise SignatureError(f"{COMBINE_KERNEL} needs partials p[kb, ..., ev + 1] of rank >= 3 with a last dim "
                                 f">= 2 (output channels plus the log-sum-exp), got {list(shape)}")
        mid, ev, parts = shape[1:-1], shape[-1] - 1, shape[0]
        n = len(mid)
        rows = (zero_row(n),) + tuple(unit_row(n, c) for c in range(n)) + (zero_row(n),)
        out_rows = tuple(unit_row(n, c) for c in range(n)) + (zero_row(n),)
        return Signature(tuple(f"d{i}" for i in range(n)), mid,
                         {"p": Projection(rows, (0,) * len(shape), (parts,) + (1,) * n + (ev + 1,))},
                         Projection(out_rows, (0,) * (n + 1), (1,) * n + (ev,)),
                         TensorSpec(mid + (ev,), ins["p"].dtype), 3.0 * parts * (ev + 1))

    def compute(self, xp, blocks, params):
        return combine_partials(xp, blocks["p"])


# -- backward: recompute the scores, never store them (Dao et al. 2022, Alg. 4 and App. B.4) ------------
#
# ``attention_lse`` recomputes each query row's log-sum-exp L = m + log l (FlashAttention keeps it
# from the forward; here the forward writes only its output, so the backward pays one more
# q·kᵀ); then P = exp(scale·q·kᵀ [+ bias] − L) block by block, D = rowsum(dy ∘ o),
# dS = P ∘ (dy·vᵀ − D) and
#
#     dq = scale · dS · k    (index: query rows, like the forward),
#     dk = scale · dSᵀ · q   (index: key rows; sums over query rows and groups),
#     dv = Pᵀ · dy           (index: key rows),
#     dbias = dS summed over the dims the bias broadcasts along (index: the bias's cells).
#
# Each takes the forward's bias (optional, as the forward's) to recompute P. dk and dv declare the
# query rows a splittable ``sum`` reduction, dq the keys: their partial sums over query or key blocks
# are sequence-parallel (ring) attention's backward. dbias declares none (the dims it sums are the
# broadcast ones, not one named reduction): a plan shards it over the bias's own dims.


class _GradBase(Kernel):
    kernel_class = "matmul"
    params_defaults = {"scale": 1.0, "causal": False, "offset": 0}
    optional_inputs = ("bias",)

    def _shapes(self, ins):
        """Forward shapes; a kernel without a ``v`` port takes ``ev`` from ``dy`` (or ``e``)."""
        v = ins.get("v")
        if v is None:
            ev = ins["dy"].shape[-1] if "dy" in ins else ins["k"].shape[-1]
            v = TensorSpec(tuple(ins["k"].shape[:-1]) + (ev,), ins["k"].dtype)
        return attention_shapes({"q": ins["q"], "k": ins["k"], "v": v})

    @staticmethod
    def _row_bias(ins: Mapping[str, TensorSpec], lead: tuple[int, ...], s: int, t: int) -> dict[str, Projection]:
        """The bias projection of a kernel indexed like the forward (``*L, s``), if it reads a bias."""
        if "bias" not in ins:
            return {}
        n = len(lead) + 1
        return {"bias": bias_projection(ins["bias"].shape, lead + (s, t), {c: c for c in range(n)}, n)}

    def _check_rows(self, ins, lead, s, ev):
        for port, want in (("o", lead + (s, ev)), ("dy", lead + (s, ev)), ("lse", lead + (s,))):
            if port in ins and tuple(ins[port].shape) != want:
                raise SignatureError(f"{self.name} input {port!r} must have shape {list(want)} (from q and v), "
                                     f"got {list(ins[port].shape)}")


class AttentionLse(_GradBase):
    """``L[*L, s] = log Σ_t exp(scale · q·kᵀ + mask)``: each query row's log-sum-exp."""

    name = "attention_lse"
    inputs = ("q", "k", "bias")

    def base_signature(self, ins, params):
        lead, nk, s, e, t, _ = self._shapes(ins)
        n = len(lead) + 1
        rows = tuple(unit_row(n, c) for c in range(n))
        kv = tuple(unit_row(n, c) for c in range(nk)) + (zero_row(n), zero_row(n))
        seen = visible_keys(s, t, params["causal"], params["offset"]) / s
        return Signature(lead_dim_names(len(lead)) + ("s",), lead + (s,),
                         {"q": Projection(rows + (zero_row(n),), (0,) * (n + 1), (1,) * n + (e,)),
                          "k": Projection(kv, (0,) * (nk + 2), (1,) * nk + (t, e)), **self._row_bias(ins, lead, s, t)},
                         Projection(rows, (0,) * n, (1,) * n), TensorSpec(lead + (s,), ins["q"].dtype),
                         seen * (2.0 * e + 3.0 + bias_flops(ins)))

    def run(self, xp, blocks, params, box, sig):
        q, k = blocks["q"], blocks["k"]
        v = xp.zeros(k.shape[:-1] + (1,), dtype=k.dtype)  # the loop's P·v is one column: negligible
        _, lse = flash_forward(xp, q, k, v, params["scale"], params["causal"], box.start[-1], 0, params["offset"],
                               bias=blocks.get("bias"))
        return lse.astype(q.dtype)

    def compute(self, xp, blocks, params):
        raise SignatureError("attention_lse needs its index box (absolute query rows): call run()")


def _probs(xp: Any, q: Any, k: Any, lse: Any, scale: float, causal: bool, q0: int, k0: int, offset: int,
           bias: Any = None) -> Any:
    """``P = exp(scale·q·kᵀ [+ bias] − L)`` (masked) for these query rows and keys; rows seeing no key give 0."""
    ct = xp.promote_types(q.dtype, xp.float32)
    S = (q.astype(ct) * ct.type(scale)) @ xp.swapaxes(_broadcast_kv(k.astype(ct), q.ndim), -1, -2)
    if bias is not None:
        S = S + bias.astype(ct)
    if causal:
        rows = q0 + xp.arange(q.shape[-2])
        cols = k0 + xp.arange(k.shape[-2])
        S = xp.where(cols[None, :] <= rows[:, None] + offset, S, -xp.inf)
    lse = lse.astype(ct)
    return xp.exp(S - xp.where(xp.isfinite(lse), lse, ct.type(0))[..., None])


def _block_probs(xp: Any, b: Mapping[str, Any], params: Mapping[str, Any], q0: int, k0: int) -> Any:
    """``P`` of blocks ``b`` (``q``, ``k``, ``lse``, optional ``bias``) whose first row and key are ``q0``, ``k0``."""
    return _probs(xp, b["q"], b["k"], b["lse"], params["scale"], params["causal"], q0, k0, params["offset"],
                  b.get("bias"))


def _block_dS(xp: Any, b: Mapping[str, Any], params: Mapping[str, Any], q0: int, k0: int) -> Any:
    """``dS = P ∘ (dy·vᵀ − rowsum(dy ∘ o))``: the gradient of the (biased, masked) scaled scores."""
    P = _block_probs(xp, b, params, q0, k0)
    ct = P.dtype
    dy = b["dy"].astype(ct)
    D = (dy * b["o"].astype(ct)).sum(axis=-1)
    return P * (dy @ xp.swapaxes(_broadcast_kv(b["v"].astype(ct), b["q"].ndim), -1, -2) - D[..., None])


def _sum_groups(x: Any, nk: int, n_lead: int) -> Any:
    """Sum q's extra (group) dims ``nk .. n_lead-1`` out of ``x[*L, ...]``."""
    return x.sum(axis=tuple(range(nk, n_lead))) if n_lead > nk else x


class AttentionGradQ(_GradBase):
    """``dq = scale · (P ∘ (dy·vᵀ − rowsum(dy ∘ o))) · k`` over query rows."""

    name = "attention_grad_q"
    inputs = ("q", "k", "v", "o", "dy", "lse", "bias")

    def base_signature(self, ins, params):
        lead, nk, s, e, t, ev = attention_shapes(ins)
        self._check_rows(ins, lead, s, ev)
        n = len(lead) + 1
        rows = tuple(unit_row(n, c) for c in range(n))
        kv = tuple(unit_row(n, c) for c in range(nk)) + (zero_row(n), zero_row(n))
        zb = (0,) * (n + 1)
        seen = visible_keys(s, t, params["causal"], params["offset"]) / s
        return Signature(lead_dim_names(len(lead)) + ("s",), lead + (s,),
                         {"q": Projection(rows + (zero_row(n),), zb, (1,) * n + (e,)),
                          "k": Projection(kv, (0,) * (nk + 2), (1,) * nk + (t, e)),
                          "v": Projection(kv, (0,) * (nk + 2), (1,) * nk + (t, ev)),
                          "o": Projection(rows + (zero_row(n),), zb, (1,) * n + (ev,)),
                          "dy": Projection(rows + (zero_row(n),), zb, (1,) * n + (ev,)),
                          "lse": Projection(rows, (0,) * n, (1,) * n), **self._row_bias(ins, lead, s, t)},
                         Projection(rows + (zero_row(n),), zb, (1,) * n + (e,)),
                         TensorSpec(lead + (s, e), ins["q"].dtype),
                         seen * (4.0 * e + 2.0 * ev + 5.0 + bias_flops(ins)) + 2.0 * ev,
                         (Reduction("t", t, "sum", (("k", nk), ("v", nk))
                                    + ((("bias", len(ins["bias"].shape) - 1),) if "bias" in ins else ())),))

    def run(self, xp, blocks, params, box, sig):
        q0 = box.start[-1]
        split = params.get("split")
        if not split:
            return self._grad(xp, blocks, params, q0, 0).astype(blocks["q"].dtype)
        # dq sums over keys given each row's log-sum-exp: key blocks are partial sums (ring backward).
        chunk = sig.split_from.extent // split["parts"]
        parts = []
        for j in range(box.start[0], box.end[0]):
            local = slice((j - box.start[0]) * chunk, (j - box.start[0] + 1) * chunk)
            sub = {**blocks, "k": blocks["k"][..., local, :], "v": blocks["v"][..., local, :]}
            if "bias" in blocks:
                sub["bias"] = blocks["bias"][..., local]
            parts.append(self._grad(xp, sub, params, q0, j * chunk).astype(blocks["q"].dtype))
        return xp.stack(parts, axis=0)

    def _grad(self, xp, b, params, q0, k0):
        dS = _block_dS(xp, b, params, q0, k0)
        ct = dS.dtype
        return ct.type(params["scale"]) * (dS @ _broadcast_kv(b["k"].astype(ct), b["q"].ndim))

    def compute(self, xp, blocks, params):
        raise SignatureError("attention_grad_q needs its index box (absolute query rows): call run()")


class _GradKV(_GradBase):
    """Shared signature of ``attention_grad_k`` / ``_v``: index over key rows, query rows hidden."""

    out_port: str  # "k" or "v": the gradient's shape follows this input

    def base_signature(self, ins, params):
        lead, nk, s, e, t, ev = self._shapes(ins)
        self._check_rows(ins, lead, s, ev)
        nL = len(lead)
        n = nk + 1  # index dims: *Lk, t
        lk = tuple(unit_row(n, c) for c in range(nk))
        groups = tuple(zero_row(n) for _ in range(nL - nk))
        g_ext = tuple(lead[nk:])

        def q_like(last: int) -> Projection:  # [*L, s, last]: all groups and query rows of these heads
            return Projection(lk + groups + (zero_row(n), zero_row(n)), (0,) * (nL + 2),
                              (1,) * nk + g_ext + (s, last))

        def key_rows(last: int) -> Projection:  # [*Lk, t, last]: these key rows
            return Projection(lk + (unit_row(n, nk), zero_row(n)), (0,) * (nk + 2), (1,) * (nk + 1) + (last,))

        inputs = {"q": q_like(e), "k": key_rows(e), "v": key_rows(ev), "o": q_like(ev), "dy": q_like(ev),
                  "lse": Projection(lk + groups + (zero_row(n),), (0,) * (nL + 1), (1,) * nk + g_ext + (s,))}
        spans = [(p, nL) for p in ("q", "o", "dy", "lse") if p in self.inputs]
        if "bias" in ins:  # all query rows and groups of these heads, these keys
            bias = ins["bias"].shape
            inputs["bias"] = bias_projection(bias, lead + (s, t), {**{c: c for c in range(nk)}, nL + 1: nk}, n)
            if len(bias) >= 2 and bias[-2] == s:  # a bias broadcast over the query rows is read whole by every block
                spans.append(("bias", len(bias) - 2))
        inputs = {p: inputs[p] for p in self.inputs if p in inputs}
        width = e if self.out_port == "k" else ev
        per_pair = (4.0 * e + 2.0 * ev + 5.0) if self.out_port == "k" else (2.0 * e + 2.0 * ev + 3.0)
        seen = visible_keys(s, t, params["causal"], params["offset"]) / t * float(np.prod(g_ext, dtype=np.int64))
        per_pair += bias_flops(ins)
        red = Reduction("s", s, "sum", tuple(spans))
        return Signature(lead_dim_names(nk) + ("t",), tuple(lead[:nk]) + (t,), inputs, key_rows(width),
                         TensorSpec(tuple(lead[:nk]) + (t, width), ins["q"].dtype), seen * per_pair, (red,))

    def run(self, xp, blocks, params, box, sig):
        split = params.get("split")
        k0 = box.start[-1]
        if not split:
            return self._grad(xp, blocks, params, 0, k0).astype(blocks["q"].dtype)
        chunk = sig.split_from.extent // split["parts"]
        spans = dict(sig.split_from.spans)
        parts = []
        for j in range(box.start[0], box.end[0]):
            local = slice((j - box.start[0]) * chunk, (j - box.start[0] + 1) * chunk)
            sub = {}
            for port, arr in blocks.items():
                if port in spans:
                    idx = [slice(None)] * arr.ndim
                    idx[spans[port]] = local
                    arr = arr[tuple(idx)]
                sub[port] = arr
            parts.append(self._grad(xp, sub, params, j * chunk, k0).astype(blocks["q"].dtype))
        return xp.stack(parts, axis=0)

    def compute(self, xp, blocks, params):
        raise SignatureError(f"{self.name} needs its index box (absolute key rows): call run()")


class AttentionGradK(_GradKV):
    """``dk = scale · Σ_(groups, s) dSᵀ · q`` over key rows."""

    name = "attention_grad_k"
    inputs = ("q", "k", "v", "o", "dy", "lse", "bias")
    out_port = "k"

    def _grad(self, xp, b, params, q0, k0):
        dS = _block_dS(xp, b, params, q0, k0)
        ct = dS.dtype
        dk = ct.type(params["scale"]) * (xp.swapaxes(dS, -1, -2) @ b["q"].astype(ct))
        return _sum_groups(dk, b["k"].ndim - 2, b["q"].ndim - 2)


class AttentionGradV(_GradKV):
    """``dv = Σ_(groups, s) Pᵀ · dy`` over key rows."""

    name = "attention_grad_v"
    inputs = ("q", "k", "dy", "lse", "bias")
    out_port = "v"

    def _grad(self, xp, b, params, q0, k0):
        P = _block_probs(xp, b, params, q0, k0)
        dv = xp.swapaxes(P, -1, -2) @ b["dy"].astype(P.dtype)
        return _sum_groups(dv, b["k"].ndim - 2, b["q"].ndim - 2)


class AttentionGradBias(_GradBase):
    """``dbias = dS`` summed over the dims the bias broadcasts along: index space = the bias's shape,
    each point reading the query rows, keys and heads its cell's scores cover."""

    name = "attention_grad_bias"
    inputs = ("q", "k", "v", "o", "dy", "lse", "bias")
    optional_inputs = ()

    def base_signature(self, ins, params):
        lead, nk, s, e, t, ev = attention_shapes(ins)
        self._check_rows(ins, lead, s, ev)
        bias = tuple(ins["bias"].shape)
        scores = lead + (s, t)
        cols = bias_cols(bias, scores)
        n = len(bias)
        at = {c: i for i, c in enumerate(cols) if c is not None}  # scores dim -> index column
        nL = len(lead)
        q_cols = tuple(at.get(c) for c in range(nL + 1))  # [*L, s]
        k_cols = tuple(at.get(c) for c in range(nk)) + (at.get(nL + 1),)  # [*Lk, t]
        inputs = {"q": _proj(q_cols + (None,), tuple(ins["q"].shape), n),
                  "k": _proj(k_cols + (None,), tuple(ins["k"].shape), n),
                  "v": _proj(k_cols + (None,), tuple(ins["v"].shape), n),
                  "o": _proj(q_cols + (None,), tuple(ins["o"].shape), n),
                  "dy": _proj(q_cols + (None,), tuple(ins["dy"].shape), n),
                  "lse": _proj(q_cols, tuple(ins["lse"].shape), n),
                  "bias": _proj(tuple(range(n)), bias, n)}
        per_score = 2.0 * e + 2.0 * ev + 7.0  # P (with the bias add and exp), dy·vᵀ, the difference and product
        scores_per_cell = float(np.prod(scores, dtype=np.int64)) / float(np.prod(bias, dtype=np.int64))
        seen = visible_keys(s, t, params["causal"], params["offset"]) / (s * t)
        return Signature(tuple(f"d{i}" for i in range(n)), bias, inputs, _proj(tuple(range(n)), bias, n),
                         TensorSpec(bias, ins["q"].dtype), seen * scores_per_cell * per_score)

    def run(self, xp, blocks, params, box, sig):
        bias = sig.in_specs["bias"].shape
        rows, keys = len(bias) - 2, len(bias) - 1  # the bias dims along s and t
        q0 = box.start[rows] if rows >= 0 and bias[rows] > 1 else 0  # broadcast over s: the block holds every row
        dS = _block_dS(xp, blocks, params, q0, box.start[keys])
        return _sum_to(dS, blocks["bias"].shape).astype(blocks["q"].dtype)

    def compute(self, xp, blocks, params):
        raise SignatureError("attention_grad_bias needs its index box (absolute rows and keys): call run()")


def _sum_to(x: Any, shape: tuple[int, ...]) -> Any:
    """``x`` summed down to ``shape`` (right-aligned broadcasting's adjoint)."""
    extra = x.ndim - len(shape)
    if extra:
        x = x.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, z in enumerate(shape) if z == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


KERNELS = (Attention, AttentionCombine, AttentionLse, AttentionGradQ, AttentionGradK, AttentionGradV,
           AttentionGradBias)
