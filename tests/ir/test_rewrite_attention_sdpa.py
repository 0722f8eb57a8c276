"""fuse_attention on PyTorch's ``scaled_dot_product_attention`` as the ONNX exporter writes it.

torch scales q and kᵀ each by √scale (``scale`` ops on both operands of the scores ``bmm``), writes
kᵀ as one permute of ``reshape(k_proj)`` ([0, 2, 3, 1]) or of a materialised k ([0, 1, 3, 2], after
rotary embeddings), and with a boolean mask guards the softmax with ``Where(IsNaN(p), 0, p)``. The
tests import small torch modules, fuse every site and check the fused program against the torch
module itself and the unfused program, forward and in a training step, and that ``unfuse_attention``
restores every absorbed op exactly.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from executor import verify
from executor.run import execute
from ir.autodiff import training_step
from ir.graph import Graph
from ir.rewrites import RewriteError, fuse_attention, match_attention, random_walk, unfuse_attention
from ir.rewrites.substitute_attention import attention_sites, fused_attentions

torch = pytest.importorskip("torch")

D, HEADS, SEQ = 16, 2, 5


class SdpaBlock(torch.nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention``, with a residual."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask  # "causal" (is_causal=True), "none", or "bool" (a lower-triangular boolean attn_mask)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.o = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, HEADS, d // HEADS).transpose(1, 2) for t in (q, k, v))
        if self.mask == "bool":
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=torch.ones(s, s, dtype=torch.bool).tril())
        else:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.mask == "causal")
        return self.o(y.transpose(1, 2).reshape(b, s, d)) + x


class Stack(torch.nn.Module):
    def __init__(self, mask: str, layers: int = 2) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([SdpaBlock(mask) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x


def imported(mask: str, layers: int = 2) -> tuple[Graph, dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
    """(graph, parameter values, feed, torch's own output) of a ``Stack``."""
    from ir.importers.torch_export import import_torch

    torch.manual_seed(0)
    m = Stack(mask, layers).eval()
    x = torch.randn(2, SEQ, D)
    g, values = import_torch(m, {"x": x})
    with torch.no_grad():
        ref = m(x).numpy()
    return g, values, {"x": x.numpy()}, ref


def fuse_all(g: Graph) -> Graph:
    h = g
    for site in attention_sites(g):
        h = fuse_attention(h, site)
    return h


def unfuse_all(h: Graph) -> Graph:
    for n in fused_attentions(h):
        h = unfuse_attention(h, n)
    return h


def assert_same_ops(back: Graph, g: Graph) -> None:
    """Op by op: the same names, kernels, params, inputs and outputs, and the same tensors."""
    assert set(back.ops) == set(g.ops)
    for n, o in g.ops.items():
        r = back.ops[n]
        assert (r.kernel, r.params, r.inputs, r.output) == (o.kernel, o.params, o.inputs, o.output), n
    assert set(back.tensors) == set(g.tensors)
    assert all(back.tensors[n] == t for n, t in g.tensors.items())
    assert back.digest == g.digest


def output_name(g: Graph) -> str:
    (out,) = [n for n, t in g.tensors.items() if t.role == "output"]
    return out


@pytest.mark.parametrize("mask", ["causal", "none", "bool"])
def test_sdpa_forward_fuses_at_every_layer(mask):
    g, values, feed, ref = imported(mask)
    sites = attention_sites(g)
    assert len(sites) == 2  # one per layer
    for site in sites:
        m = match_attention(g, site)
        assert not isinstance(m, str), m
        roles = [r for r, _ in m.ops]
        assert roles.count("q_scale") == 1 and roles.count("k_scale") == 1 and "k_t" in roles
        assert (("nan_test" in roles) and ("nan_guard" in roles)) == (mask == "bool")
        assert m.causal == (mask != "none") and m.offset == 0
        # torch's two √scale factors are float32 constants: their product is 1/√e to float32 rounding
        assert m.scale == pytest.approx(1 / math.sqrt(D // HEADS), rel=1e-6)
    h = fuse_all(g)
    att = [o for o in h.ops.values() if o.kernel == "attention"]
    assert len(att) == 2
    for o in att:
        assert o.params["scale"] == pytest.approx(1 / math.sqrt(D // HEADS), rel=1e-6)
    # no scores-shaped tensor is left, and no scale, compare or masked_fill
    assert not [n for n, t in h.tensors.items() if t.shape == (2, HEADS, SEQ, SEQ)]
    assert not [o for o in h.ops.values() if o.kernel in ("scale", "softmax", "compare", "masked_fill", "bmm")]
    out = output_name(g)
    got = execute(h, {**feed, **values})[out]
    want = execute(g, {**feed, **values})[out]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)  # torch itself: an independent reference
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    rep = verify(h, reference=g, values=values)
    assert rep.ok, str(rep)
    rep = verify(random_walk(h, np.random.default_rng(0), 4, 15), reference=g, values=values)
    assert rep.ok, str(rep)
    assert_same_ops(unfuse_all(h), g)


@pytest.mark.parametrize("mask", ["causal", "none", "bool"])
def test_sdpa_training_step_fuses_the_backward_too(mask):
    g, values, _, _ = imported(mask)
    step = training_step(g, loss="mse", optimizer="adamw")
    sites = attention_sites(step)
    assert len(sites) == 2
    h = step
    for site in sites:
        m = match_attention(h, site)
        assert not isinstance(m, str), m
        roles = dict(m.ops)
        # the gradients of q and k leave through the VJPs of the outermost absorbed ops
        assert dict(m.grads)["q"] == f"{roles['q_scale']}.dx" and dict(m.grads)["k"] == f"{roles['k_t']}.dx"
        h = fuse_attention(h, site)
    kernels = sorted(o.kernel for o in h.ops.values() if o.kernel.startswith("attention"))
    assert kernels == sorted(["attention", "attention_grad_k", "attention_grad_q", "attention_grad_v",
                              "attention_lse"] * 2)
    assert not [n for n, t in h.tensors.items() if t.shape == (2, HEADS, SEQ, SEQ)]
    rep = verify(h, reference=step, values=values)
    assert rep.ok, str(rep)
    assert_same_ops(unfuse_all(h), step)


def with_mask_offset(g: Graph, offset: int) -> Graph:
    (mask,) = [o for o in g.ops.values() if o.kernel == "causal_mask"]
    return g.with_ops({mask.name: dataclasses.replace(mask, params={**mask.params, "offset": offset})})


def test_guard_over_fully_masked_rows_is_refused():
    """With offset -1 the first query row sees no key: its softmax is NaN, which the guard makes 0
    and the fused attention would not; without the guard the pattern still fuses."""
    g, _, _, _ = imported("bool", layers=1)
    (site,) = attention_sites(g)
    bad = with_mask_offset(g, -1)
    why = match_attention(bad, site)
    assert isinstance(why, str) and "NaN guard" in why and "offset -1" in why
    assert attention_sites(bad) == []
    with pytest.raises(RewriteError, match="NaN guard"):
        fuse_attention(bad, site)
    assert not isinstance(match_attention(with_mask_offset(g, 1), site), str)  # offset >= 0: no empty row
    g2, _, _, _ = imported("causal", layers=1)  # no guard: fuses at offset -1 (the -inf rows are the program's)
    (site2,) = attention_sites(g2)
    m = match_attention(with_mask_offset(g2, -1), site2)
    assert not isinstance(m, str) and m.offset == -1


def test_guard_read_elsewhere_is_refused():
    """The NaN test must feed the guard alone: a second reader keeps the pattern unfused."""
    g, _, _, _ = imported("bool", layers=1)
    (site,) = attention_sites(g)
    (cmp_,) = [o for o in g.ops.values() if o.kernel == "compare"]
    from ir.graph import Op, Shards, Tensor

    shape = g.tensors[cmp_.output].shape
    peek = Op("peek", "masked_fill", (("x", cmp_.input_map["a"]), ("c", cmp_.output)), "peek.out",
              {"value": 1.0, "fill_where": "nonzero"}, Shards.whole(shape, 0))
    bad = g.with_ops({}, insert_after={cmp_.name: [peek]},
                     tensors={"peek.out": Tensor("peek.out", shape, g.tensors[cmp_.output].dtype, "output")})
    why = match_attention(bad, site)
    assert isinstance(why, str) and "not by one op" in why


def test_tiny_llama_grouped_query_heads():
    """Hugging Face Llama: rotary q and k, kᵀ a [0, 1, 3, 2] permute of k, the NaN guard, and k and v
    of grouped-query heads expanded to all heads (expand + reshape, outside the pattern: the
    attention reads the expanded k and v, so it is matched as multi-head attention)."""
    transformers = pytest.importorskip("transformers")
    from ir.importers.torch_export import import_torch

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
            self.model = transformers.LlamaForCausalLM(cfg)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x, use_cache=False).logits

    torch.manual_seed(0)
    m = Logits().eval()
    x = torch.randint(0, 128, (1, 8))
    g, values = import_torch(m, {"x": x})
    sites = attention_sites(g)
    assert len(sites) == 2
    for site in sites:
        mt = match_attention(g, site)
        roles = [r for r, _ in mt.ops]
        assert {"q_scale", "k_t", "k_scale", "mask", "nan_test", "nan_guard"} <= set(roles)
        assert mt.k_perm is None and g.tensors[mt.k].shape == (1, 4, 8, 16)
        assert mt.scale == pytest.approx(1 / math.sqrt(16), abs=1e-12)  # √0.25 = 0.5 is exact in float32
    h = fuse_all(g)
    out = output_name(g)
    with torch.no_grad():
        ref = m(x).numpy()
    got = execute(h, {"x": x.numpy(), **values})[out]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    assert_same_ops(unfuse_all(h), g)
