"""The backward of fused attention: gradient kernels against central finite differences of a naive
attention written here, block by block and with the key-row gradients' query reduction split;
training steps of fused programs against the unfused programs' steps."""

from __future__ import annotations

import numpy as np
import pytest

from executor import verify
from ir import workloads
from ir.autodiff import training_step
from ir.kernels import TensorSpec, get_kernel
from ir.kernels.attention import flash_forward
from ir.rewrites import fuse_attention, split, split_reduction
from ir.rewrites.substitute_attention import attention_sites
from ir.validate import validate
from ir.zspace import ZRange


def naive(q, k, v, scale, causal, offset):
    extra = q.ndim - k.ndim
    k = k.reshape(k.shape[:-2] + (1,) * extra + k.shape[-2:])
    v = v.reshape(v.shape[:-2] + (1,) * extra + v.shape[-2:])
    s = scale * np.einsum("...se,...te->...st", q, k)
    if causal:
        s = np.where(np.arange(k.shape[-2])[None, :] <= np.arange(q.shape[-2])[:, None] + offset, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("...st,...te->...se", p / p.sum(axis=-1, keepdims=True), v)


def numeric_grad(f, x, h=1e-6):
    """Central differences of the scalar ``f`` at every entry of ``x`` (float64)."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        x[i] += h
        up = f()
        x[i] -= 2 * h
        down = f()
        x[i] += h
        g[i] = (up - down) / (2 * h)
    return g


def spec(a):
    return TensorSpec(a.shape, "float32")


def run(kernel, ins, params, box=None):
    k = get_kernel(kernel)
    sig = k.signature({p: spec(a) for p, a in ins.items()}, params)
    box = box or sig.index
    blocks = {}
    for p, proj in sig.inputs.items():
        b = proj.apply(box)
        blocks[p] = ins[p][tuple(slice(a, z) for a, z in zip(b.start, b.end))]
    return k.run(np, blocks, k.check_params(params), box, sig), sig


CASES = {
    "mha-causal": ((2, 2, 5, 3), (2, 2, 5, 3), (2, 2, 5, 4), True, 0),
    "gqa-offset": ((1, 2, 2, 4, 3), (1, 2, 6, 3), (1, 2, 6, 2), True, 2),
    "plain": ((4, 3), (6, 3), (6, 3), False, 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_equal_finite_differences(case):
    qs, ks, vs, causal, offset = CASES[case]
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal(qs), rng.standard_normal(ks), rng.standard_normal(vs)
    scale = 0.6
    params = {"scale": scale, "causal": causal, "offset": offset}
    o = naive(q, k, v, scale, causal, offset)
    dy = rng.standard_normal(o.shape)
    lse, _ = run("attention_lse", {"q": q, "k": k}, params)
    _, ref_lse = flash_forward(np, q, k, v, scale, causal, 0, 0, offset)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    rows = {"q": q, "k": k, "v": v, "o": o, "dy": dy, "lse": lse}
    loss = lambda: float(np.sum(naive(q, k, v, scale, causal, offset) * dy))  # noqa: E731
    dq, _ = run("attention_grad_q", rows, params)
    dk, _ = run("attention_grad_k", rows, params)
    dv, _ = run("attention_grad_v", {"q": q, "k": k, "dy": dy, "lse": lse}, params)
    for got, x in ((dq, q), (dk, k), (dv, v)):
        np.testing.assert_allclose(got, numeric_grad(loss, x), rtol=1e-6, atol=1e-8)


def test_blocks_and_split_query_reduction():
    """Key-row blocks at absolute positions, and dk/dv as sums of query-block partials (ring backward)."""
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 2))
    params = {"scale": 0.5, "causal": True, "offset": 0}
    o = naive(q, k, v, 0.5, True, 0)
    dy = rng.standard_normal(o.shape)
    lse, _ = run("attention_lse", {"q": q, "k": k}, params)
    rows = {"q": q, "k": k, "v": v, "o": o, "dy": dy, "lse": lse}
    for kernel, ins in (("attention_grad_k", rows), ("attention_grad_v", {"q": q, "k": k, "dy": dy, "lse": lse})):
        whole, sig = run(kernel, ins, params)
        assert sig.dims == ("b", "t") and sig.reductions[0].name == "s"
        part, _ = run(kernel, ins, params, ZRange((1, 2), (2, 5)))
        np.testing.assert_allclose(part, whole[1:2, 2:5], rtol=1e-12)
        split_params = {**params, "split": {"reduction": "s", "parts": 3}}
        partials, psig = run(kernel, ins, split_params)
        assert partials.shape == (3,) + whole.shape
        np.testing.assert_allclose(partials.sum(axis=0), whole, rtol=1e-10, atol=1e-12)
        # Causal: the last query block sees every key, the first only keys 0..1.
        assert np.all(partials[0][:, 2:] == 0)
    dq_whole, _ = run("attention_grad_q", rows, params)
    dq_part, _ = run("attention_grad_q", rows, params, ZRange((0, 3), (2, 6)))
    np.testing.assert_allclose(dq_part, dq_whole[:, 3:6], rtol=1e-12)


@pytest.mark.parametrize("name,kw,loss", [
    ("transformer", dict(batch=2, seq=6, d_model=8, heads=2, d_ff=12), "mse"),
    ("gpt", dict(batch=2, seq=6), "cross_entropy"),  # seq differs from the head dim 8: s × s is recognisable
    ("llama", dict(batch=2, seq=6, kv_heads=2), "cross_entropy"),
])
def test_training_step_of_fused_program_equals_unfused(name, kw, loss):
    g = workloads.build(name, **kw)
    h = g
    for site in attention_sites(g):
        h = fuse_attention(h, site)
    # lr 1: the next weights carry the gradients at full size, so a wrong gradient cannot hide.
    ref = training_step(g, loss=loss, optimizer_params={"lr": 1.0})
    step = training_step(h, loss=loss, optimizer_params={"lr": 1.0})
    assert validate(step) == []
    # The unfused step keeps the probabilities for its backward and makes s × s gradients; the fused has neither.
    scores = {t.shape for n, t in ref.tensors.items() if n.endswith("attn_softmax.out")}
    assert scores and not [n for n, t in step.tensors.items() if t.shape in scores]
    rep = verify(step, reference=ref)
    assert rep.ok, str(rep)
    # A plan of the fused step: the key-row gradients' query reduction split over two devices.
    grads = [n for n, o in step.ops.items() if o.kernel == "attention_grad_k"]
    p = split(split_reduction(step, grads[0], 2), grads[0], "kb", 2)
    assert verify(p, reference=ref).ok


def test_a_split_backward_reduction_is_merged_by_fuse_and_unfuse_attention():
    """A split gradient op writes the partials of a sum, not the gradient the fused backward needs:
    ``fuse_attention`` made an op writing k's gradient into the partials tensor (an invalid plan,
    reachable from the context-parallel expert), and ``unfuse_attention`` restored the unsplit
    op beside the split one (two writers). Both now merge such a reduction first."""
    from ir.rewrites import unfuse_attention, unshard

    g = workloads.build("gpt", mode="train", optimizer="sgd", layers=1, d_model=8, heads=2, vocab=10, seq=4,
                        batch=4)
    h = split_reduction(g, "l0.attn_qk.db", 2, "s")
    f = fuse_attention(h, "l0.attn_qk")
    assert validate(f) == [] and verify(f, reference=g).ok
    assert not any(o.params.get("split") for o in f.ops.values())
    assert unshard(f).digest == g.digest

    t = workloads.build("transformer", batch=2, seq=8, d_model=16, heads=4, d_ff=32, mode="train", optimizer="sgd")
    s = split_reduction(fuse_attention(t, "attn_qk"), "attn_qk+attn_av.dq", 2)
    assert validate(s) == [] and verify(s, reference=t).ok and unshard(s).digest == t.digest
    back = unfuse_attention(s, "attn_qk+attn_av")
    assert validate(back) == [] and verify(back, reference=t).ok and back.digest == t.digest
