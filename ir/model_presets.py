"""Published model shapes for the ``gpt``, ``llama`` and ``deepseek`` workloads (``preset=`` in ``build``).

Sources, per row: GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners", Table 2; vocabulary 50257 and context 1024 from the released ``gpt2*`` configs);
GPT-3 (Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1: n_layers,
d_model, n_heads, d_head; context 2048); Llama 2 (Touvron et al. 2023, "Llama 2: Open Foundation
and Fine-Tuned Chat Models", Table 1 and the released ``config.json`` files: hidden size,
intermediate size, heads, key/value heads (GQA for 70B), vocabulary 32000, context 4096);
Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, Table 3, and the released configs:
vocabulary 128256, context 8192, GQA with 8 key/value heads); Mixtral 8x7B (Jiang et al. 2024,
"Mixtral of Experts", Table 1, and the released ``config.json``: 8 experts, 2 per token,
context 32768); DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §4.2 "Model
Hyper-Parameters", and the released ``config.json``: 61 layers, hidden 7168, 128 heads, MLA with
q_lora_rank 1536, kv_lora_rank 512, per-head nope/rope key dims 128/64 and value dim 128; dense
intermediate size 18432 in the first 3 layers; 1 shared and 256 routed experts of intermediate
size 2048, 8 routed per token, routed_scaling_factor 2.5; vocabulary 129280; pre-training context
4096, §4.3 extends it to 128K). DeepSeek-V2-Lite is not a preset: it has softmax gates over all
experts, not renormalised, which ``workloads.deepseek`` does not build.

``seq`` defaults to the model's context length and ``batch`` to 1; campaigns set both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelPreset:
    family: str
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    seq: int
    experts: int | None = None  # a mixture of this many experts per MLP (llama only)
    top_k: int = 2  # experts per token

    def sizes(self) -> dict[str, int]:
        moe = {"experts": self.experts, "top_k": self.top_k} if self.experts else {}
        return {"layers": self.layers, "d_model": self.d_model, "heads": self.heads, "kv_heads": self.kv_heads,
                "d_ff": self.d_ff, "vocab": self.vocab, "seq": self.seq, "batch": 1, **moe}


@dataclass(frozen=True)
class DeepSeekPreset:
    """A ``workloads.deepseek`` model's shapes (its parameters, named as there)."""
    layers: int
    d_model: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    d_ff: int
    moe_d_ff: int
    experts: int
    top_k: int
    shared_experts: int
    first_k_dense: int
    routed_scaling_factor: float
    vocab: int
    seq: int
    family: str = "deepseek"

    def sizes(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "family"}, "batch": 1}


PRESETS: dict[str, ModelPreset | DeepSeekPreset] = {
    "gpt2-small": ModelPreset("gpt", 12, 768, 12, 12, 3072, 50257, 1024),
    "gpt2-medium": ModelPreset("gpt", 24, 1024, 16, 16, 4096, 50257, 1024),
    "gpt2-large": ModelPreset("gpt", 36, 1280, 20, 20, 5120, 50257, 1024),
    "gpt2-xl": ModelPreset("gpt", 48, 1600, 25, 25, 6400, 50257, 1024),
    "gpt3-6.7b": ModelPreset("gpt", 32, 4096, 32, 32, 16384, 50257, 2048),
    "gpt3-175b": ModelPreset("gpt", 96, 12288, 96, 96, 49152, 50257, 2048),
    "llama2-7b": ModelPreset("llama", 32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": ModelPreset("llama", 40, 5120, 40, 40, 13824, 32000, 4096),
    "llama2-70b": ModelPreset("llama", 80, 8192, 64, 8, 28672, 32000, 4096),
    "llama3-8b": ModelPreset("llama", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": ModelPreset("llama", 80, 8192, 64, 8, 28672, 128256, 8192),
    "mixtral-8x7b": ModelPreset("llama", 32, 4096, 32, 8, 14336, 32000, 32768, experts=8, top_k=2),
    "deepseek-v3": DeepSeekPreset(layers=61, d_model=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512,
                                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, d_ff=18432,
                                  moe_d_ff=2048, experts=256, top_k=8, shared_experts=1, first_k_dense=3,
                                  routed_scaling_factor=2.5, vocab=129280, seq=4096),
}
