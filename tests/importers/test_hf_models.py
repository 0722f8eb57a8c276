"""Hugging Face models as users bring them: tiny random-weight configs of the ``transformers``
architectures imported through ``import_torch`` (skipped without ``transformers``; CI installs
the ``[hf]`` extra).

Each forward equals the model's own logits (or hidden states), and the training step's gradients
equal ``torch.autograd``'s for every parameter (``torch_checks.check_against_torch``). What these
exports need: ``torch.diff`` on the position ids (``ir.importers.torch_symbolics``), the NaN guard
of torch's exported attention (``IsNaN``), BERT's buffered token types (a ``GatherElements``
folded on constants, then a ``Gather`` of constant indices from the token-type table)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch_checks import check_against_torch  # noqa: E402

from executor import verify  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.importers.torch_export import import_torch  # noqa: E402
from executor.run import execute  # noqa: E402
from ir.rewrites import random_walk  # noqa: E402

T = transformers
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=32)


class Logits(torch.nn.Module):
    """``model(ids).logits`` (or ``last_hidden_state`` for an encoder), without a KV cache."""

    def __init__(self, model) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids):
        out = self.m(ids, use_cache=False) if hasattr(self.m, "lm_head") else self.m(ids)
        return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _falcon():
    """Falcon: multi-query attention (one k and v head, which the export squeezes for the einsums)."""
    return T.FalconForCausalLM(T.FalconConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4))


def _models():
    yield "llama-gqa", lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_key_value_heads=2)), \
        {"rmsnorm", "silu", "causal_mask", "embedding"}
    yield "qwen2", lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL, num_key_value_heads=2)), \
        {"rmsnorm", "linear", "causal_mask"}
    yield "gpt2", lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                                          n_positions=32)), {"layernorm", "causal_mask"}
    yield "bert", lambda: T.BertModel(T.BertConfig(**SMALL), add_pooling_layer=False), \
        {"layernorm", "gelu_erf", "embedding"}
    # positions computed from the ids (cumsum of the non-padding tokens): a lookup of computed ids
    yield "roberta", lambda: T.RobertaModel(T.RobertaConfig(**SMALL), add_pooling_layer=False), \
        {"float_to_index", "embedding", "layernorm"}
    # relative-position buckets: a lookup of constant ids in the bias table
    yield "t5-encoder", lambda: T.T5EncoderModel(T.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                            num_heads=4)), {"embedding", "rmsnorm"}
    # an empty rotary pass-through slice, concatenated
    yield "phi3", lambda: T.Phi3ForCausalLM(T.Phi3Config(**SMALL, num_key_value_heads=2, pad_token_id=0,
                                                         eos_token_id=1, bos_token_id=1)), {"rmsnorm", "concat"}
    yield "falcon", _falcon, {"layernorm", "gelu_erf", "concat"}


@pytest.mark.parametrize("name,make,kernels", list(_models()), ids=[m[0] for m in _models()])
def test_forward_and_gradients_match_torch(name, make, kernels):
    torch.manual_seed(0)
    m = Logits(make().eval())
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    g, _env = check_against_torch(m, ids, kernels)
    assert g.tensors["x"].dtype == "int32"
    from ir.rewrites.substitute_attention import attention_sites, fuse_attention

    sites = attention_sites(g)  # torch's exported attention, one per layer, for FlashAttention
    assert len(sites) == 2, name  # T5's position bias on the scores is the attention's bias
    if name == "roberta":  # the padding token's position is the padding row: ids with padding still match torch
        ids = ids.clone()
        ids[:, -3:] = m.m.config.pad_token_id
        with torch.no_grad():
            want = m(ids).numpy()
        got = execute(g, {**_env, "x": ids.numpy().astype(np.int32)})["output"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    fused = g
    for op in sites:
        fused = fuse_attention(fused, op)
    assert verify(fused, reference=g, values=_env).ok


def _forward_only():
    small_vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        image_size=16, patch_size=8)
    yield "mistral", lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, num_key_value_heads=2)), "ids"
    yield "gemma", lambda: T.GemmaForCausalLM(T.GemmaConfig(**SMALL, num_key_value_heads=1, head_dim=8)), "ids"
    yield "phi", lambda: T.PhiForCausalLM(T.PhiConfig(**SMALL)), "ids"
    yield "gpt-neox", lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**SMALL)), "ids"
    yield "opt", lambda: T.OPTForCausalLM(T.OPTConfig(vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                      num_attention_heads=4, max_position_embeddings=32,
                                                      word_embed_proj_dim=32)), "ids"
    yield "bloom", lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4)), "ids"
    yield "falcon", _falcon, "ids"
    yield "gpt-j", lambda: T.GPTJForCausalLM(T.GPTJConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                          rotary_dim=4)), "ids"
    yield "distilbert", lambda: T.DistilBertModel(T.DistilBertConfig(vocab_size=96, dim=32, hidden_dim=64, n_layers=2,
                                                                     n_heads=4, max_position_embeddings=32)), "ids"
    yield "vit", lambda: T.ViTModel(T.ViTConfig(**small_vision), add_pooling_layer=False), "image"
    yield "clip-vision", lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**small_vision)), "image"
    yield "swin", lambda: T.SwinModel(T.SwinConfig(image_size=16, patch_size=4, embed_dim=8, depths=[1, 1],
                                                   num_heads=[2, 2], window_size=2), add_pooling_layer=False), "image"
    yield "convnext", lambda: T.ConvNextModel(T.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)), \
        "image"


class Hidden(torch.nn.Module):
    """``model(pixels).last_hidden_state`` (vision encoders)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.m = model

    def forward(self, x):
        return self.m(x).last_hidden_state


@pytest.mark.slow  # 20 s of exports: CI's test-slow runs it, make test keeps to its budget
@pytest.mark.parametrize("name,make,kind", list(_forward_only()), ids=[m[0] for m in _forward_only()])
def test_forward_matches_the_model(name, make, kind):
    """More architectures, forward only (the exports' patterns are the ones trained above): equal
    to the model's output; decoders' attention is a site for ``fuse_attention``."""
    from executor.run import execute
    from ir.rewrites.substitute_attention import attention_sites

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 96, (2, 8), generator=gen) if kind == "ids" else torch.randn(2, 3, 16, 16, generator=gen)
    m = (Logits if kind == "ids" else Hidden)(make().eval())
    g, values = import_torch(m, {"x": x})
    with torch.no_grad():
        want = m(x).numpy()
    got = execute(g, {**values, "x": x.numpy()})["output"]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    if name in ("mistral", "gemma", "phi", "gpt-neox", "opt", "falcon", "gpt-j", "distilbert", "vit", "clip-vision"):
        assert len(attention_sites(g)) == 2, name


def test_falcon_training_step_fuses_multi_query_attention():
    """Falcon's training step: each layer's attention fuses through the squeeze of its single k head
    (kept as one reshape of k, whose inverse brings dk back), computes what the unfused step does,
    and unfuses to it exactly."""
    from ir.rewrites.substitute_attention import attention_sites, fuse_attention, fused_attentions, unfuse_attention

    torch.manual_seed(0)
    g, values = import_torch(Logits(_falcon().eval()), {"x": torch.randint(0, 96, (2, 8))})
    step = training_step(g, loss="mse", optimizer="sgd")
    fused = step
    for op in attention_sites(step):
        fused = fuse_attention(fused, op)
    kept = [o for n, o in fused.ops.items() if n.endswith((".k", ".dk_t")) and "+" in n]
    assert len(kept) == 4 and {o.kernel for o in kept} == {"reshape"}
    rep = verify(fused, reference=step, values=values)
    assert rep.ok, rep
    back = fused
    for op in fused_attentions(fused):
        back = unfuse_attention(back, op)
    assert back.digest == step.digest


def test_bert_fused_training_step_verifies():
    """BERT's key bias starts at zero and its gradient is exactly zero (softmax is shift-invariant),
    so its SGD update is rounding noise in both runs: ``verify`` judges it against the program's
    own float32 error and passes the fused step, naming that output; the other outputs are held
    to the relative tolerance."""
    from ir.rewrites.substitute_attention import attention_sites, fuse_attention

    torch.manual_seed(0)
    m = Logits(T.BertModel(T.BertConfig(**SMALL), add_pooling_layer=False).eval())
    g, values = import_torch(m, {"x": torch.randint(0, 96, (2, 8))})
    step = training_step(g, loss="mse", optimizer="sgd")
    fused = step
    for op in attention_sites(step):
        fused = fuse_attention(fused, op)
    rep = verify(fused, reference=step, values=values)
    assert rep.ok, rep
    assert set(rep.rounding) == {f"m.encoder.layer.{i}.attention.self.key.bias.next" for i in (0, 1)}


def test_a_sharded_training_plan_verifies():
    """A Llama training step with AdamW under random sharding rewrites computes what the
    unsharded step does (the executor's verify), on the importer's weights."""
    torch.manual_seed(0)
    m = Logits(T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_key_value_heads=2)).eval())
    g, values = import_torch(m, {"x": torch.randint(0, 96, (2, 8))})
    step = training_step(g, loss="mse", optimizer="adamw")
    rep = verify(random_walk(step, np.random.default_rng(0), 4, 20), values=values)
    assert rep.ok, rep


@pytest.mark.slow  # two imports of configs/models/hf_llama.py (11 s)
def test_named_dims_trace_small_and_bind_large():
    """``configs/models/hf_llama.py`` with ``x:int64[batch=2,seq=40]``: traced at (2, 3), checked at
    (3, 4) against the model, bound at (2, 40): the program traced at (2, 40) but for the names
    the exporter numbers (its size computations add nodes): the same kernels with the same
    params, parameters and outputs."""
    from executor.run import execute
    from ir.importers.torch_export import import_torch_factory

    spec = str(Path(__file__).resolve().parents[2] / "configs" / "models" / "hf_llama.py") + ":make_model"
    full, fv = import_torch_factory(spec, [("x", "int64", [2, 40])])
    named, nv = import_torch_factory(spec, [("x", "int64", [("batch", 2), ("seq", 40)])], run=execute)

    def ops(g):
        return sorted((o.kernel, repr(sorted(o.params.items())), g.tensors[o.output].shape) for o in g.ops.values())

    assert ops(named) == ops(full)
    weights = {n for n in fv if n.startswith("m.")}  # the state_dict's (folded constants are named by node)
    assert len(weights) > 30 and weights <= set(nv)
    ids = np.random.default_rng(0).integers(0, 4096, (2, 40)).astype(np.int32)
    np.testing.assert_allclose(execute(named, {**nv, "x": ids})["output"], execute(full, {**fv, "x": ids})["output"],
                               rtol=1e-6, atol=1e-6)
