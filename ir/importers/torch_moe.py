"""Hugging Face sparse mixture-of-experts blocks, for ``import_torch``'s export: each is swapped
for ``_BalancedMoE``, a twin with *balanced routing* in ops the importer maps.

A block's own routing is data-dependent (top-k of the router's probabilities, then a loop over
the experts hit, ``nonzero``, ``index_add_``; the grouped path sorts and counts with
``aten::histc``): no ONNX export of it imports, and no affine projection describes it. The twin
routes as ``workloads.llama(experts=E, top_k=k)`` does (``ir.workloads._moe``): token ``s``'s
``j``-th choice is expert ``(s·k + j) mod E``, so every expert gets ``b·s·k / E`` tokens and a
plan prices an even load; the model's learned routing is not reproduced. What the twin computes
with that choice is the block's arithmetic on the block's own weights: the router's logits of
the chosen experts, the block's gates over them (Mixtral: their softmax, which equals the
renormalised top-k of the softmax over all experts; Qwen2-MoE, Qwen3-MoE and OLMoE without
``norm_topk_prob``: the softmax over all experts, taken at the chosen ones; Qwen2-MoE adds its
shared expert, gated by a sigmoid), and each expert's gated MLP on its tokens
(``experts._apply_gate``: ``act(gate) * up``, SiLU in these models), gate-weighted and summed over the token's copies.

Shapes (``b, s, d``: batch, sequence, model width; ``c = s·k / E``): ``x[b, s, d]`` -> copies
``[b, s, k, d]`` -> ``[b, c, E, d]`` (row-major, copy ``(s, j)`` lands on expert ``(s·k + j) mod
E``) -> dispatched ``[E, b, c, d]`` -> the experts' GEMMs on the stacked weights as the block
stores them (``gate_up_proj[E, 2f, d]``: ``ebcd,egd->ebcg``, then split in gate and up;
``down_proj[E, d, f]``: ``ebcf,edf->ebcd``) -> back to ``[b, s, k, d]`` -> gate-weighted sum over
``k``. The weights are the block's Parameters, held under the block's attribute names, so the
program's parameters keep the model's ``state_dict`` names and train as the model's do; the
experts' GEMMs have the experts' dim first in weight and activation, which the expert-parallel
layout (``ir.rewrites.layout``'s ``e`` use) splits.

``seq·k`` must be a multiple of ``E`` (every expert as many tokens per sequence): otherwise the
twin refuses, naming the fix.
"""

from __future__ import annotations

from typing import Any

from ir.importers.errors import ImportFailure

# block class -> (gates renormalised over the chosen experts, shared expert gated by a sigmoid).
# None: the router's ``norm_topk_prob`` (its config's) says. Each block here routes by the softmax
# over all experts' logits, top-k, and stores its experts as ``MixtralExperts`` does.
_BLOCKS: dict[str, tuple[bool | None, bool]] = {
    "MixtralSparseMoeBlock": (True, False),
    "Qwen2MoeSparseMoeBlock": (None, True),
    "Qwen3MoeSparseMoeBlock": (None, False),
    "OlmoeSparseMoeBlock": (None, False),
}


def moe_block_kind(module: Any) -> tuple[bool | None, bool] | None:
    """``_BLOCKS``' entry for ``module``'s class, or None when it is no known sparse MoE block."""
    return _BLOCKS.get(type(module).__name__)


def balanced_moe_twin(torch: Any, block: Any) -> Any:
    """The ``_BalancedMoE`` twin of a known sparse MoE ``block`` (``moe_block_kind``), refused
    when its experts store their weights in a layout the twin does not read."""
    renormalise, shared = _BLOCKS[type(block).__name__]
    experts, router = block.experts, block.gate
    layout = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
              "has_post_expert_norm": False}
    odd = [k for k, want in layout.items() if getattr(experts, k, want) != want]
    if odd or getattr(experts, "gate_up_proj", None) is None or getattr(router, "weight", None) is None:
        raise ImportFailure(f"{type(block).__name__}: its experts' weights are not stored as "
                            f"gate_up_proj[E, 2f, d] (gate then up) and down_proj[E, d, f] without biases "
                            f"({', '.join(odd) or 'attributes missing'}), which the balanced-routing twin reads")
    if renormalise is None:
        renormalise = bool(router.norm_topk_prob)
    return _balanced_moe(torch)(block, renormalise, shared)


def _balanced_moe(torch: Any) -> type:
    """``_BalancedMoE``: see the module docstring."""

    class _BalancedMoE(torch.nn.Module):
        def __init__(self, block: Any, renormalise: bool, shared: bool) -> None:
            super().__init__()
            self.gate, self.experts = block.gate, block.experts  # the block's names: the same state_dict keys
            if shared:
                self.shared_expert, self.shared_expert_gate = block.shared_expert, block.shared_expert_gate
            self.top_k, self.num_experts = int(block.gate.top_k), int(block.gate.num_experts)
            self.renormalise, self.shared = renormalise, shared
            self.train(block.training)

        def forward(self, x: Any) -> Any:
            b, s, d = x.shape
            k, e = self.top_k, self.num_experts
            if (s * k) % e:
                raise ImportFailure(
                    f"{type(self).__name__} routes a mixture of experts evenly (token s's j-th expert is "
                    f"(s*top_k + j) mod experts), so seq * top_k must be a multiple of the experts: seq {s} * "
                    f"top_k {k} = {s * k} over {e} experts; give a sequence length whose seq * top_k is a "
                    f"multiple of {e} (and fixed sizes, x:int64[8,128]: named dims are traced at small sizes)")
            # [b, s, k, d] -> [b, c, E, d] -> [E, b, c, d]: copy (s, j) on expert (s*k + j) mod E
            xe = x.unsqueeze(2).expand(b, s, k, d).reshape(b, -1, e, d).permute(2, 0, 1, 3)
            # the router's logit of each slot's expert, back in token order [b, s, k]
            chosen = torch.einsum("ebcd,ed->ebc", xe, self.gate.weight).permute(1, 2, 0).reshape(b, s, k)
            if self.renormalise:
                gates = torch.softmax(chosen, dim=-1)
            else:  # the softmax over all experts at the chosen ones: exp(logit - logsumexp(all logits))
                logits = torch.einsum("bsd,ed->bse", x, self.gate.weight)
                lse = (logits - torch.log_softmax(logits, dim=-1))[..., :1]  # (equal over e; exported ops only)
                gates = torch.exp(chosen - lse)
            h = self.experts._apply_gate(torch.einsum("ebcd,egd->ebcg", xe, self.experts.gate_up_proj))
            y = torch.einsum("ebcf,edf->ebcd", h, self.experts.down_proj)
            y = y.permute(1, 2, 0, 3).reshape(b, s, k, d)
            out = torch.einsum("bsk,bskd->bsd", gates, y)
            if self.shared:
                out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            return out

    return _BalancedMoE
