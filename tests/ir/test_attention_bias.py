"""Attention with an additive bias on the scores (T5's relative positions, ALiBi, padding masks).

The kernel: blocks against a NumPy softmax with the bias added, with causal masks and every
supported broadcast of the bias; plans split over keys, rows and heads verified against the
unsplit program; gradients (the bias's included) against central finite differences; refusals.
The substitution: hand-built graphs ``einsum → [scale] → add(bias) → [causal_mask] → softmax →
einsum`` fuse into one attention op reading the bias, forward and in a training step, verify
equal to the unfused program, unfuse exactly, and random sharded plans of the fused step verify.
"""

from __future__ import annotations

import numpy as np
import pytest

from executor import verify
from ir.builder import GraphBuilder
from ir.autodiff import training_step
from ir.graph import Graph
from ir.kernels import SignatureError, TensorSpec, get_kernel
from ir.rewrites import (RewriteError, fuse_attention, match_attention, place, random_walk, split, split_reduction,
                         unfuse_attention)
from ir.validate import validate
from ir.zspace import ZRange
from tests.autodiff.test_vjp_finite_differences import fd_check, one_op
from tests.ir.kernel_cases_attention import BIASES, attention_ref
from tests.ir.test_attention_grad import run


def spec(shape, dtype="float32"):
    return TensorSpec(tuple(shape), dtype)


def run_box(ins, params, box=None):
    """The attention kernel's output block for ``box`` (default: the whole index space)."""
    return run("attention", ins, params, box)


# -- the kernel ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bid,q,k,v,b", BIASES, ids=[x[0] for x in BIASES])
@pytest.mark.parametrize("causal,offset", [(False, 0), (True, 0), (True, 2)])
def test_forward_equals_softmax_with_the_bias(bid, q, k, v, b, causal, offset):
    rng = np.random.default_rng(0)
    ins = {p: rng.standard_normal(s) for p, s in zip("qkv", (q, k, v))} | {"bias": 3 * rng.standard_normal(b)}
    params = {"scale": 0.4, "causal": causal, "offset": offset}
    ref = attention_ref(ins["q"], ins["k"], ins["v"], 0.4, causal, offset, ins["bias"])
    y, sig = run_box(ins, params)
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)
    # the bias matters: without it the output differs
    plain, _ = run_box({p: ins[p] for p in "qkv"}, params)
    assert not np.allclose(plain, ref)
    # one add per score beside the bias-free count; the bias is read once per point's rows and keys
    base = get_kernel("attention").signature({p: spec(s) for p, s in zip("qkv", (q, k, v))}, params)
    seen = sig.flops_per_point - base.flops_per_point
    assert seen == pytest.approx(base.flops_per_point / (2 * q[-1] + 2 * v[-1] + 5))
    assert sig.reductions[0].spans[-1] == ("bias", len(b) - 1)


def test_bias_tile_is_read_once_per_shard():
    """Bytes: the projected bias box of a shard is its rows × all keys of its heads (or the broadcast cells)."""
    q, k, v, b = (2, 3, 5, 4), (2, 3, 6, 4), (2, 3, 6, 3), (1, 3, 5, 6)
    sig = get_kernel("attention").signature({"q": spec(q), "k": spec(k), "v": spec(v), "bias": spec(b)}, {})
    box = ZRange((1, 0, 2), (2, 2, 5))  # one batch, two heads, three query rows
    assert sig.inputs["bias"].apply(box) == ZRange((0, 0, 2, 0), (1, 2, 5, 6))
    none = get_kernel("attention").signature({"q": spec(q), "k": spec(k), "v": spec(v)}, {})
    lo, hi = np.array([box.start]), np.array([box.end])
    assert sig.io_bytes(lo, hi)[0][0] - none.io_bytes(lo, hi)[0][0] == 2 * 3 * 6 * 4


def biased_program(bias_shape, causal=True, offset=0, b=2, h=2, s=8, e=4):
    g = GraphBuilder()
    q, k, v = (g.input(n, (b, h, s, e)) for n in "qkv")
    bias = g.input("bias", bias_shape)
    g.attention(q, k, v, bias=bias, name="attn", scale=0.5, causal=causal, offset=offset)
    return g.build()


@pytest.mark.parametrize("bias_shape", [(1, 2, 8, 8), (2, 2, 8, 8), (2, 1, 8), (2, 1, 1, 8)])
@pytest.mark.parametrize("parts,rows,heads", [(2, 1, 1), (4, 2, 2), (1, 4, 2), (2, 2, 1)])
def test_split_over_keys_rows_and_heads_verifies(bias_shape, parts, rows, heads):
    g = biased_program(bias_shape)
    h = split(g, "attn", "s", rows) if rows > 1 else g
    if parts > 1:
        h = split_reduction(h, "attn", parts)
        h = split(h, "attn", "kb", 2)  # with 4 parts, a shard runs two key blocks
        h = place(h, "attn", [2, 0, 3, 1])
    if heads > 1:
        h = split(h, "attn", "h", heads)
    assert validate(h) == []
    rep = verify(h, reference=g)
    assert rep.ok, str(rep)


def test_verify_can_fail_on_a_biased_attention():
    """Another mask beside the same bias is caught: verify compares values, the checks have teeth."""
    g = biased_program((1, 2, 8, 8))
    wrong = biased_program((1, 2, 8, 8), offset=1)
    assert not verify(wrong, reference=g).ok


FD = {
    "t5": ({"q": (1, 2, 3, 2), "k": (1, 2, 4, 2), "v": (1, 2, 4, 2), "bias": (1, 2, 3, 4)}, True),
    "alibi": ({"q": (2, 3, 2), "k": (2, 4, 2), "v": (2, 4, 2), "bias": (2, 1, 4)}, True),
    "gqa": ({"q": (1, 2, 2, 3, 2), "k": (1, 2, 4, 2), "v": (1, 2, 4, 3), "bias": (2, 1, 3, 4)}, False),
}


@pytest.mark.parametrize("case", sorted(FD))
def test_gradients_match_finite_differences(case):
    shapes, causal = FD[case]
    assert fd_check(one_op("attention", shapes, scale=0.7, causal=causal, offset=1)) > 0


@pytest.mark.parametrize("bias,msg", [
    ((2, 3, 5, 1), "constant over the keys"),
    ((2, 3, 4, 6), "must broadcast onto the scores"),
    ((1, 2, 3, 5, 6), "must broadcast onto the scores"),
    ((2, 3, 5, 7), "must broadcast onto the scores"),
])
def test_unsupported_biases_are_refused_with_the_reason(bias, msg):
    ins = {"q": spec((2, 3, 5, 4)), "k": spec((2, 3, 6, 4)), "v": spec((2, 3, 6, 3)), "bias": spec(bias)}
    for kernel in ("attention", "attention_lse", "attention_grad_k"):
        with pytest.raises(SignatureError, match=msg):
            get_kernel(kernel).signature({p: ins[p] for p in ("q", "k", "v", "bias")
                                          if p in get_kernel(kernel).inputs}
                                         | ({"o": spec((2, 3, 5, 3)), "dy": spec((2, 3, 5, 3)),
                                             "lse": spec((2, 3, 5))} if kernel == "attention_grad_k" else {}), {})
    with pytest.raises(SignatureError, match="takes inputs"):  # the bias gradient needs the bias
        get_kernel("attention_grad_bias").signature({p: ins[p] for p in "qkv"}, {})


# -- the substitution ------------------------------------------------------------------------------

B, HEADS, S, E = 2, 2, 6, 4


def biased(bias_shape=(1, HEADS, S, S), order=("scale", "bias", "mask"), trainable=True, bias_first=False) -> Graph:
    """``einsum(q, k) → order of scale / add(bias) / causal_mask → softmax → einsum(·, v)``, a residual add
    after it; the bias a parameter (``trainable``) or an input (a mask)."""
    gb = GraphBuilder()
    q, k, v = (gb.parameter(n, (B, HEADS, S, E)) for n in "qkv")
    bias = (gb.parameter if trainable else gb.input)("pos_bias", bias_shape)
    x = gb.einsum(q, k, name="qk", equation="bhse,bhte->bhst")
    for step in order:
        if step == "scale":
            x = gb.scale(x, name="scale", alpha=E ** -0.5)
        elif step == "bias":
            x = gb.add(bias, x, name="bias_add") if bias_first else gb.add(x, bias, name="bias_add")
        else:
            x = gb.causal_mask(x, name="mask")
    gb.add(gb.einsum(gb.softmax(x, name="softmax"), v, name="av", equation="bhst,bhte->bhse"), q, name="resid")
    return gb.build()


SITE = "qk+av"
FORMS = {
    "t5": dict(bias_shape=(1, HEADS, S, S), order=("bias",)),
    "t5-causal": dict(bias_shape=(1, HEADS, S, S), order=("bias", "mask")),
    "full": dict(bias_shape=(B, HEADS, S, S), order=("scale", "mask", "bias"), bias_first=True),
    "alibi": dict(bias_shape=(HEADS, 1, S), order=("scale", "bias", "mask")),
    "padding-mask": dict(bias_shape=(B, 1, 1, S), order=("scale", "bias"), trainable=False),
}


def assert_same_ops(back: Graph, g: Graph) -> None:
    # imported here: that module skips itself without torch, which the rest of this file does not need
    from tests.ir.test_rewrite_attention_sdpa import assert_same_ops as same

    same(back, g)


def check_fused(h: Graph, ref: Graph, original: Graph, site: str = SITE) -> None:
    """``h`` computes what ``ref`` does, unfuses at ``site`` to ``original`` exactly, and random
    sharded plans verify."""
    rep = verify(h, reference=ref)
    assert rep.ok, str(rep)
    assert_same_ops(unfuse_attention(h, site), original)
    for seed in range(3):
        rep = verify(random_walk(h, np.random.default_rng(seed), 4, 15), reference=ref)
        assert rep.ok, str(rep)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_biased_forward_fuses_verifies_and_unfuses(form):
    g = biased(**FORMS[form])
    m = match_attention(g, "qk")
    assert not isinstance(m, str), m
    assert ("bias", "bias_add") in m.ops and m.bias == "pos_bias"
    assert m.causal == ("mask" in FORMS[form]["order"])
    h = fuse_attention(g, "qk")
    assert dict(h.ops[SITE].inputs)["bias"] == "pos_bias"
    assert not {"bias_add", "softmax", "qk"} & set(h.ops)
    check_fused(h, g, g)
    p = place(split_reduction(split(split(h, SITE, "h", 2), SITE, "s", 2), SITE, 2), SITE, [0, 1, 2, 3])
    rep = verify(p, reference=g)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_biased_training_step_fuses_verifies_and_unfuses(form):
    step = training_step(biased(**FORMS[form]), loss="mse", optimizer="sgd")
    m = match_attention(step, "qk")
    assert not isinstance(m, str), m
    grads = dict(m.grads)
    if not FORMS[form].get("trainable", True):
        assert "bias" not in grads  # a mask: no gradient to write
    elif FORMS[form]["bias_shape"] == (B, HEADS, S, S):  # the add passes its output gradient on
        assert grads["bias"] == "softmax.dx"
    else:
        assert grads["bias"] == "bias_add.da" if FORMS[form].get("bias_first") else grads["bias"] == "bias_add.db"
    h = fuse_attention(step, "qk")
    if "bias" in grads:
        dbias = h.ops[f"{SITE}.dbias"]
        assert dbias.kernel == "attention_grad_bias" and dbias.output == step.ops[grads["bias"]].output
    assert all(dict(o.inputs).get("bias") == "pos_bias" for n, o in h.ops.items() if n.startswith(SITE))
    assert not any(o.kernel in ("softmax", "softmax_grad", "reduce_to") and n.startswith(("bias_add", "softmax"))
                   for n, o in h.ops.items())
    check_fused(h, step, step)


def test_biased_refusals_name_the_reason():
    why = match_attention(biased(order=("bias", "scale")), "qk")
    assert isinstance(why, str) and "after the bias add" in why
    why = match_attention(biased(bias_shape=(1, HEADS, S, 1)), "qk")
    assert isinstance(why, str) and "constant over the keys" in why
    gb = GraphBuilder.from_graph(biased())
    gb.reduce_sum("bias_add.out", name="peek", dim=-1)
    why = match_attention(gb.build(), "qk")
    assert isinstance(why, str) and "peek" in why
    with pytest.raises(RewriteError, match="after the bias add"):
        fuse_attention(biased(order=("bias", "scale")), "qk")


def test_unbiased_patterns_keep_their_inputs():
    """Without an add the attention op reads q, k and v only, as before."""
    h = fuse_attention(biased(order=("scale", "mask")), "qk")
    assert [p for p, _ in h.ops[SITE].inputs] == ["q", "k", "v"]


def test_t5_encoder_relative_position_bias_fuses_in_its_training_step():
    """Hugging Face T5's encoder: scores + the relative-position bias (an embedding lookup shared by
    the layers, [1, h, s, t], trained) before the softmax: one site a layer; the fused training step
    (attention_grad_bias writing the bias's gradient) verifies against the unfused one and unfuses exactly."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from ir.importers.torch_export import import_torch
    from ir.rewrites.substitute_attention import attention_sites

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = transformers.T5EncoderModel(transformers.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64,
                                                                       num_layers=2, num_heads=4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.m(x).last_hidden_state

    torch.manual_seed(0)
    g, values = import_torch(Encoder().eval(), {"x": torch.randint(0, 96, (2, 12))})
    sites = attention_sites(g)
    assert len(sites) == 2
    assert all(match_attention(g, s).bias is not None for s in sites)
    step = training_step(g, loss="mse", optimizer="sgd")
    assert attention_sites(step) == sites
    h = step
    for s in sites:
        h = fuse_attention(h, s)
    assert sum(o.kernel == "attention_grad_bias" for o in h.ops.values()) == 2
    rep = verify(h, reference=step, values=values)
    assert rep.ok, str(rep)
    back = h
    for s in sites:
        m = [n for n, o in back.ops.items() if o.kernel == "attention" and n.startswith(s + "+")]
        back = unfuse_attention(back, m[0])
    assert_same_ops(back, step)
