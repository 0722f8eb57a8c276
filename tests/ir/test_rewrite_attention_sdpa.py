"""fuse_attention on PyTorch's ``scaled_dot_product_attention`` as the ONNX exporter writes it.

torch scales q and kᵀ each by √scale (``scale`` ops on both operands of the scores ``bmm``), writes
kᵀ as one permute of ``reshape(k_proj)`` ([0, 2, 3, 1]) or of a materialised k ([0, 1, 3, 2], after
rotary embeddings), and with a boolean mask guards the softmax with ``Where(IsNaN(p), 0, p)``. The
tests import small torch modules, fuse every site and check the fused program against the torch
module itself and the unfused program, forward and in a training step, and that ``unfuse_attention``
restores every absorbed op exactly. Multi-query attention (Falcon's single k and v head) is built by
hand as the exporter writes it: kᵀ of k ``[b, 1, t, e]`` scaled and squeezed to ``[b, e, t]``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from executor import verify
from executor.run import execute
from ir.autodiff import training_step
from ir.builder import GraphBuilder
from ir.graph import Graph
from ir.rewrites import (RewriteError, fuse_attention, match_attention, place, random_walk, split, split_reduction,
                         unfuse_attention, unshard)
from ir.rewrites.substitute_attention import attention_sites, fused_attentions
from tests.ir.test_attention_bias import check_fused

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


def multi_query(b: int = 2, h: int = 3, s: int = 6, e: int = 4, k_perm: tuple[int, ...] = (0, 1, 3, 2),
                parts: int = 1) -> Graph:
    """Multi-query attention as torch exports Falcon's: ``q[b, h, s, e]`` scaled by √scale; kᵀ
    ``[b, parts, e, s / parts] = permute(k, k_perm)`` scaled by √scale and reshaped to ``[b, e, s]``
    (a squeeze when ``parts`` is 1); v ``[b, s, 1, e]`` permuted and squeezed to ``[b, s, e]``; both
    einsums ``abmk,akn->abmn``; a residual add so the attention output is an intermediate."""
    gb = GraphBuilder()
    kt = (b, parts, e, s // parts)
    src = [0] * 4
    for i, x in enumerate(k_perm):
        src[x] = kt[i]
    q, k, v = gb.parameter("q", (b, h, s, e)), gb.parameter("k", src), gb.parameter("v", (b, s, 1, e))
    root = e ** -0.25
    k2 = gb.scale(gb.permute(k, name="k_t", perm=list(k_perm)), name="k_scale", alpha=root)
    k3 = gb.reshape(k2, name="qk.b_squeeze", shape=[b, e, s], **{"from": list(kt)})
    scores = gb.einsum(gb.scale(q, name="q_scale", alpha=root), k3, name="qk", equation="abmk,akn->abmn")
    probs = gb.softmax(gb.causal_mask(scores, name="mask"), name="softmax")
    v3 = gb.reshape(gb.permute(v, name="v_t", perm=[0, 2, 1, 3]), name="av.b_squeeze", shape=[b, s, e],
                    **{"from": [b, 1, s, e]})
    gb.add(gb.einsum(probs, v3, name="av", equation="abmk,akn->abmn"), q, name="resid")
    return gb.build()


MQA = "qk+av"


def test_multi_query_keeps_one_squeeze_of_k():
    """k ``[b, 1, t, e]`` → permute → scale → squeeze → scores: the permute, scale and squeeze are
    absorbed, the fused graph keeps one squeeze of k to ``[b, t, e]``; v's squeeze stays outside."""
    g = multi_query()
    m = match_attention(g, "qk")
    assert not isinstance(m, str), m
    assert [r for r, _ in m.ops][:5] == ["q_scale", "k_t", "k_scale", "k_squeeze", "qk"]
    assert (m.q, m.k, m.v) == ("q", "k", "av.b_squeeze.out")
    assert m.k_relayout == ("reshape", (2, 6, 4)) and m.k_perm is None
    assert m.scale == pytest.approx(0.5) and m.causal
    h = fuse_attention(g, "qk")
    assert dict(h.ops[MQA].inputs)["k"] == f"{MQA}.k.out"
    kept = h.ops[f"{MQA}.k"]
    assert (kept.kernel, kept.inputs, kept.params) == ("reshape", (("x", "k"),), {"shape": [2, 6, 4],
                                                                                  "from": [2, 1, 6, 4]})
    assert h.ops[MQA].params["origin"]["k_shape"] == [2, 6, 4]
    assert not {"k_t", "k_scale", "qk.b_squeeze", "q_scale", "softmax"} & set(h.ops)
    assert "av.b_squeeze" in h.ops and "v_t" in h.ops
    check_fused(h, g, g, MQA)
    # sharded over heads and query rows, the key reduction split and spread: it computes the same
    p = place(split_reduction(split(split(h, MQA, "h", 3), MQA, "s", 2), MQA, 2), MQA, [0, 1, 2, 3])
    rep = verify(p, reference=g)
    assert rep.ok, str(rep)
    assert unshard(p).digest == g.digest


def test_multi_query_training_step_reshapes_dk_back():
    """In a training step the gradient of k leaves through the permute's VJP: attention_grad_k writes
    dk ``[b, t, e]`` and the inverse of the kept squeeze (``.dk_t``) brings it back to ``[b, 1, t, e]``."""
    step = training_step(multi_query(), loss="mse", optimizer="sgd")
    m = match_attention(step, "qk")
    assert not isinstance(m, str), m
    assert dict(m.grads) == {"q": "q_scale.dx", "k": "k_t.dx", "v": "av.db"}
    h = fuse_attention(step, "qk")
    dk_t = h.ops[f"{MQA}.dk_t"]
    assert (dk_t.kernel, dk_t.inputs, dk_t.output) == ("reshape", (("x", f"{MQA}.dk.out"),), step.ops["k_t.dx"].output)
    assert dk_t.params == {"shape": [2, 1, 6, 4], "from": [2, 6, 4]}
    relayouts = {n for n, o in h.ops.items() if o.kernel in ("permute", "reshape", "scale", "softmax", "softmax_grad")}
    assert relayouts == {f"{MQA}.k", f"{MQA}.dk_t", "v_t", "v_t.dx", "av.b_squeeze", "av.b_squeeze.dx"}
    check_fused(h, step, step, MQA)


def test_multi_query_refusals_name_the_reason():
    """A reshape that is not a pure squeeze, a squeezed kᵀ read by another op, and a k that only a
    permute and a squeeze together bring to ``[b, t, e]`` keep the pattern unfused."""
    why = match_attention(multi_query(parts=2), "qk")  # [b, 2, e, t/2] -> [b, e, t]: not a squeeze
    assert isinstance(why, str) and "permute or squeeze" in why and "akn" in why
    gb = GraphBuilder.from_graph(multi_query())
    gb.reduce_sum("qk.b_squeeze.out", name="peek", dim=-1)
    why = match_attention(gb.build(), "qk")
    assert isinstance(why, str) and "cannot absorb the reshape qk.b_squeeze" in why and "peek" in why
    bad = multi_query(k_perm=(0, 2, 1, 3))  # k [b, e, 1, t]: [b, t, e] is a permute and a squeeze away
    why = match_attention(bad, "qk")
    assert isinstance(why, str) and "no single permute or squeeze" in why
    assert attention_sites(bad) == []
    with pytest.raises(RewriteError, match="no single permute or squeeze"):
        fuse_attention(bad, "qk")
