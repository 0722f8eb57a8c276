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
(``experts._apply_gate``: ``act(gate) * up``, SiLU in these models), gate-weighted and summed over
the token's copies.

DeepSeek's routers score in float32 (the router's weight is kept so in half-precision models) and
multiply the gates by ``routed_scaling_factor``; their blocks add ``shared_experts``, an ungated
dense MLP, to the routed output. DeepSeek-V3's gates are the sigmoids of the chosen experts'
logits, renormalised over them (``/ (sum + 1e-20)``) with ``norm_topk_prob``; its
``e_score_correction_bias`` and group-limited routing (``n_group``, ``topk_group``) enter only the
choice of experts, which the balanced layout replaces, so the twin reads neither (the gates never
see the bias, as in the block). DeepSeek-V2's are the softmax over all experts at the chosen ones,
never renormalised (its ``topk_method`` only chooses). The gates multiply the experts' outputs in
the experts' dtype.

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

from typing import Any, NamedTuple

from ir.importers.errors import ImportFailure


class MoEKind(NamedTuple):
    """What a sparse MoE block computes around its routed experts (``_BLOCKS``)."""
    scores: str  # "softmax" over all experts' logits, or "sigmoid" of each (DeepSeek-V3)
    renormalise: bool | None  # gates renormalised over the chosen experts; None: the router's norm_topk_prob
    shared: str | None  # "gated": shared_expert times sigmoid(shared_expert_gate); "dense": shared_experts added
    scaled: bool  # DeepSeek's routers: scores in float32, gates times the router's routed_scaling_factor


# block class -> its kind. Each stores its experts as ``MixtralExperts`` does (checked on use).
_BLOCKS: dict[str, MoEKind] = {
    "MixtralSparseMoeBlock": MoEKind("softmax", True, None, False),
    "Qwen2MoeSparseMoeBlock": MoEKind("softmax", None, "gated", False),
    "Qwen3MoeSparseMoeBlock": MoEKind("softmax", None, None, False),
    "OlmoeSparseMoeBlock": MoEKind("softmax", None, None, False),
    "DeepseekV2Moe": MoEKind("softmax", False, "dense", True),
    "DeepseekV3MoE": MoEKind("sigmoid", None, "dense", True),
}


def moe_block_kind(module: Any) -> MoEKind | None:
    """``_BLOCKS``' entry for ``module``'s class, or None when it is no known sparse MoE block."""
    return _BLOCKS.get(type(module).__name__)


def balanced_moe_twin(torch: Any, block: Any) -> Any:
    """The ``_BalancedMoE`` twin of a known sparse MoE ``block`` (``moe_block_kind``), refused
    when its experts store their weights in a layout the twin does not read."""
    kind = _BLOCKS[type(block).__name__]
    experts, router = block.experts, block.gate
    layout = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
              "has_post_expert_norm": False}
    odd = [k for k, want in layout.items() if getattr(experts, k, want) != want]
    if odd or getattr(experts, "gate_up_proj", None) is None or getattr(router, "weight", None) is None:
        raise ImportFailure(f"{type(block).__name__}: its experts' weights are not stored as "
                            f"gate_up_proj[E, 2f, d] (gate then up) and down_proj[E, d, f] without biases "
                            f"({', '.join(odd) or 'attributes missing'}), which the balanced-routing twin reads")
    if kind.renormalise is None:
        kind = kind._replace(renormalise=bool(router.norm_topk_prob))
    return _balanced_moe(torch)(block, kind)


def _balanced_moe(torch: Any) -> type:
    """``_BalancedMoE``: see the module docstring."""

    class _BalancedMoE(torch.nn.Module):
        def __init__(self, block: Any, kind: MoEKind) -> None:
            super().__init__()
            self.gate, self.experts = block.gate, block.experts  # the block's names: the same state_dict keys
            if kind.shared == "gated":
                self.shared_expert, self.shared_expert_gate = block.shared_expert, block.shared_expert_gate
            elif kind.shared == "dense":
                self.shared_experts = block.shared_experts
            self.top_k, self.num_experts = int(block.gate.top_k), int(block.gate.num_experts)
            self.kind = kind
            self.train(block.training)

        def forward(self, x: Any) -> Any:
            b, s, d = x.shape
            k, e, kind = self.top_k, self.num_experts, self.kind
            if (s * k) % e:
                raise ImportFailure(
                    f"{type(self).__name__} routes a mixture of experts evenly (token s's j-th expert is "
                    f"(s*top_k + j) mod experts), so seq * top_k must be a multiple of the experts: seq {s} * "
                    f"top_k {k} = {s * k} over {e} experts; give a sequence length whose seq * top_k is a "
                    f"multiple of {e} (and fixed sizes, x:int64[8,128]: named dims are traced at small sizes)")
            # [b, s, k, d] -> [b, c, E, d] -> [E, b, c, d]: copy (s, j) on expert (s*k + j) mod E
            xe = x.unsqueeze(2).expand(b, s, k, d).reshape(b, -1, e, d).permute(2, 0, 1, 3)
            xr, w = xe, self.gate.weight
            if kind.scaled:  # DeepSeek's routers score in float32 (their weight is kept so in half-precision models)
                xr, w = xe.float(), w.float()
            # the router's logit of each slot's expert, back in token order [b, s, k]
            chosen = torch.einsum("ebcd,ed->ebc", xr, w).permute(1, 2, 0).reshape(b, s, k)
            if kind.scores == "sigmoid":  # (the choice's correction bias and group limit: replaced by the layout)
                gates = torch.sigmoid(chosen)
                if kind.renormalise:
                    gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
            elif kind.renormalise:
                gates = torch.softmax(chosen, dim=-1)
            else:  # the softmax over all experts at the chosen ones: exp(logit - logsumexp(all logits))
                logits = torch.einsum("bsd,ed->bse", x.float() if kind.scaled else x, w)
                lse = (logits - torch.log_softmax(logits, dim=-1))[..., :1]  # (equal over e; exported ops only)
                gates = torch.exp(chosen - lse)
            if kind.scaled:
                gates = gates * self.gate.routed_scaling_factor
            h = self.experts._apply_gate(torch.einsum("ebcd,egd->ebcg", xe, self.experts.gate_up_proj))
            y = torch.einsum("ebcf,edf->ebcd", h, self.experts.down_proj)
            y = y.permute(1, 2, 0, 3).reshape(b, s, k, d)
            out = torch.einsum("bsk,bskd->bsd", gates.to(y.dtype), y)
            if kind.shared == "gated":
                out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            elif kind.shared == "dense":
                out = out + self.shared_experts(x)
            return out

    return _BalancedMoE
