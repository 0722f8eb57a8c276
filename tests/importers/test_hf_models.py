"""Hugging Face models as users bring them: tiny random-weight configs of the ``transformers``
architectures imported through ``import_torch`` (skipped without ``transformers``; CI installs
the ``[hf]`` extra).

Each forward equals the model's own logits (or hidden states), and the training step's gradients
equal ``torch.autograd``'s for every parameter (``torch_checks.check_against_torch``). What these
exports need: ``torch.diff`` on the position ids (``ir.importers.torch_symbolics``), the NaN guard
of torch's exported attention (``IsNaN``), BERT's buffered token types (a ``GatherElements``
folded on constants, then a ``Gather`` of constant indices from the token-type table)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch_checks import check_against_torch  # noqa: E402

from executor import verify  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.importers.torch_export import import_torch  # noqa: E402
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


def _models():
    yield "llama-gqa", lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_key_value_heads=2)), \
        {"rmsnorm", "silu", "causal_mask", "embedding"}
    yield "qwen2", lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL, num_key_value_heads=2)), \
        {"rmsnorm", "linear", "causal_mask"}
    yield "gpt2", lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                                          n_positions=32)), {"layernorm", "causal_mask"}
    yield "bert", lambda: T.BertModel(T.BertConfig(**SMALL), add_pooling_layer=False), {"layernorm", "gelu_erf", "embedding"}


@pytest.mark.parametrize("name,make,kernels", list(_models()), ids=[m[0] for m in _models()])
def test_forward_and_gradients_match_torch(name, make, kernels):
    torch.manual_seed(0)
    m = Logits(make().eval())
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    g, _env = check_against_torch(m, ids, kernels)
    assert g.tensors["x"].dtype == "int32"


def test_a_sharded_training_plan_verifies():
    """A Llama training step with AdamW under random sharding rewrites computes what the
    unsharded step does (the executor's verify), on the importer's weights."""
    torch.manual_seed(0)
    m = Logits(T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_key_value_heads=2)).eval())
    g, values = import_torch(m, {"x": torch.randint(0, 96, (2, 8))})
    step = training_step(g, loss="mse", optimizer="adamw")
    rep = verify(random_walk(step, np.random.default_rng(0), 4, 20), values=values)
    assert rep.ok, rep
