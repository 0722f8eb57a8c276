"""The DeepSeek-V3 workload (``workloads.deepseek``) and its preset.

Its multi-head latent attention and its DeepSeekMoE layer against NumPy formulas written token by
token from the DeepSeek-V3 report's equations (§2.1.1 eqs. 1-11, §2.1.2 eqs. 12-16) with the
balanced routing the workload fixes; the training step's gradients against central differences;
sharded and expert-parallel plans against the unsharded program; the preset's parameter counts
against the report's 671B total and 37B activated; the refusals; and Mixtral's graph (``llama``
with experts, built by the same ``_moe``) unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from test_vjp_finite_differences import fd_check

from executor import verify
from executor.run import execute, random_inputs
from ir import workloads
from ir.mesh import Mesh
from ir.rewrites import random_walk
from ir.rewrites.layout import layout

# 3 layers: the first dense, two DeepSeekMoE layers (a class of two, and the last layer)
SMALL = dict(layers=3, d_model=16, heads=2, q_lora_rank=12, kv_lora_rank=6, qk_nope_head_dim=4,
             qk_rope_head_dim=4, v_head_dim=6, d_ff=24, moe_d_ff=10, experts=4, top_k=2, shared_experts=1,
             first_k_dense=1, routed_scaling_factor=2.5, vocab=20, seq=8, batch=2)


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rms(x, gamma, eps=1e-6):
    return x / np.sqrt(np.mean(x * x) + eps) * gamma


def rotary(x, pos):
    """RoFormer's rotation of one vector at position ``pos``, pairing dim ``i`` with ``i + e/2``."""
    e = x.shape[-1]
    theta = pos * 10000.0 ** (-2.0 * np.arange(e // 2) / e)
    c, s = np.cos(theta), np.sin(theta)
    x1, x2 = x[: e // 2], x[e // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s])


def mla_formula(h, p, pre):
    """MLA, one token at a time (eqs. 1-11): latents ``c^Q = RMSNorm(W^DQ h)``, ``c^KV =
    RMSNorm(W^DKV h)``; per head ``q = [W^UQ c^Q; RoPE(W^QR c^Q)]``, ``k = [W^UK c^KV; RoPE(W^KR h)]``
    with the one rope key of the token shared by all heads, ``v = W^UV c^KV``; causal softmax of
    ``q·k / sqrt(d_nope + d_rope)``; ``u = W^O [o_1; ...; o_H]``."""
    b, s, _ = h.shape
    wq_nope, wk_nope = p[f"{pre}Wq_nope"], p[f"{pre}Wk_nope"]
    heads, nope, rope_d = wq_nope.shape[1], wq_nope.shape[2], p[f"{pre}Wk_rope"].shape[1]
    out = np.zeros_like(h)
    for i in range(b):
        q, k, v = {}, {}, {}
        for t in range(s):
            # no query compression (q_lora_rank None, DeepSeek-V2-Lite's form): the heads read h
            cq = rms(h[i, t] @ p[f"{pre}Wq_a"], p[f"{pre}q_a_norm"]) if f"{pre}Wq_a" in p else h[i, t]
            ckv = rms(h[i, t] @ p[f"{pre}Wkv_a"], p[f"{pre}kv_a_norm"])
            k_rope = rotary(h[i, t] @ p[f"{pre}Wk_rope"], t)  # one per token
            for n in range(heads):
                q[t, n] = np.concatenate([cq @ wq_nope[:, n], rotary(cq @ p[f"{pre}Wq_rope"][:, n], t)])
                k[t, n] = np.concatenate([ckv @ wk_nope[:, n], k_rope])
                v[t, n] = ckv @ p[f"{pre}Wv"][:, n]
        for t in range(s):
            for n in range(heads):
                scores = np.array([q[t, n] @ k[j, n] for j in range(t + 1)]) / np.sqrt(nope + rope_d)
                w = np.exp(scores - scores.max())
                w /= w.sum()
                o = sum(w[j] * v[j, n] for j in range(t + 1))
                out[i, t] += o @ p[f"{pre}Wo"][n]
    return out


def swiglu(x, w_gate, w_up, w_down):
    return (silu(x @ w_gate) * (x @ w_up)) @ w_down


def deepseek_moe_formula(x, p, pre, top_k, scale):
    """DeepSeekMoE, one token at a time (eqs. 12-16): ``h' = Σ_shared FFN(u) + Σ_i g_i FFN_i(u)``,
    the chosen experts ``(s·k + j) mod E`` (balanced routing), ``g_i = scale · σ(u·e_i) / Σ_chosen
    σ(u·e_j)``."""
    b, s, _ = x.shape
    experts = p[f"{pre}W_router"].shape[1]
    y = np.zeros_like(x)
    for i in range(b):
        for t in range(s):
            u = x[i, t]
            chosen = [(t * top_k + j) % experts for j in range(top_k)]
            scores = np.array([sigmoid(u @ p[f"{pre}W_router"][:, e]) for e in chosen])
            gates = scale * scores / scores.sum()
            for g, e in zip(gates, chosen):
                y[i, t] += g * swiglu(u, p[f"{pre}W_gate"][e], p[f"{pre}W_up"][e], p[f"{pre}W_down"][e])
            y[i, t] += swiglu(u, p[f"{pre}shared_W_gate"], p[f"{pre}shared_W_up"], p[f"{pre}shared_W_down"])
    return y


def run64(g, seed=0):
    ins = {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in random_inputs(g, seed).items()}
    # norm weights away from 1, so a dropped or misplaced norm shows
    for n in ins:
        if n.endswith("norm"):
            ins[n] = 0.5 + np.abs(ins[n])
    return ins, execute(g, ins, precision="float64")


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_mla_matches_the_reports_equations(q_lora_rank):
    g = workloads.build("deepseek", **{**SMALL, "q_lora_rank": q_lora_rank})
    ins, env = run64(g)
    if q_lora_rank is None:
        assert "l0_Wq_a" not in g.tensors and g.tensors["l0_Wq_nope"].shape == (16, 2, 4)
    for layer in (0, 2):
        h = np.asarray(env[f"l{layer}.attn_norm.out"])
        want = mla_formula(h, ins, f"l{layer}_")
        np.testing.assert_allclose(np.asarray(env[f"l{layer}.o_proj.out"]), want, rtol=1e-10, atol=1e-12)


def test_moe_layer_matches_the_reports_equations():
    g = workloads.build("deepseek", **SMALL)
    ins, env = run64(g)
    assert "l0.moe_mix" not in g.ops and g.tensors["l0_W_gate"].shape == (16, 24)  # the dense first layer
    for layer in (1, 2):
        x = np.asarray(env[f"l{layer}.ffn_norm.out"])
        want = deepseek_moe_formula(x, ins, f"l{layer}_", 2, 2.5)
        np.testing.assert_allclose(np.asarray(env[f"l{layer}.moe_shared_add.out"]), want, rtol=1e-10, atol=1e-12)
    # the dense layer: SwiGLU of width d_ff
    x = np.asarray(env["l0.ffn_norm.out"])
    np.testing.assert_allclose(np.asarray(env["l0.ff_down.out"]), swiglu(x, ins["l0_W_gate"], ins["l0_W_up"],
                                                                         ins["l0_W_down"]), rtol=1e-10)


@pytest.mark.parametrize("experts,top_k,seq,shared", [(8, 2, 4, 2), (3, 1, 6, 0), (4, 4, 2, 1)])
def test_moe_variants_match(experts, top_k, seq, shared):
    g = workloads.build("deepseek", **{**SMALL, "experts": experts, "top_k": top_k, "seq": seq,
                                       "shared_experts": shared, "routed_scaling_factor": 1.5, "layers": 2})
    ins, env = run64(g)
    x = np.asarray(env["l1.ffn_norm.out"])
    if shared:
        assert g.tensors["l1_shared_W_up"].shape == (16, shared * 10)
        got = np.asarray(env["l1.moe_shared_add.out"])
    else:
        assert "l1_shared_W_up" not in g.tensors
        got = np.asarray(env["l1.moe_mix.out"])
        for n in ("W_gate", "W_up", "W_down"):  # the formula's shared expert, zeroed
            ins[f"l1_shared_{n}"] = np.zeros((16, 1) if n != "W_down" else (1, 16))
    want = deepseek_moe_formula(x, ins, "l1_", top_k, 1.5)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_whole_model_forward_matches_the_formulas():
    """Embedding, three layers of the formulas, final norm and head: the program's logits."""
    g = workloads.build("deepseek", **SMALL)
    ins, env = run64(g, seed=4)
    h = ins["tok_emb"][ins["ids"]]
    for layer in range(3):
        pre = f"l{layer}_"
        h = h + mla_formula(np.stack([[rms(t, ins[pre + "attn_norm"]) for t in s] for s in h]), ins, pre)
        x = np.stack([[rms(t, ins[pre + "ffn_norm"]) for t in s] for s in h])
        h = h + (swiglu(x, ins[pre + "W_gate"], ins[pre + "W_up"], ins[pre + "W_down"]) if layer == 0
                 else deepseek_moe_formula(x, ins, pre, 2, 2.5))
    logits = np.stack([[rms(t, ins["final_norm"]) for t in s] for s in h]) @ ins["W_head"]
    np.testing.assert_allclose(np.asarray(env["lm_head.out"]), logits, rtol=1e-9, atol=1e-11)


TINY = dict(layers=2, d_model=4, heads=1, q_lora_rank=2, kv_lora_rank=2, qk_nope_head_dim=1, qk_rope_head_dim=2,
            v_head_dim=2, d_ff=2, moe_d_ff=2, experts=2, top_k=2, shared_experts=1, first_k_dense=1, vocab=3, seq=2,
            batch=1)


@pytest.mark.slow  # central differences of every parameter element (~40 s): CI's test-slow runs it
def test_training_gradients_match_finite_differences():
    g = workloads.build("deepseek", **TINY)
    assert fd_check(g, loss="cross_entropy") > 100  # a dense layer and a DeepSeekMoE layer, every element


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_training_gradients_match_directional_differences(seed):
    """Every parameter's gradient at once, along a random direction: ``Σ_p <grad_p, v_p>`` against
    the central difference of the loss along ``v`` (two executions, so it runs in ``make test``;
    the element-wise check above is slow)."""
    from ir.autodiff import training_step

    step = training_step(workloads.build("deepseek", **{**TINY, "d_model": 6, "heads": 2, "seq": 4, "experts": 4}),
                         loss="cross_entropy", optimizer="sgd")
    ins, env = run64(step, seed)
    rng = np.random.default_rng(seed + 10)
    params = [n for n, t in step.tensors.items() if t.role == "parameter"]
    v = {n: rng.standard_normal(ins[n].shape) for n in params}
    norm = np.sqrt(sum(float(np.sum(x * x)) for x in v.values()))
    v = {n: x / norm for n, x in v.items()}  # a unit step: the difference's error stays at h² scale
    h = 1e-5
    loss = [float(execute(step, {**ins, **{n: ins[n] + sign * h * v[n] for n in params}},
                          precision="float64")["loss"][0]) for sign in (1.0, -1.0)]
    want = (loss[0] - loss[1]) / (2 * h)
    got = sum(float(np.sum(np.asarray(env[f"{n}.grad"]) * v[n])) for n in params)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert abs(want) > 1e-2


def test_sharded_and_expert_parallel_plans_verify():
    step = workloads.build("deepseek", **SMALL, mode="train")
    assert verify(random_walk(step, np.random.default_rng(0), 4, 25)).ok
    ep = layout(step, "all", Mesh((2, 2), 2), ("b", "e"))
    assert verify(ep).ok
    for name in ("l1.ff_gate", "l2.ff_down"):  # the routed experts [e, b, c, f]: experts over axis 1
        sh = ep.ops[name].shards
        got = {(int(d), int(lo[0]), int(lo[1])) for d, lo in zip(sh.device, sh.lo)}
        assert got == {(0, 0, 0), (1, 2, 0), (2, 0, 1), (3, 2, 1)}, name
    sh = ep.ops["l1_W_gate.update"].shards  # the routed experts' states: one expert a device
    assert {(int(d), int(lo[0])) for d, lo in zip(sh.device, sh.lo)} == {(0, 0), (1, 1), (2, 2), (3, 3)}
    # the shared expert and the dense layer's MLP are no experts: every device computes its tokens' share
    for name in ("l1.shared_ff_gate", "l0.ff_gate"):
        assert len(ep.ops[name].shards.device) == 4, name


def test_expert_parallel_baseline():
    from optimizer.search.baselines import baselines

    step = workloads.build("deepseek", **SMALL, mode="train")
    got = baselines(step, 8, 4)
    assert "dp2-ep4" in got and verify(got["dp2-ep4"]).ok
    sh = got["dp2-ep4"].ops["l2.ff_up"].shards
    assert sorted((int(d), int(lo[0])) for d, lo in zip(sh.device, sh.lo)) == [(i, i % 4) for i in range(8)]


def test_dense_and_moe_layers_form_classes():
    from ir.layers import layer_classes

    g = workloads.build("deepseek", **{**SMALL, "layers": 8, "first_k_dense": 3}, mode="train")
    classes = layer_classes(g)
    # layer 0 (reads the embedding), dense 1-2, DeepSeekMoE 3-6 (3 reads a dense layer's output, as
    # names relative to the layer say: the same signature), layer 7 (the head's gradient)
    assert classes[1] == classes[2] and len({classes[i] for i in range(3, 7)}) == 1
    assert len({classes[0], classes[1], classes[3], classes[7]}) == 4


@pytest.mark.parametrize("params,field", [
    (dict(experts=3, top_k=2, seq=8), "seq \\* top_k"),
    (dict(top_k=5), "top_k 5 must be between 1 and experts 4"),
    (dict(top_k=0), "top_k must be a whole number"),
    (dict(qk_rope_head_dim=3), "qk_rope_head_dim 3 must be even"),
    (dict(first_k_dense=4), "first_k_dense 4 must be at most layers 3"),
    (dict(first_k_dense=-1), "first_k_dense must be a whole number from 0"),
    (dict(shared_experts=1.5), "shared_experts must be a whole number"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor 0.0 must be a positive number"),
    (dict(capacity_factor=0.5), "capacity_factor 0.5 must be a number from 1"),
    (dict(q_lora_rank=0), "q_lora_rank must be a whole number from 1"),
    (dict(kv_heads=2), "has no parameter 'kv_heads'"),
])
def test_refusals_name_the_field(params, field):
    with pytest.raises(workloads.WorkloadError, match=field):
        workloads.build("deepseek", **{**SMALL, **params})


def test_zero_dense_layers_and_no_shared_expert_build():
    g = workloads.build("deepseek", **{**SMALL, "first_k_dense": 0, "shared_experts": 0})
    assert "l0.moe_mix" in g.ops and not any("shared" in n for n in g.ops)


# digests of llama(experts=...) built before DeepSeekMoE's options were added to ``_moe``
MIXTRAL_DIGESTS = {
    ("forward", 1.0): "dcaa91af57400c00b69f6c5b1aaee76f297440306831766e810fe3efc4f125f7",
    ("train", 1.0): "c76d77e485f020974be002fcd878d586016235f53c6cb372133039cfb65427ba",
    ("forward", 1.5): "c8bf07f0db06c2ad942c5440ea87392576abb5a2d61271a1d1959ea1357d1383",
    ("train", 1.5): "4993ef2e4db7091c40764ba4c9c95b958546f8ad96608b013175d68fe313662e",
}


@pytest.mark.parametrize("mode,factor", sorted(MIXTRAL_DIGESTS))
def test_mixtral_graph_is_unchanged(mode, factor):
    experts = 4 if factor == 1.0 else 8
    g = workloads.build("llama", layers=2, d_model=16, heads=2, d_ff=24, vocab=20, seq=8, batch=2, mode=mode,
                        experts=experts, top_k=2, **({"capacity_factor": factor} if factor != 1.0 else {}))
    assert g.digest == MIXTRAL_DIGESTS[mode, factor]


def test_deepseek_v3_preset_counts_671b_and_37b_activated():
    """The report (abstract, §4.2): 671B parameters in all, 37B activated per token; the released
    checkpoint's 685B add the 14B multi-token-prediction module, which the workload leaves out,
    so 671B is the number to meet. Counted from the program's parameter tensors, embedding and
    head included."""
    from ir.model_presets import PRESETS

    p = PRESETS["deepseek-v3"]
    assert (p.layers, p.d_model, p.heads, p.experts, p.top_k, p.first_k_dense) == (61, 7168, 128, 256, 8, 3)
    g = workloads.build("deepseek", preset="deepseek-v3")
    sizes = {n: int(np.prod(t.shape)) for n, t in g.tensors.items() if t.role == "parameter"}
    total = sum(sizes.values())
    # closed form: MLA, the norms, dense MLPs, routed + shared experts and router, embedding and head
    d, h = 7168, 128
    mla = d * 1536 + 1536 + 1536 * h * (128 + 64) + d * (512 + 64) + 512 + 512 * h * (128 + 128) + h * 128 * d
    expert = 3 * d * 2048
    want = 61 * (mla + 2 * d) + 3 * 3 * d * 18432 + 58 * (257 * expert + d * 256) + 2 * 129280 * d + d
    assert total == want
    assert total == pytest.approx(671e9, rel=1e-3)  # 671.03B
    routed = sum(v for n, v in sizes.items() if g.tensors[n].shape[:1] == (256,) and n.endswith(("_W_gate", "_W_up",
                                                                                               "_W_down")))
    assert routed == 58 * 256 * expert
    activated = total - routed * (256 - 8) // 256  # 37.55B, embedding table included; 36.63B without it
    assert activated == pytest.approx(37e9, rel=0.015)
    assert activated - sizes["tok_emb"] == pytest.approx(37e9, rel=0.011)


def test_preset_builds_a_few_layers_and_keeps_other_presets():
    from ir.model_presets import PRESETS

    g = workloads.build("deepseek", preset="deepseek-v3", layers=4, seq=64, batch=1)
    assert g.tensors["l3_W_gate"].shape == (256, 7168, 2048) and g.tensors["l2_W_gate"].shape == (7168, 18432)
    assert g.tensors["l3.moe_dispatch.out"].shape == (256, 1, 2, 7168)
    assert g.ops["l3.attn_qk"].params["alpha"] == pytest.approx(1 / np.sqrt(192))
    assert PRESETS["llama2-7b"].sizes()["kv_heads"] == 32
    with pytest.raises(workloads.WorkloadError, match="deepseek presets are \\['deepseek-v3'\\]"):
        workloads.build("deepseek", preset="mixtral-8x7b")


def test_deepseek_campaign_config_builds():
    from pathlib import Path

    from optimizer.campaign.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "deepseek-v3-train-h100x512.yaml")
    assert cfg.workload.name == "deepseek" and cfg.workload.params["preset"] == "deepseek-v3"
    params = {**cfg.workload.params, "layers": 4, "seq": 64, "batch": 1, "dtype": "float32"}
    g = workloads.build(cfg.workload.name, **params)
    assert g.tensors["l3_W_gate"].shape == (256, 7168, 2048) and "l3_W_gate.m.next" in g.tensors
