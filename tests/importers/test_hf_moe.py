"""Hugging Face mixtures of experts through ``import_torch`` (skipped without ``transformers``):
each sparse MoE block is exported as its balanced-routing twin (``ir.importers.torch_moe``).

The twin against a token-by-token NumPy formula of the block's layer with balanced routing, on the
block's own weights; tiny Mixtral and Qwen2-MoE decoders import, compute and train as the model
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


def silu(x):
    return x / (1.0 + np.exp(-x))


def balanced_formula(block, x: np.ndarray) -> np.ndarray:
    """The block's layer one token at a time, with token ``s``'s experts ``(s·k + j) mod E`` in
    place of its top-k: the router's probabilities (softmax over all experts) at the chosen ones,
    renormalised over them where the block renormalises its top-k (Mixtral always, Qwen2-MoE with
    ``norm_topk_prob``); each expert ``w_down (silu(w_gate x) * w_up x)`` from the stacked
    ``gate_up_proj[E, 2f, d]`` (gate rows first) and ``down_proj[E, d, f]``; Qwen2-MoE adds its
    shared expert, gated by a sigmoid."""
    def arr(p):
        return p.detach().double().numpy()

    router, gate_up, down = arr(block.gate.weight), arr(block.experts.gate_up_proj), arr(block.experts.down_proj)
    experts, f = down.shape[0], down.shape[2]
    k = block.gate.top_k
    renormalise = getattr(block.gate, "norm_topk_prob", True)
    y = np.zeros_like(x)
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            chosen = [(t * k + j) % experts for j in range(k)]
            probs = scipy.special.softmax(router @ x[i, t])[chosen]
            for p, e in zip(probs / probs.sum() if renormalise else probs, chosen):
                h = gate_up[e] @ x[i, t]
                y[i, t] += p * (down[e] @ (silu(h[:f]) * h[f:]))
            if hasattr(block, "shared_expert"):
                s = block.shared_expert
                h = silu(arr(s.gate_proj.weight) @ x[i, t]) * (arr(s.up_proj.weight) @ x[i, t])
                y[i, t] += scipy.special.expit(arr(block.shared_expert_gate.weight) @ x[i, t]) * \
                    (arr(s.down_proj.weight) @ h)
    return y


@pytest.mark.parametrize("make", [_mixtral, _qwen2_moe, lambda: _qwen2_moe(norm_topk_prob=True), _qwen3_moe, _olmoe],
                         ids=["mixtral", "qwen2-moe", "qwen2-moe-normalised", "qwen3-moe", "olmoe"])
def test_twin_is_balanced_routing_of_the_blocks_layer(make):
    torch.manual_seed(0)
    block = make().model.layers[0].mlp
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        got = balanced_moe_twin(torch, block.double())(x).numpy()
    np.testing.assert_allclose(got, balanced_formula(block, x.numpy()), rtol=1e-10, atol=1e-12)


def _twinned(m):
    """A copy of ``m`` with its MoE blocks' balanced twins in place: what the import computes."""
    twin = copy.deepcopy(m)
    return _swap_for_export(torch, twin)[0]


@pytest.mark.parametrize("make,kernels", [(_mixtral, {"rmsnorm", "softmax", "silu", "expand"}),
                                          (_qwen2_moe, {"rmsnorm", "log_softmax", "exp", "sigmoid", "silu"})],
                         ids=["mixtral", "qwen2-moe"])
def test_decoder_imports_computes_and_trains_as_its_twin(make, kernels):
    torch.manual_seed(0)
    model = make().eval()
    m = Logits(model)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = m(ids)
    cls = type(model.model.layers[0].mlp)
    g, _env = check_against_torch(m, ids, kernels, reference=_twinned(m))
    # the caller's model as it was: its own blocks, its own (learned-routing) outputs
    assert all(type(layer.mlp) is cls for layer in model.model.layers)
    with torch.no_grad():
        assert torch.equal(m(ids), before)
    assert has_experts(g)
    gemms = [n for n, o in g.ops.items() if o.params.get("equation") in ("ebcd,egd->ebcg", "ebcf,edf->ebcd")]
    assert len(gemms) == 4, gemms  # two layers' gate-up and down GEMMs on the stacked [E, ., .] weights
    step = training_step(g, loss="mse", optimizer="adamw")
    ep = layout(step, "all", Mesh((2, 2), 2), ("b", "e"))
    for name in gemms:  # [e, b, c, .]: the experts over axis 1 (two a device), the batch over axis 0
        sh = ep.ops[name].shards
        assert {(int(d), int(lo[0]), int(lo[1])) for d, lo in zip(sh.device, sh.lo)} == \
            {(0, 0, 0), (1, 2, 0), (2, 0, 1), (3, 2, 1)}, name
    rep = verify(ep)
    assert rep.ok, rep


def test_uneven_routing_is_refused_and_the_model_kept():
    """seq 7 · top_k 2 = 14 copies do not divide over 4 experts."""
    model = _mixtral().eval()
    with pytest.raises(ImportFailure, match=r"sequence length whose seq \* top_k is a multiple of 4"):
        import_torch(Logits(model), {"x": torch.randint(0, 96, (2, 7))})
    assert all(type(layer.mlp).__name__ == "MixtralSparseMoeBlock" for layer in model.model.layers)


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
