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
from ir.kernels import SignatureError, TensorSpec, get_kernel
from ir.rewrites import place, split, split_reduction
from ir.validate import validate
from ir.zspace import ZRange
from tests.autodiff.test_vjp_finite_differences import fd_check, one_op
from tests.ir.kernel_cases_attention import BIASES, attention_ref


def spec(shape, dtype="float32"):
    return TensorSpec(tuple(shape), dtype)


def run_box(ins, params, box=None):
    """The attention kernel's output block for ``box`` (default: the whole index space)."""
    k = get_kernel("attention")
    sig = k.signature({p: spec(a.shape) for p, a in ins.items()}, params)
    box = box or sig.index
    blocks = {}
    for p, proj in sig.inputs.items():
        b = proj.apply(box)
        blocks[p] = ins[p][tuple(slice(a, z) for a, z in zip(b.start, b.end))]
    return k.run(np, blocks, k.check_params(params), box, sig), sig


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
