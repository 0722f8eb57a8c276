"""The ``attention`` kernel against a naive NumPy attention written here (scores materialised).

Covers multi-head and grouped-query shapes, causal masks with offsets (rows that see no key
give zeros), blocks of query rows at absolute positions, the online-softmax loop over several
key blocks, the split key reduction through ``attention_combine``, FLOPs and bytes by hand, and
plans (sharded, split, placed, float16) verified against the unsharded program.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import verify
from ir.builder import GraphBuilder
from ir.kernels import SignatureError, TensorSpec, get_kernel
from ir.kernels.attention import combine_partials, flash_forward, visible_keys
from ir.rewrites import place, split, split_reduction
from ir.validate import validate
from ir.zspace import ZRange


def naive_attention(q, k, v, scale, causal=False, offset=0):
    """softmax(scale·q·kᵀ + mask)·v with the scores in memory; k, v broadcast over q's extra dims."""
    extra = q.ndim - k.ndim
    k = k.reshape(k.shape[:-2] + (1,) * extra + k.shape[-2:])
    v = v.reshape(v.shape[:-2] + (1,) * extra + v.shape[-2:])
    s = scale * np.einsum("...se,...te->...st", q, k)
    if causal:
        i = np.arange(q.shape[-2])[:, None]
        j = np.arange(k.shape[-2])[None, :]
        s = np.where(j <= i + offset, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    p = p / np.where(den > 0, den, 1.0)  # a row that sees no key attends to nothing: zeros
    return np.einsum("...st,...te->...se", p, v)


def spec(shape, dtype="float32"):  # signatures take storage dtypes; the arrays here are float64
    return TensorSpec(tuple(shape), dtype)


SHAPES = {
    "mha": ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6)),
    "gqa": ((2, 2, 3, 5, 4), (2, 2, 7, 4), (2, 2, 7, 4)),  # q[b, kvh, g, s, e], k/v[b, kvh, t, e]
    "plain": ((6, 4), (8, 4), (8, 3)),
}


def data(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


def run_box(params, ins, box):
    """The kernel's output block for index box ``box``, fed exactly its projected input boxes."""
    k = get_kernel("attention")
    sig = k.signature({p: spec(a.shape) for p, a in ins.items()}, params)
    blocks = {}
    for p, proj in sig.inputs.items():
        b = proj.apply(box)
        blocks[p] = ins[p][tuple(slice(a, z) for a, z in zip(b.start, b.end))]
    return k.run(np, blocks, k.check_params(params), box, sig), sig


@pytest.mark.parametrize("layout", sorted(SHAPES))
@pytest.mark.parametrize("causal,offset", [(False, 0), (True, 0), (True, 2), (True, -2)])
def test_blocks_equal_slices_of_naive_attention(layout, causal, offset):
    q, k, v = data(SHAPES[layout])
    params = {"scale": 0.3, "causal": causal, "offset": offset}
    ref = naive_attention(q, k, v, 0.3, causal, offset)
    ins = {"q": q, "k": k, "v": v}
    sig = get_kernel("attention").signature({p: spec(a.shape) for p, a in ins.items()}, params)
    assert sig.dims[-1] == "s" and sig.extents == q.shape[:-1]
    rng = np.random.default_rng(1)
    boxes = [sig.index]
    for _ in range(12):
        lo = [int(rng.integers(0, e)) for e in sig.extents]
        boxes.append(ZRange(lo, [int(rng.integers(a + 1, e + 1)) for a, e in zip(lo, sig.extents)]))
    for box in boxes:
        y, _ = run_box(params, ins, box)
        out = sig.output.apply(box)
        np.testing.assert_allclose(y, ref[tuple(slice(a, z) for a, z in zip(out.start, out.end))],
                                   rtol=1e-10, atol=1e-12, err_msg=str(box))


def test_online_softmax_over_many_key_blocks_equals_one_block():
    q, k, v = data(SHAPES["mha"], seed=3)
    k = np.concatenate([k, 30 * k], axis=-2)  # later blocks carry larger scores: the max moves
    v = np.concatenate([v, v], axis=-2)
    for causal, offset in [(False, 0), (True, 3)]:
        one, lse1 = flash_forward(np, q, k, v, 0.5, causal, 0, 0, offset, block=10_000)
        many, lse2 = flash_forward(np, q, k, v, 0.5, causal, 0, 0, offset, block=3)
        np.testing.assert_allclose(many, one, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse2, lse1, rtol=1e-12)
        np.testing.assert_allclose(one, naive_attention(q, k, v, 0.5, causal, offset), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal,offset", [(False, 0), (True, 0), (True, -3)])
@pytest.mark.parametrize("parts", [2, 8])
def test_split_key_reduction_combines_back(causal, offset, parts):
    q, k, v = data(((2, 3, 5, 4), (2, 3, 8, 4), (2, 3, 8, 6)), seed=4)  # parts 8: one key per block
    params = {"scale": 0.7, "causal": causal, "offset": offset, "split": {"reduction": "t", "parts": parts}}
    ins = {"q": q, "k": k, "v": v}
    kern = get_kernel("attention")
    sig = kern.signature({p: spec(a.shape) for p, a in ins.items()}, params)
    assert sig.dims[0] == "kb" and sig.split_from.monoid == "softmax"
    assert sig.out_spec.shape == (parts,) + q.shape[:-1] + (v.shape[-1] + 1,)  # output channels + log-sum-exp
    partials, _ = run_box(params, ins, sig.index)
    ref = naive_attention(q, k, v, 0.7, causal, offset)
    np.testing.assert_allclose(combine_partials(np, partials), ref, rtol=1e-10, atol=1e-12)
    comb = get_kernel("attention_combine")
    csig = comb.signature({"p": spec(partials.shape)}, {})
    assert csig.out_spec.shape == ref.shape and csig.extents == ref.shape[:-1]
    np.testing.assert_allclose(comb.compute(np, {"p": partials}, {}), ref, rtol=1e-10, atol=1e-12)
    # The monoid does not care about block order.
    perm = np.random.default_rng(0).permutation(parts)
    np.testing.assert_allclose(combine_partials(np, partials[perm]), ref, rtol=1e-10, atol=1e-12)
    # Sub-boxes of the partial op (some key blocks, some rows) are slices of the whole partials.
    for box in (ZRange((1, 0, 1, 2), (2, 2, 3, 5)), ZRange((0, 1, 0, 0), (parts, 2, 2, 3))):
        y, _ = run_box(params, ins, box)
        np.testing.assert_allclose(y, partials[tuple(slice(a, z) for a, z in zip(box.start, box.end))],
                                   rtol=1e-12, atol=1e-12)


def test_flops_and_bytes_by_hand():
    b, h, s, t, e = 2, 4, 64, 64, 16
    k = get_kernel("attention")
    ins = {"q": spec((b, h, s, e), "bfloat16"), "k": spec((b, h, t, e), "bfloat16"),
           "v": spec((b, h, t, e), "bfloat16")}
    sig = k.signature(ins, {"scale": 0.25})
    box = ZRange((0, 1, 16), (2, 3, 48))  # 2 batches, 2 heads, 32 query rows
    lo, hi = np.array([box.start]), np.array([box.end])
    rows = 2 * 2 * 32
    assert sig.flops(lo, hi)[0] == rows * t * (2 * e + 2 * e + 5)  # q·kᵀ, p·v, softmax per score
    read, written = sig.io_bytes(lo, hi)
    assert read[0] == 2 * (rows * e + 2 * (2 * 2 * t * e))  # its q rows, its heads' k and v, once
    assert written[0] == 2 * rows * e
    causal = k.signature(ins, {"scale": 0.25, "causal": True})
    # Causal: half the scores plus the diagonal.
    assert causal.flops_per_point * s == pytest.approx(s * (s + 1) / 2 * (4 * e + 5))
    assert visible_keys(4, 6, True, 1) == 2 + 3 + 4 + 5 and visible_keys(4, 6, True, -5) == 0
    # The split form: same total work, and the partial holds no s × t tensor.
    sp = k.signature(ins, {"scale": 0.25, "split": {"reduction": "t", "parts": 4}})
    assert sp.flops_per_point * sp.index.size == pytest.approx(sig.flops_per_point * sig.index.size)
    assert sp.out_spec.shape == (4, b, h, s, e + 1)


@pytest.mark.parametrize("shapes,msg", [
    ({"q": (2, 5, 4), "k": (3, 7, 4), "v": (3, 7, 4)}, "must lead with q's leading dims"),
    ({"q": (2, 5, 4), "k": (2, 7, 3), "v": (2, 7, 4)}, "share the head dim"),
    ({"q": (2, 5, 4), "k": (2, 7, 4), "v": (2, 6, 4)}, "same key length"),
    ({"q": (2, 5, 4), "k": (2, 1, 7, 4), "v": (2, 1, 7, 4)}, "Lk a prefix of L"),
])
def test_bad_shapes_are_refused_with_the_reason(shapes, msg):
    with pytest.raises(SignatureError, match=msg):
        get_kernel("attention").signature({p: spec(s) for p, s in shapes.items()}, {})


def test_bad_params_are_refused():
    ins = {p: spec((2, 5, 4)) for p in ("q", "k", "v")}
    with pytest.raises(SignatureError, match="causal must be true/false"):
        get_kernel("attention").signature(ins, {"causal": 1})
    with pytest.raises(SignatureError, match="no parameter 'mask'"):
        get_kernel("attention").signature(ins, {"mask": True})
    with pytest.raises(SignatureError, match="partials"):
        get_kernel("attention_combine").signature({"p": spec((4, 5))}, {})


def attention_program(b=2, h=2, s=8, e=4, causal=True, offset=0, dtype="float32"):
    g = GraphBuilder(dtype)
    q, k, v = (g.input(n, (b, h, s, e)) for n in "qkv")
    g.attention(q, k, v, name="attn", scale=1 / math.sqrt(e), causal=causal, offset=offset)
    return g.build()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), causal=st.booleans(), offset=st.integers(-2, 3),
       parts=st.sampled_from([1, 2, 4]), rows=st.integers(1, 4), dtype=st.sampled_from(["float32", "float16"]))
def test_sharded_split_placed_plans_verify(seed, causal, offset, parts, rows, dtype):
    g = attention_program(causal=causal, offset=offset, dtype=dtype)
    rng = np.random.default_rng(seed)
    h = split(g, "attn", "s", rows) if rows > 1 else g
    if parts > 1:
        h = split_reduction(h, "attn", parts)
        h = split(h, "attn", "kb", parts)
        h = place(h, "attn", [int(d) for d in rng.permutation(4)])
    if rng.random() < 0.5:
        h = split(h, "attn", "h", 2)
    assert validate(h) == []
    rep = verify(h, reference=g, seed=seed % 1000)
    assert rep.ok, str(rep)


def test_verify_can_fail_on_a_wrong_mask():
    """A plan computing another mask is caught: the check has teeth."""
    g = attention_program(causal=True, offset=0)
    wrong = attention_program(causal=True, offset=1)
    assert not verify(wrong, reference=g).ok
