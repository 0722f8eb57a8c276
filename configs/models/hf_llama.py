"""A Hugging Face Llama for ``tapestry import`` (needs ``pip install 'tapestry[hf]'``): a small
configuration of ``transformers.LlamaForCausalLM`` with random weights (grouped-query attention,
RoPE, SwiGLU, RMSNorm), returning the logits. Any ``transformers`` causal LM imports the same
way: build it (``from_pretrained`` or from a config) and return it wrapped in ``Logits``.

    tapestry import configs/models/hf_llama.py:make_model --example-input "x:int64[batch=8,seq=128]" \\
        --train cross_entropy -o out/hf_llama.json
"""

import torch
import transformers


class Logits(torch.nn.Module):
    """``model(ids).logits`` without a KV cache (a training step's forward)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(ids, use_cache=False).logits


def make_model(layers: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    return Logits(transformers.LlamaForCausalLM(cfg).eval())
