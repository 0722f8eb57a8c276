"""Hugging Face mixtures of experts through ``import_torch`` (skipped without ``transformers``):
each sparse MoE block is exported as its balanced-routing twin (``ir.importers.torch_moe``).

The twin against a token-by-token NumPy formula of the block's layer with balanced routing, on the
block's own weights (DeepSeek-V3's formula checked against the block itself at the block's own
choice); tiny Mixtral, Qwen2-MoE and DeepSeek-V3 decoders import, compute and train as the model
with its twins swapped in does, leave the caller's model as it was, and their experts' GEMMs are
what the expert-parallel layout splits; a sequence that routes unevenly is refused."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import scipy.special

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_models import Logits  # noqa: E402
from torch_checks import check_against_torch  # noqa: E402

from executor import verify  # noqa: E402
from executor.run import execute  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.importers.errors import ImportFailure  # noqa: E402
from ir.importers.torch_export import _swap_for_export, import_torch  # noqa: E402
from ir.importers.torch_moe import balanced_moe_twin  # noqa: E402
from ir.mesh import Mesh  # noqa: E402
from ir.rewrites.layout import has_experts, layout  # noqa: E402

T = transformers
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32)


def _mixtral():
    return T.MixtralForCausalLM(T.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2))


def _qwen2_moe(norm_topk_prob: bool = False):
    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**TINY, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                                  num_experts=4, num_experts_per_tok=2,
                                                  norm_topk_prob=norm_topk_prob))


def _qwen3_moe():
    return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**TINY, moe_intermediate_size=16, num_experts=4,
                                                  num_experts_per_tok=2))


def _olmoe():
    return T.OlmoeForCausalLM(T.OlmoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, pad_token_id=0,
                                            eos_token_id=1))


def _deepseek_v3(norm_topk_prob: bool = True, layers: int = 2):
    """DeepSeek-V3: ``first_k_dense_replace`` dense layers, then MoE blocks (sigmoid router with a
    correction bias and group-limited choice, 2 groups of 2 experts; shared experts) and MLA
    attention (low-rank q and kv, a nope/rope split of the query-key head dim, interleaved rope)."""
    return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        **{**TINY, "num_key_value_heads": 4, "num_hidden_layers": layers}, moe_intermediate_size=16,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5, q_lora_rank=16,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8))


def _deepseek_v2():
    """DeepSeek-V2's MoE block: softmax router, no renormalisation, scaled gates, shared experts."""
    return T.DeepseekV2ForCausalLM(T.DeepseekV2Config(
        **{**TINY, "num_key_value_heads": 4}, moe_intermediate_size=16, n_shared_experts=2, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=0, routed_scaling_factor=1.5, q_lora_rank=16,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8))


def _moe_block(make):
    """The first sparse MoE block of ``make()`` (DeepSeek-V3's first layer is dense)."""
    return next(layer.mlp for layer in make().model.layers if hasattr(layer.mlp, "experts"))


def silu(x):
    return x / (1.0 + np.exp(-x))


def balanced(t: int, k: int, experts: int, x_t: np.ndarray) -> list[int]:
    """Token ``t``'s experts under balanced routing: ``(t·k + j) mod E``."""
    return [(t * k + j) % experts for j in range(k)]


def deepseek_v3_choice(block):
    """DeepSeek-V3's own choice of a token's experts (to check ``balanced_formula`` against the
    block): sigmoid scores plus the correction bias; the ``topk_group`` groups with the largest
    sums of their two best scores; the top-k experts in those groups."""
    router = block.gate
    bias = router.e_score_correction_bias.detach().double().numpy()
    w = router.weight.detach().float().numpy()

    def choose(t, k, experts, x_t):
        score = scipy.special.expit((w @ x_t.astype(np.float32)).astype(np.float64)) + bias
        groups = score.reshape(router.num_group, -1)
        best = np.argsort(-np.sort(groups, axis=1)[:, -2:].sum(axis=1))[:router.topk_group]
        masked = np.full_like(groups, -np.inf)
        masked[best] = groups[best]
        return list(np.argsort(-masked.reshape(-1))[:k])
    return choose


def balanced_formula(block, x: np.ndarray, choice=balanced) -> np.ndarray:
    """The block's layer one token at a time, with token ``s``'s experts ``(s·k + j) mod E`` (or
    ``choice``'s) in place of its top-k. Gates: the router's probabilities (softmax over all
    experts) at the chosen ones, renormalised over them where the block renormalises its top-k
    (Mixtral always, Qwen2-MoE with ``norm_topk_prob``); DeepSeek-V3's are the sigmoids of the
    chosen logits (float32 logits, no correction bias), renormalised (``+ 1e-20``) with
    ``norm_topk_prob``; DeepSeek's (V2 and V3) are then times ``routed_scaling_factor``. Each expert
    is ``w_down (silu(w_gate x) * w_up x)`` from the stacked ``gate_up_proj[E, 2f, d]`` (gate rows
    first) and ``down_proj[E, d, f]``; Qwen2-MoE adds its shared expert gated by a sigmoid,
    DeepSeek its ``shared_experts`` MLP ungated."""
    def arr(p):
        return p.detach().double().numpy()

    def mlp(m, v):
        return arr(m.down_proj.weight) @ (silu(arr(m.gate_proj.weight) @ v) * (arr(m.up_proj.weight) @ v))

    router, gate_up, down = arr(block.gate.weight), arr(block.experts.gate_up_proj), arr(block.experts.down_proj)
    experts, f = down.shape[0], down.shape[2]
    k = block.gate.top_k
    deepseek = hasattr(block.gate, "routed_scaling_factor")
    sigmoid = hasattr(block.gate, "e_score_correction_bias")  # DeepSeek-V3's router
    renormalise = getattr(block.gate, "norm_topk_prob", True) and type(block).__name__ != "DeepseekV2Moe"
    y = np.zeros_like(x)
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            chosen = choice(t, k, experts, x[i, t])
            if deepseek:  # DeepSeek's routers score in float32
                logits = (router.astype(np.float32) @ x[i, t].astype(np.float32)).astype(np.float64)
            else:
                logits = router @ x[i, t]
            if sigmoid:
                probs = scipy.special.expit(logits)[chosen]
                probs = probs / (probs.sum() + 1e-20) if renormalise else probs
            else:
                probs = scipy.special.softmax(logits)[chosen]
                probs = probs / probs.sum() if renormalise else probs
            if deepseek:
                probs = probs * block.gate.routed_scaling_factor
            for p, e in zip(probs, chosen):
                h = gate_up[e] @ x[i, t]
                y[i, t] += p * (down[e] @ (silu(h[:f]) * h[f:]))
            if hasattr(block, "shared_expert"):
                y[i, t] += scipy.special.expit(arr(block.shared_expert_gate.weight) @ x[i, t]) * \
                    mlp(block.shared_expert, x[i, t])
            if hasattr(block, "shared_experts"):
                y[i, t] += mlp(block.shared_experts, x[i, t])
    return y


@pytest.mark.parametrize("make", [_mixtral, _qwen2_moe, lambda: _qwen2_moe(norm_topk_prob=True), _qwen3_moe, _olmoe,
                                  _deepseek_v3, lambda: _deepseek_v3(norm_topk_prob=False), _deepseek_v2],
                         ids=["mixtral", "qwen2-moe", "qwen2-moe-normalised", "qwen3-moe", "olmoe", "deepseek-v3",
                              "deepseek-v3-unnormalised", "deepseek-v2"])
def test_twin_is_balanced_routing_of_the_blocks_layer(make):
    torch.manual_seed(0)
    block = _moe_block(make)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        got = balanced_moe_twin(torch, block.double())(x).numpy()
    # DeepSeek's routers score in float32 in the block, in the twin and in the formula (a float64
    # twin's gates are float32-exact only)
    tol = dict(rtol=1e-6, atol=1e-8) if hasattr(block.gate, "routed_scaling_factor") else dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got, balanced_formula(block, x.numpy()), **tol)


def test_deepseek_v3_formula_is_the_blocks_layer():
    """``balanced_formula``'s DeepSeek-V3 arithmetic with the block's own choice (correction bias,
    group-limited top-k) is the block's forward: what the twin computes at the balanced choice is
    DeepSeek's layer, scaling factor, renormalisation and shared experts included."""
    torch.manual_seed(0)
    block = _moe_block(_deepseek_v3).eval()
    with torch.no_grad():  # a bias that changes the choice, so the formula's choice must use it
        block.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.1]))
        block.gate.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x).double().numpy()
    got = balanced_formula(block, x.double().numpy(), choice=deepseek_v3_choice(block))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _twinned(m):
    """A copy of ``m`` with its MoE blocks' balanced twins in place: what the import computes."""
    twin = copy.deepcopy(m)
    return _swap_for_export(torch, twin)[0]


@pytest.mark.parametrize("make,kernels", [(_mixtral, {"rmsnorm", "softmax", "silu", "expand"}),
                                          (_qwen2_moe, {"rmsnorm", "log_softmax", "exp", "sigmoid", "silu"}),
                                          (lambda: _deepseek_v3(layers=3), {"rmsnorm", "sigmoid", "div", "concat"})],
                         ids=["mixtral", "qwen2-moe", "deepseek-v3"])
def test_decoder_imports_computes_and_trains_as_its_twin(make, kernels):
    """DeepSeek-V3 (a dense first layer, then two MoE layers; MLA attention, whose keys are
    filled by slice assignment) as Mixtral and Qwen2-MoE."""
    torch.manual_seed(0)
    model = make().eval()
    m = Logits(model)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = m(ids)
    classes = [type(layer.mlp) for layer in model.model.layers]
    g, _env = check_against_torch(m, ids, kernels, reference=_twinned(m))
    # the caller's model as it was: its own blocks, its own (learned-routing) outputs
    assert [type(layer.mlp) for layer in model.model.layers] == classes
    with torch.no_grad():
        assert torch.equal(m(ids), before)
    assert has_experts(g)
    gemms = [n for n, o in g.ops.items() if o.params.get("equation") in ("ebcd,egd->ebcg", "ebcf,edf->ebcd")]
    assert len(gemms) == 4, gemms  # two MoE layers' gate-up and down GEMMs on the stacked [E, ., .] weights
    step = training_step(g, loss="mse", optimizer="adamw")
    ep = layout(step, "all", Mesh((2, 2), 2), ("b", "e"))
    for name in gemms:  # [e, b, c, .]: the experts over axis 1 (two a device), the batch over axis 0
        sh = ep.ops[name].shards
        assert {(int(d), int(lo[0]), int(lo[1])) for d, lo in zip(sh.device, sh.lo)} == \
            {(0, 0, 0), (1, 2, 0), (2, 0, 1), (3, 2, 1)}, name
    rep = verify(ep)
    assert rep.ok, rep


@pytest.mark.parametrize("make", [_mixtral, _deepseek_v3], ids=["mixtral", "deepseek-v3"])
def test_uneven_routing_is_refused_and_the_model_kept(make):
    """seq 7 · top_k 2 = 14 copies do not divide over 4 experts."""
    model = make().eval()
    classes = [type(layer.mlp) for layer in model.model.layers]
    with pytest.raises(ImportFailure, match=r"sequence length whose seq \* top_k is a multiple of 4"):
        import_torch(Logits(model), {"x": torch.randint(0, 96, (2, 7))})
    assert [type(layer.mlp) for layer in model.model.layers] == classes


@pytest.mark.parametrize("make", [_qwen3_moe, _olmoe], ids=["qwen3-moe", "olmoe"])
def test_more_decoders_import_as_their_twins(make):
    """Qwen3-MoE and OLMoE (Mixtral's experts, the router's ``norm_topk_prob``), forward only."""
    torch.manual_seed(0)
    m = Logits(make().eval())
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    g, values = import_torch(m, {"x": ids})
    with torch.no_grad():
        want = _twinned(m)(ids).numpy()
    np.testing.assert_allclose(execute(g, {**values, "x": ids.numpy()})["output"], want, rtol=1e-5, atol=1e-6)
    assert has_experts(g)
