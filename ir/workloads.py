"""Built-in workloads: ``build(name, **params)`` for ``mlp``, ``transformer``, ``convnet``, and the
model families ``gpt``, ``llama`` and ``deepseek`` (with named size presets).

Every workload takes ``mode`` (``forward``, or ``train``: one training step from
``ir.autodiff.training_step``) and, for training, ``optimizer`` (``sgd`` or ``adamw``). The loss
is ``mse`` against a ``target`` for mlp/transformer/convnet and token cross-entropy against
``labels`` for the language models.

Operation names are deterministic (``fc1``, ``act1``, ``attn_qk``, ``conv1``, ``l3.attn_qk``, ...),
so plans, configs and tests can refer to them; in gpt/llama/deepseek every layer ``i`` prefixes its ops
with ``l<i>.`` and its parameters with ``l<i>_``.
"""

from __future__ import annotations

import inspect
import numbers
import math
from typing import Any, Callable, Sequence

from ir.autodiff import OPTIMIZERS, AutodiffError, training_step
from ir.builder import GraphBuilder
from ir.graph import Graph
from ir.model_presets import PRESETS
from ir.zspace import MAX_DIM

MAX_CAPACITY_FACTOR = 8.0  # an expert's buffer at most this many times its balanced share


class WorkloadError(ValueError):
    """Unknown workload or parameter, or parameters that make no program."""


def mlp(batch: int = 8, widths: Sequence[int] = (64, 256, 64), activation: str = "relu",
        dtype: str = "float32") -> Graph:
    """``x[batch, w0] → fc1 → act1 → fc2 → … → fcN``: linear layers with activations between."""
    widths = [int(w) for w in widths]
    if len(widths) < 2:
        raise WorkloadError("mlp widths needs at least two entries (input and output width)")
    if activation not in ("relu", "gelu", "tanh"):
        raise WorkloadError(f"mlp activation {activation!r} must be relu, gelu or tanh")
    b = GraphBuilder(dtype)
    h = b.input("x", (batch, widths[0]))
    for i, (fi, fo) in enumerate(zip(widths[:-1], widths[1:]), start=1):
        h = b.linear(h, b.parameter(f"W{i}", (fi, fo)), b.parameter(f"b{i}", (fo,)), name=f"fc{i}")
        if i < len(widths) - 1:
            h = b.op(activation, f"act{i}", {"x": h})
    return b.build()


def transformer(batch: int = 2, seq: int = 16, d_model: int = 32, heads: int = 4, d_ff: int = 64,
                dtype: str = "float32") -> Graph:
    """One pre-norm transformer block (attention + feed-forward, residual adds)."""
    if d_model % heads:
        raise WorkloadError(f"transformer d_model {d_model} must be divisible by heads {heads}")
    dh = d_model // heads
    b = GraphBuilder(dtype)
    x = b.input("x", (batch, seq, d_model))
    ln1 = b.layernorm(x, b.parameter("ln1_g", (d_model,)), b.parameter("ln1_b", (d_model,)), name="ln1")
    proj = {}
    for n in ("q", "k", "v"):
        proj[n] = b.einsum(ln1, b.parameter(f"W{n}", (d_model, heads, dh)), name=f"{n}_proj",
                           equation="bsd,dhe->bhse")
    kt = b.permute(proj["k"], name="k_t", perm=[0, 1, 3, 2])
    scores = b.bmm(proj["q"], kt, name="attn_qk", alpha=1.0 / math.sqrt(dh))
    probs = b.softmax(scores, name="attn_softmax")
    ctx = b.bmm(probs, proj["v"], name="attn_av")
    o = b.einsum(ctx, b.parameter("Wo", (heads, dh, d_model)), name="o_proj", equation="bhse,hed->bsd")
    r1 = b.add(x, o, name="resid1")
    ln2 = b.layernorm(r1, b.parameter("ln2_g", (d_model,)), b.parameter("ln2_b", (d_model,)), name="ln2")
    f1 = b.linear(ln2, b.parameter("W1", (d_model, d_ff)), b.parameter("b1", (d_ff,)), name="ff1")
    a = b.gelu(f1, name="ff_act")
    f2 = b.linear(a, b.parameter("W2", (d_ff, d_model)), b.parameter("b2", (d_model,)), name="ff2")
    b.add(r1, f2, name="resid2")
    return b.build()


def convnet(batch: int = 2, channels: Sequence[int] | int = (3, 8, 8), size: int = 16, layers: int | None = None,
            classes: int = 10, dtype: str = "float32") -> Graph:
    """``conv{i}`` (3×3, padding 1) + ``relu{i}`` layers, a sum pool, and a linear head ``fc``."""
    if isinstance(channels, int):
        channels = [3] + [channels] * (layers or 2)
    channels = [int(c) for c in channels]
    if layers is not None and len(channels) != layers + 1:
        raise WorkloadError(f"convnet channels {channels} must list layers+1 = {layers + 1} entries: set channels "
                            f"with layers (channels=[3,8,...]), or channels=N for {layers} layers of N channels")
    b = GraphBuilder(dtype)
    h = b.input("x", (batch, channels[0], size, size))
    for i, (ci, co) in enumerate(zip(channels[:-1], channels[1:]), start=1):
        h = b.conv2d(h, b.parameter(f"w{i}", (co, ci, 3, 3)), name=f"conv{i}", padding=1)
        h = b.relu(h, name=f"relu{i}")
    h = b.reduce_sum(h, name="pool_w", dim=3)
    h = b.reduce_sum(h, name="pool_h", dim=2)
    b.linear(h, b.parameter("Wfc", (channels[-1], classes)), b.parameter("bfc", (classes,)), name="fc")
    return b.build()


def _attention(b: GraphBuilder, h: str, pre: str, ppre: str, d_model: int, heads: int, kv_heads: int,
               rope: bool) -> str:
    """Causal self-attention with grouped-query heads written as einsums over ``[b, kvh, g, s, e]``
    (``g = heads / kv_heads`` query heads share each key/value head; ``kv_heads == heads`` is
    ordinary multi-head attention), so no reshape op is needed."""
    dh = d_model // heads
    grp = heads // kv_heads
    q = b.einsum(h, b.parameter(f"{ppre}Wq", (d_model, kv_heads, grp, dh)), name=f"{pre}q_proj",
                 equation="bsd,dkge->bkgse")
    k = b.einsum(h, b.parameter(f"{ppre}Wk", (d_model, kv_heads, dh)), name=f"{pre}k_proj", equation="bsd,dke->bkse")
    v = b.einsum(h, b.parameter(f"{ppre}Wv", (d_model, kv_heads, dh)), name=f"{pre}v_proj", equation="bsd,dke->bkse")
    if rope:
        q = b.rope(q, name=f"{pre}q_rope")
        k = b.rope(k, name=f"{pre}k_rope")
    s = b.einsum(q, k, name=f"{pre}attn_qk", equation="bkgse,bkte->bkgst", alpha=1.0 / math.sqrt(dh))
    s = b.causal_mask(s, name=f"{pre}attn_mask")
    p = b.softmax(s, name=f"{pre}attn_softmax")
    ctx = b.einsum(p, v, name=f"{pre}attn_av", equation="bkgst,bkte->bkgse")
    return b.einsum(ctx, b.parameter(f"{ppre}Wo", (kv_heads, grp, dh, d_model)), name=f"{pre}o_proj",
                    equation="bkgse,kged->bsd")


def _check_lm(layers: int, d_model: int, heads: int, kv_heads: int, d_ff: int, vocab: int, seq: int,
              batch: int) -> None:
    for k, v in dict(layers=layers, d_model=d_model, heads=heads, kv_heads=kv_heads, d_ff=d_ff, vocab=vocab,
                     seq=seq, batch=batch).items():
        if not isinstance(v, int) or v < 1:
            raise WorkloadError(f"{k} must be a positive integer, got {v!r}")
    if d_model % heads:
        raise WorkloadError(f"d_model {d_model} must be divisible by heads {heads}")
    if heads % kv_heads:
        raise WorkloadError(f"heads {heads} must be a multiple of kv_heads {kv_heads} (grouped-query attention)")


def gpt(layers: int = 2, d_model: int = 32, heads: int = 4, kv_heads: int | None = None, d_ff: int | None = None,
        vocab: int = 64, seq: int = 16, batch: int = 2, tied: bool = True, dtype: str = "float32") -> Graph:
    """GPT-2-style decoder (Radford et al. 2019): token + learned position embeddings, pre-LN blocks
    with causal attention and a GELU MLP, final LN, LM head tied to the token embedding (or not).

    Attention projections have no biases (the MLP's linears do); positions are ``0 .. seq-1``, so
    the position table is ``[seq, d_model]``.
    """
    kv_heads = kv_heads or heads
    d_ff = d_ff or 4 * d_model
    _check_lm(layers, d_model, heads, kv_heads, d_ff, vocab, seq, batch)
    b = GraphBuilder(dtype)
    ids = b.input("ids", (batch, seq), "int32")
    wte = b.parameter("wte", (vocab, d_model))
    h = b.embedding(wte, ids, name="tok_emb")
    h = b.add(h, b.parameter("wpe", (seq, d_model)), name="pos_add")
    for i in range(layers):
        pre, pp = f"l{i}.", f"l{i}_"
        x = b.layernorm(h, b.parameter(f"{pp}ln1_g", (d_model,)), b.parameter(f"{pp}ln1_b", (d_model,)),
                        name=f"{pre}ln1")
        h = b.add(h, _attention(b, x, pre, pp, d_model, heads, kv_heads, rope=False), name=f"{pre}resid1")
        x = b.layernorm(h, b.parameter(f"{pp}ln2_g", (d_model,)), b.parameter(f"{pp}ln2_b", (d_model,)),
                        name=f"{pre}ln2")
        x = b.linear(x, b.parameter(f"{pp}W1", (d_model, d_ff)), b.parameter(f"{pp}b1", (d_ff,)), name=f"{pre}ff1")
        x = b.gelu(x, name=f"{pre}ff_act")
        x = b.linear(x, b.parameter(f"{pp}W2", (d_ff, d_model)), b.parameter(f"{pp}b2", (d_model,)),
                     name=f"{pre}ff2")
        h = b.add(h, x, name=f"{pre}resid2")
    h = b.layernorm(h, b.parameter("lnf_g", (d_model,)), b.parameter("lnf_b", (d_model,)), name="lnf")
    if tied:
        b.einsum(h, wte, name="lm_head", equation="bsd,vd->bsv")
    else:
        b.einsum(h, b.parameter("W_head", (d_model, vocab)), name="lm_head", equation="bsd,dv->bsv")
    return b.build()


def _swiglu(b: GraphBuilder, x: str, pre: str, pp: str, d_model: int, d_ff: int) -> str:
    """Llama's SwiGLU MLP: ``W_down (silu(x W_gate) * x W_up)``."""
    gate = b.einsum(x, b.parameter(f"{pp}W_gate", (d_model, d_ff)), name=f"{pre}ff_gate", equation="bsd,df->bsf")
    up = b.einsum(x, b.parameter(f"{pp}W_up", (d_model, d_ff)), name=f"{pre}ff_up", equation="bsd,df->bsf")
    x = b.mul(b.silu(gate, name=f"{pre}ff_act"), up, name=f"{pre}ff_glu")
    return b.einsum(x, b.parameter(f"{pp}W_down", (d_ff, d_model)), name=f"{pre}ff_down", equation="bsf,fd->bsd")


def _moe(b: GraphBuilder, x: str, pre: str, pp: str, d_model: int, d_ff: int, experts: int, top_k: int,
         batch: int, seq: int, capacity_factor: float = 1.0, gates: str = "softmax", scale: float = 1.0,
         shared_d_ff: int = 0) -> str:
    """A Mixtral-style mixture of SwiGLU experts (Jiang et al. 2024, "Mixtral of Experts", §2.1)
    with *balanced routing*: token ``s``'s ``j``-th choice (``j < top_k``) is expert
    ``(s·top_k + j) mod experts``, the assignment of a perfectly balanced router (every expert gets
    ``batch·seq·top_k / experts`` tokens, capacity factor 1). The gates are Mixtral's: the softmax
    of the router's logits over the token's chosen experts. Data-dependent top-k routing has no
    affine projection, so the choice is fixed; what a plan pays for it is exact: the dispatch and
    combine are layout ops (``expand``, ``reshape``, ``permute``), so an expert-parallel layout
    (the experts' dim split over devices) turns them into all-to-all exchanges, and each expert's
    GEMMs see its share of the tokens.

    Shapes: ``x[b, s, d]`` -> copies ``[b, s, k, d]`` -> ``[b, c, e, d]`` (``c = s·k/e``: the
    row-major order puts copy ``(s, j)`` on expert ``(s·k + j) mod e``) -> ``[e, b, c, d]``
    (dispatch) -> the experts' SwiGLU with weights ``[e, d, f]`` -> back to ``[b, s, k, d]`` ->
    the gate-weighted sum over ``k``. The router's weight ``[d, e]`` is read per expert on the
    dispatched tokens (``ebcd,de->ebc``), the logit of each chosen expert.

    ``capacity_factor`` (GShard, Lepikhin et al. 2020, §2.2; Switch, Fedus et al. 2022, §2.2): each
    expert's buffer holds ``ceil(capacity_factor · c)`` token slots per sequence, the ones past
    ``c`` zero padding (``moe_capacity``, a ``pad`` before the dispatch, cropped after the
    combine): the experts' GEMMs and both all-to-alls carry the whole buffer, as a capacity-based
    implementation does, and as a dropless one pays for its busiest expert (capacity factor =
    the busiest expert's load over the mean). 1 (the default) adds no op.

    DeepSeekMoE (DeepSeek-V3 report §2.1.2, eqs. 12-16; ``deepseek``) changes three things, each
    off by default (the defaults build Mixtral's layer op for op): ``gates="sigmoid"``: the
    sigmoid of each chosen expert's logit, renormalised over the token's chosen experts
    (``moe_scores``, ``moe_score_sum``, ``moe_score_sums``, ``moe_gates``); ``scale``: the gates
    times DeepSeek's ``routed_scaling_factor`` (the ``alpha`` of ``moe_mix``; the released
    configs' and HF's router's, not in the report's equations); ``shared_d_ff``: a
    dense SwiGLU of that width on every token (``shared_ff_*``, weights ``shared_W_*``; DeepSeek's
    ``n_shared_experts · moe_intermediate_size``), added ungated to the routed output
    (``moe_shared_add``)."""
    c = seq * top_k // experts
    cap = math.ceil(capacity_factor * c - 1e-9)  # slots per expert and sequence (1e-9: 1.25·8 is 10)
    xk = b.expand(x, name=f"{pre}moe_copies", dim=2, size=top_k)
    xe = b.reshape(xk, name=f"{pre}moe_slots", shape=[batch, c, experts, d_model],
                   **{"from": [batch, seq, top_k, d_model]})
    if cap > c:
        xe = b.pad(xe, name=f"{pre}moe_capacity", axis=1, after=cap - c)
    xe = b.permute(xe, name=f"{pre}moe_dispatch", perm=[2, 0, 1, 3])
    logits = b.einsum(xe, b.parameter(f"{pp}W_router", (d_model, experts)), name=f"{pre}moe_router",
                      equation="ebcd,de->ebc")
    if cap > c:  # the padding slots' logits are dropped before the gates
        logits = b.pad(logits, name=f"{pre}moe_router_crop", axis=2, after=c - cap)
    logits = b.permute(logits, name=f"{pre}moe_router_t", perm=[1, 2, 0])
    logits = b.reshape(logits, name=f"{pre}moe_router_k", shape=[batch, seq, top_k], **{"from": [batch, c, experts]})
    if gates == "softmax":
        gates = b.softmax(logits, name=f"{pre}moe_gates")
    elif gates == "sigmoid":  # sigmoid scores renormalised over the chosen experts (eqs. 13-15)
        scores = b.sigmoid(logits, name=f"{pre}moe_scores")
        total = b.reduce_sum(scores, name=f"{pre}moe_score_sum", dim=2)
        total = b.expand(total, name=f"{pre}moe_score_sums", dim=2, size=top_k)
        gates = b.div(scores, total, name=f"{pre}moe_gates")
    else:
        raise WorkloadError(f"mixture-of-experts gates {gates!r} must be softmax or sigmoid")
    gate = b.einsum(xe, b.parameter(f"{pp}W_gate", (experts, d_model, d_ff)), name=f"{pre}ff_gate",
                    equation="ebcd,edf->ebcf")
    up = b.einsum(xe, b.parameter(f"{pp}W_up", (experts, d_model, d_ff)), name=f"{pre}ff_up",
                  equation="ebcd,edf->ebcf")
    y = b.mul(b.silu(gate, name=f"{pre}ff_act"), up, name=f"{pre}ff_glu")
    y = b.einsum(y, b.parameter(f"{pp}W_down", (experts, d_ff, d_model)), name=f"{pre}ff_down",
                 equation="ebcf,efd->ebcd")
    y = b.permute(y, name=f"{pre}moe_combine", perm=[1, 2, 0, 3])
    if cap > c:
        y = b.pad(y, name=f"{pre}moe_crop", axis=1, after=c - cap)
    y = b.reshape(y, name=f"{pre}moe_unslot", shape=[batch, seq, top_k, d_model],
                  **{"from": [batch, c, experts, d_model]})
    # the routed scaling rides on the combine (no op, no param when 1: Mixtral's graph is unchanged)
    alpha = {"alpha": float(scale)} if scale != 1 else {}
    mix = b.einsum(gates, y, name=f"{pre}moe_mix", equation="bsk,bskd->bsd", **alpha)
    if shared_d_ff:
        mix = b.add(mix, _swiglu(b, x, f"{pre}shared_", f"{pp}shared_", d_model, shared_d_ff),
                    name=f"{pre}moe_shared_add")
    return mix


def _check_experts(experts: int, top_k: int, seq: int, capacity_factor: float) -> None:
    """``WorkloadError`` unless ``_moe``'s balanced routing exists for these sizes."""
    if not 1 <= top_k <= experts:
        raise WorkloadError(f"top_k {top_k} must be between 1 and experts {experts} (each token's experts)")
    if (seq * top_k) % experts:
        raise WorkloadError(f"seq * top_k = {seq * top_k} must be a multiple of experts {experts} (balanced "
                            f"routing gives every expert as many tokens); change seq or top_k")
    if not (isinstance(capacity_factor, (int, float)) and 1 <= capacity_factor <= MAX_CAPACITY_FACTOR):
        raise WorkloadError(f"capacity_factor {capacity_factor!r} must be a number from 1 to "
                            f"{MAX_CAPACITY_FACTOR:g} (each expert's buffer over its balanced share of the "
                            f"tokens; below 1 would drop tokens, which balanced routing never needs)")


def llama(layers: int = 2, d_model: int = 32, heads: int = 4, kv_heads: int | None = None, d_ff: int | None = None,
          vocab: int = 64, seq: int = 16, batch: int = 2, rope: bool = True, experts: int | None = None,
          top_k: int = 2, capacity_factor: float = 1.0, dtype: str = "float32") -> Graph:
    """Llama-style decoder (Touvron et al. 2023): RMSNorm, causal attention with grouped-query heads
    and rotary position embeddings (exact: ``rope`` kernel, rotate-half pairing), SwiGLU MLP, untied
    head; no biases. With ``experts`` (Mixtral), each MLP is a mixture of that many SwiGLU experts,
    ``top_k`` per token, balanced routing (``_moe``): ``seq·top_k`` must be a multiple of ``experts``;
    each expert's buffer holds ``capacity_factor`` (at least 1) times its tokens."""
    kv_heads = kv_heads or heads
    d_ff = d_ff or 4 * d_model
    _check_lm(layers, d_model, heads, kv_heads, d_ff, vocab, seq, batch)
    if (d_model // heads) % 2:
        raise WorkloadError(f"llama needs an even head dimension for rotary embeddings, got {d_model // heads}")
    if experts is not None:
        _check_experts(experts, top_k, seq, capacity_factor)
    elif capacity_factor != 1.0:
        raise WorkloadError(f"capacity_factor {capacity_factor!r} needs experts (a mixture of experts per MLP); "
                            f"set experts or drop capacity_factor")
    b = GraphBuilder(dtype)
    h = b.embedding(b.parameter("tok_emb", (vocab, d_model)), b.input("ids", (batch, seq), "int32"), name="tok_emb")
    for i in range(layers):
        pre, pp = f"l{i}.", f"l{i}_"
        x = b.rmsnorm(h, b.parameter(f"{pp}attn_norm", (d_model,)), name=f"{pre}attn_norm")
        h = b.add(h, _attention(b, x, pre, pp, d_model, heads, kv_heads, rope=rope), name=f"{pre}resid1")
        x = b.rmsnorm(h, b.parameter(f"{pp}ffn_norm", (d_model,)), name=f"{pre}ffn_norm")
        if experts is None:
            x = _swiglu(b, x, pre, pp, d_model, d_ff)
        else:
            x = _moe(b, x, pre, pp, d_model, d_ff, experts, top_k, batch, seq, capacity_factor)
        h = b.add(h, x, name=f"{pre}resid2")
    h = b.rmsnorm(h, b.parameter("final_norm", (d_model,)), name="final_norm")
    b.einsum(h, b.parameter("W_head", (d_model, vocab)), name="lm_head", equation="bsd,dv->bsv")
    return b.build()


def _mla(b: GraphBuilder, h: str, pre: str, pp: str, d_model: int, heads: int, q_lora_rank: int | None,
         kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int) -> str:
    """DeepSeek's multi-head latent attention (DeepSeek-V3 report §2.1.1, eqs. 1-11), causal, as
    einsums over ``[b, h, s, e]`` (no reshape op).

    Queries: ``x[b, s, d]`` -> ``q_a_proj`` (``[d, q_lora_rank]``) -> ``q_a_norm`` (RMSNorm) ->
    per-head nope and rope parts (``q_nope_proj``, ``q_rope_proj``: HF's ``q_b_proj`` with its output
    columns split in the two parts), or a plain projection from ``x`` when ``q_lora_rank`` is None;
    the rope part rotated. Keys and values: ``kv_a_proj`` (``[d, kv_lora_rank]``) -> ``kv_a_norm`` ->
    per-head nope keys and values (``k_nope_proj``, ``v_proj``: HF's ``kv_b_proj`` split); the
    decoupled rope key ``k_rope_proj`` (``[d, qk_rope_head_dim]``, HF's last columns of
    ``kv_a_proj_with_mqa``) is one per token, rotated and broadcast to every head (``k_rope_heads``).
    Query = ``[nope, rope]``, key = ``[nope, shared rope]`` (``q_cat``, ``k_cat``), scores scaled by
    ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, causal softmax, values, ``o_proj``
    (``[h, v_head_dim, d]``). Parameter counts equal HF's ``DeepseekV3Attention``'s (no biases)."""
    qk = qk_nope_head_dim + qk_rope_head_dim
    if q_lora_rank is None:
        cq, r_q, eq = h, d_model, "bsd,dhe->bhse"
    else:
        cq = b.einsum(h, b.parameter(f"{pp}Wq_a", (d_model, q_lora_rank)), name=f"{pre}q_a_proj",
                      equation="bsd,dr->bsr")
        cq = b.rmsnorm(cq, b.parameter(f"{pp}q_a_norm", (q_lora_rank,)), name=f"{pre}q_a_norm")
        r_q, eq = q_lora_rank, "bsr,rhe->bhse"
    q_nope = b.einsum(cq, b.parameter(f"{pp}Wq_nope", (r_q, heads, qk_nope_head_dim)), name=f"{pre}q_nope_proj",
                      equation=eq)
    q_rope = b.einsum(cq, b.parameter(f"{pp}Wq_rope", (r_q, heads, qk_rope_head_dim)), name=f"{pre}q_rope_proj",
                      equation=eq)
    q = b.concat(q_nope, b.rope(q_rope, name=f"{pre}q_rope"), name=f"{pre}q_cat", axis=3)
    ckv = b.einsum(h, b.parameter(f"{pp}Wkv_a", (d_model, kv_lora_rank)), name=f"{pre}kv_a_proj",
                   equation="bsd,dr->bsr")
    ckv = b.rmsnorm(ckv, b.parameter(f"{pp}kv_a_norm", (kv_lora_rank,)), name=f"{pre}kv_a_norm")
    k_rope = b.einsum(h, b.parameter(f"{pp}Wk_rope", (d_model, qk_rope_head_dim)), name=f"{pre}k_rope_proj",
                      equation="bsd,de->bse")
    k_rope = b.rope(k_rope, name=f"{pre}k_rope")  # [b, s, e]: one key per token, shared by the heads
    k_rope = b.expand(k_rope, name=f"{pre}k_rope_heads", dim=1, size=heads)
    k_nope = b.einsum(ckv, b.parameter(f"{pp}Wk_nope", (kv_lora_rank, heads, qk_nope_head_dim)),
                      name=f"{pre}k_nope_proj", equation="bsr,rhe->bhse")
    k = b.concat(k_nope, k_rope, name=f"{pre}k_cat", axis=3)
    v = b.einsum(ckv, b.parameter(f"{pp}Wv", (kv_lora_rank, heads, v_head_dim)), name=f"{pre}v_proj",
                 equation="bsr,rhe->bhse")
    s = b.einsum(q, k, name=f"{pre}attn_qk", equation="bhse,bhte->bhst", alpha=1.0 / math.sqrt(qk))
    s = b.causal_mask(s, name=f"{pre}attn_mask")
    p = b.softmax(s, name=f"{pre}attn_softmax")
    ctx = b.einsum(p, v, name=f"{pre}attn_av", equation="bhst,bhte->bhse")
    return b.einsum(ctx, b.parameter(f"{pp}Wo", (heads, v_head_dim, d_model)), name=f"{pre}o_proj",
                    equation="bhse,hed->bsd")


def deepseek(layers: int = 3, d_model: int = 32, heads: int = 4, q_lora_rank: int | None = 16, kv_lora_rank: int = 8,
             qk_nope_head_dim: int = 8, qk_rope_head_dim: int = 4, v_head_dim: int = 8, d_ff: int = 64,
             moe_d_ff: int = 16, experts: int = 4, top_k: int = 2, shared_experts: int = 1, first_k_dense: int = 1,
             routed_scaling_factor: float = 2.5, capacity_factor: float = 1.0, vocab: int = 64, seq: int = 16,
             batch: int = 2, dtype: str = "float32") -> Graph:
    """DeepSeek-V3's decoder (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §2.1; sizes in §4.2
    and the released ``config.json``; HF ``DeepseekV3ForCausalLM`` as the reference for shapes and
    arithmetic): token embedding, pre-RMSNorm layers of multi-head latent attention (``_mla``,
    §2.1.1) and an MLP, final RMSNorm, untied head; no biases.

    The first ``first_k_dense`` layers (HF ``first_k_dense_replace``) have a dense SwiGLU MLP of
    width ``d_ff``; the others a DeepSeekMoE layer (§2.1.2, ``_moe``): ``experts`` fine-grained
    routed SwiGLU experts of width ``moe_d_ff`` (HF ``n_routed_experts``,
    ``moe_intermediate_size``), ``top_k`` per token (``num_experts_per_tok``), gated by the sigmoid
    of the chosen experts' router logits renormalised over them (eq. 13, ``norm_topk_prob``) times
    ``routed_scaling_factor``, plus ``shared_experts`` shared experts as one dense SwiGLU of width
    ``shared_experts · moe_d_ff`` added ungated. Dense and MoE layers form two layer classes.

    What is not modelled: routing is *balanced* as in ``_moe`` (token ``s``'s ``j``-th choice is
    expert ``(s·top_k + j) mod experts``), so the learned top-k choice, its node-limited
    (group-limited) routing and the auxiliary-loss-free bias (§2.1.2, which only enter the choice)
    are replaced by an even load; ``seq·top_k`` must be a multiple of ``experts``. Multi-token
    prediction (§2.2, a training-only extra module of 14B parameters in the release) is left out:
    the loss is next-token cross-entropy of the main model. The router scores in the model's dtype
    (DeepSeek's in float32; HF adds 1e-20 to the renormalising sum, which a sum of sigmoids never
    needs). Rotary embeddings use the ``rope`` kernel's rotate-half pairing; HF's DeepSeek-V3
    pairs interleaved dims (``rope_interleave``), the same rotation up to a fixed permutation of
    the rope dims (of the weights that produce them), at the same cost. The softmax scale is
    ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``, pre-training's (the released config's YaRN
    ``mscale`` is the 128K context extension's, §4.3). ``capacity_factor`` pads each expert's
    buffer as in ``llama``.
    """
    for k, v in dict(layers=layers, d_model=d_model, heads=heads, kv_lora_rank=kv_lora_rank,
                     qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
                     d_ff=d_ff, moe_d_ff=moe_d_ff, experts=experts, top_k=top_k, vocab=vocab, seq=seq,
                     batch=batch, **({} if q_lora_rank is None else {"q_lora_rank": q_lora_rank})).items():
        if not isinstance(v, int) or v < 1:
            raise WorkloadError(f"{k} must be a positive integer, got {v!r}")
    for k, v in dict(first_k_dense=first_k_dense, shared_experts=shared_experts).items():
        if not isinstance(v, int) or v < 0:
            raise WorkloadError(f"{k} must be a whole number (0 or more), got {v!r}")
    if first_k_dense > layers:
        raise WorkloadError(f"first_k_dense {first_k_dense} must be at most layers {layers} (the first layers "
                            f"with a dense MLP); lower first_k_dense or raise layers")
    if qk_rope_head_dim % 2:
        raise WorkloadError(f"qk_rope_head_dim {qk_rope_head_dim} must be even (rotary embeddings rotate pairs of "
                            f"dims); set an even qk_rope_head_dim")
    if not (isinstance(routed_scaling_factor, (int, float)) and routed_scaling_factor > 0):
        raise WorkloadError(f"routed_scaling_factor {routed_scaling_factor!r} must be a positive number (the "
                            f"routed experts' gates are multiplied by it; DeepSeek-V3's is 2.5)")
    _check_experts(experts, top_k, seq, capacity_factor)
    b = GraphBuilder(dtype)
    h = b.embedding(b.parameter("tok_emb", (vocab, d_model)), b.input("ids", (batch, seq), "int32"), name="tok_emb")
    for i in range(layers):
        pre, pp = f"l{i}.", f"l{i}_"
        x = b.rmsnorm(h, b.parameter(f"{pp}attn_norm", (d_model,)), name=f"{pre}attn_norm")
        x = _mla(b, x, pre, pp, d_model, heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                 v_head_dim)
        h = b.add(h, x, name=f"{pre}resid1")
        x = b.rmsnorm(h, b.parameter(f"{pp}ffn_norm", (d_model,)), name=f"{pre}ffn_norm")
        if i < first_k_dense:
            x = _swiglu(b, x, pre, pp, d_model, d_ff)
        else:
            x = _moe(b, x, pre, pp, d_model, moe_d_ff, experts, top_k, batch, seq, capacity_factor, gates="sigmoid",
                     scale=routed_scaling_factor, shared_d_ff=shared_experts * moe_d_ff)
        h = b.add(h, x, name=f"{pre}resid2")
    h = b.rmsnorm(h, b.parameter("final_norm", (d_model,)), name="final_norm")
    b.einsum(h, b.parameter("W_head", (d_model, vocab)), name="lm_head", equation="bsd,dv->bsv")
    return b.build()


WORKLOADS: dict[str, Callable[..., Graph]] = {"mlp": mlp, "transformer": transformer, "convnet": convnet,
                                              "gpt": gpt, "llama": llama, "deepseek": deepseek}
LANGUAGE_MODELS = ("gpt", "llama", "deepseek")
# Counts that may be 0 (the type check takes other sizes from 1): (workload, parameter).
ZERO_COUNTS = {("deepseek", "first_k_dense"), ("deepseek", "shared_experts")}
MODES = ("forward", "train")
# Parameters every workload takes besides its own (``preset`` only the language models).
COMMON = {"mode": "forward", "optimizer": "adamw"}


def workload_params(name: str) -> dict[str, Any]:
    """The parameters of a workload and their defaults."""
    own = {k: p.default for k, p in inspect.signature(WORKLOADS[name]).parameters.items()}
    return {**own, **COMMON, **({"preset": None} if name in LANGUAGE_MODELS else {})}


def build(name: str, **params: Any) -> Graph:
    """Build a built-in workload; unknown names or parameters raise ``WorkloadError``.

    ``preset`` (gpt/llama/deepseek) fills the model's sizes from ``ir.model_presets`` (explicit parameters
    win, e.g. ``preset="llama2-7b", layers=2``); ``mode="train"`` returns one training step.
    """
    if name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r}; built-in workloads are {sorted(WORKLOADS)}")
    known = workload_params(name)
    for k in params:
        if k not in known:
            raise WorkloadError(f"workload {name!r} has no parameter {k!r}; its parameters are {sorted(known)}")
    params = dict(params)
    _check_types(name, params)
    mode, optimizer, preset = params.pop("mode", "forward"), params.pop("optimizer", "adamw"), params.pop("preset", None)
    if mode not in MODES:
        raise WorkloadError(f"workload mode {mode!r} must be one of {list(MODES)}")
    if optimizer not in OPTIMIZERS:
        raise WorkloadError(f"optimizer {optimizer!r} must be one of {sorted(OPTIMIZERS)}")
    if preset is not None:
        if preset not in PRESETS or PRESETS[preset].family != name:
            names = sorted(k for k, p in PRESETS.items() if p.family == name)
            raise WorkloadError(f"unknown {name} preset {preset!r}; {name} presets are {names}")
        params = {**PRESETS[preset].sizes(), **params}
    try:
        g = WORKLOADS[name](**params)
        if mode == "train":
            g = training_step(g, loss="cross_entropy" if name in LANGUAGE_MODELS else "mse", optimizer=optimizer)
        return g
    except WorkloadError:
        raise
    except (ValueError, TypeError, AutodiffError) as e:
        raise WorkloadError(f"workload {name!r} cannot be built with {params}: {e}") from None


def _check_types(name: str, params: dict[str, Any]) -> None:
    """``WorkloadError`` naming the first parameter whose value is not of its declared kind (the
    builders' annotations): sizes are integers from 1 to ``MAX_DIM`` (YAML's ``true`` is not 1),
    lists of sizes non-empty, flags true or false, names strings."""
    sig = inspect.signature(WORKLOADS[name]).parameters
    for key, value in params.items():
        ann = str(sig[key].annotation) if key in sig else "str"
        kinds = {a.strip() for a in ann.split("|")}
        if value is None and "None" in kinds:
            continue
        if "bool" in kinds:
            if not isinstance(value, bool):
                raise WorkloadError(f"workload {name!r}: {key} must be true or false, got {value!r}")
            continue
        if "int" in kinds and (_is_size(value) or ((name, key) in ZERO_COUNTS and _is_count(value))):
            continue
        if "float" in kinds and isinstance(value, numbers.Real) and not isinstance(value, bool) \
                and math.isfinite(value):
            continue
        if "Sequence[int]" in kinds and isinstance(value, (list, tuple)) and value and all(map(_is_size, value)):
            continue
        if "str" in kinds and isinstance(value, str):
            continue
        least = 0 if (name, key) in ZERO_COUNTS else 1
        want = {"int": f"a whole number from {least} to 2**40", "float": "a number",
                "Sequence[int]": "a non-empty list of whole numbers from 1 to 2**40", "str": "a name"}
        what = " or ".join(want[k] for k in ("int", "float", "Sequence[int]", "str") if k in kinds)
        raise WorkloadError(f"workload {name!r}: {key} must be {what}, got {value!r}; set it in the workload's "
                            f"params (--set {key}=... on the command line)")


def _is_size(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and 1 <= v <= MAX_DIM


def _is_count(v: Any) -> bool:
    """A size, or 0 (``ZERO_COUNTS``)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and 0 <= v <= MAX_DIM
