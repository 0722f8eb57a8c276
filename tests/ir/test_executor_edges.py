"""Executor corner cases: boxes wholly in the padding, 0-dimensional index spaces, half precision."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import BackendError, execute, get_backend, random_inputs, verify
from executor.run import read_box
from ir import workloads
from ir.builder import GraphBuilder
from ir.rewrites import RewriteError, random_rewrite, retile, split
from ir.validate import validate


def test_read_box_pads_with_zeros():
    a = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(read_box(np, a, np.array([1, 1]), np.array([3, 3])), a[1:3, 1:3])
    out = read_box(np, a, np.array([-1, 2]), np.array([2, 6]))
    assert out.shape == (3, 4)
    np.testing.assert_array_equal(out[1:, :2], a[:2, 2:])
    assert not out[0].any() and not out[:, 2:].any()


@pytest.mark.parametrize("lo,hi", [([-3, 0], [-1, 4]), ([0, 5], [3, 7]), ([4, -2], [6, -1]), ([-1, 0], [0, 4])])
def test_read_box_wholly_outside_is_all_zeros(lo, hi):
    a = np.ones((3, 4))
    out = read_box(np, a, np.array(lo), np.array(hi))
    assert out.shape == tuple(np.array(hi) - np.array(lo)) and not out.any()


def test_conv_padding_wider_than_kernel(kit):
    # A 1x1 conv with padding 2: the border output rows read nothing but padding.
    b = GraphBuilder()
    b.conv2d(b.input("x", (1, 2, 4, 3)), b.parameter("w", (3, 2, 1, 1)), name="c", padding=2)
    g = b.build()
    assert g.tensors["c.out"].shape == (1, 3, 8, 7)
    h = retile(g, "c", (1, 1, 8, 7), devices=(0, 1))  # one shard per output pixel
    kit.assert_rewrite_ok(h, g)
    y = execute(h)["c.out"]
    assert not y[:, :, :2].any() and not y[:, :, -2:].any() and y[:, :, 2:6, 2:5].any()


def test_zero_dimensional_index_space():
    # softmax and layernorm of a vector: the index space has no dimensions, one point, one shard.
    b = GraphBuilder()
    x = b.input("x", (6,))
    s = b.softmax(x, name="sm")
    b.layernorm(s, b.parameter("g", (6,)), b.parameter("bb", (6,)), name="ln")
    g = b.build()
    assert g.signature("sm").dims == () and len(g.ops["sm"].shards) == 1
    assert validate(g) == []
    env = execute(g)
    xs = env["x"].astype(np.float64)
    np.testing.assert_allclose(env["sm.out"], np.exp(xs) / np.exp(xs).sum(), rtol=1e-6)
    rng = np.random.default_rng(0)
    h = g
    for _ in range(10):  # only placement and fusion apply; none may crash
        h, _ = random_rewrite(h, rng, 3)
    assert validate(h) == [] and verify(h, reference=g).ok
    with pytest.raises(Exception, match="out of range|no index dimension"):
        split(g, "sm", 0, 2)


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(["mlp", "transformer", "convnet"]), dtype=st.sampled_from(["float16", "bfloat16"]),
       seed=st.integers(0, 2**32 - 1))
def test_half_precision_plans_verify(kit, name, dtype, seed):
    g = workloads.build(name, dtype=dtype, **kit.SMALL[name])
    rng = np.random.default_rng(seed)
    h = g
    for _ in range(30):
        try:
            h, _ = random_rewrite(h, rng, 4)
        except RewriteError:  # no legal move found in its bounded draws: keep what we have
            break
    assert validate(h) == []
    rep = verify(h, reference=g)
    assert rep.ok, str(rep)


def test_execute_returns_every_tensor_in_its_dtype():
    g = workloads.mlp(batch=3, widths=(4, 6, 2), dtype="float16")
    env = execute(g, seed=1)
    assert set(env) == set(g.tensors)
    assert all(env[n].dtype == np.float16 for n in g.tensors)
    assert execute(workloads.mlp(batch=3, widths=(4, 6, 2), dtype="bfloat16"))["fc2.out"].dtype == np.float32


def test_a_block_of_the_wrong_shape_is_never_broadcast_into_place(kit, monkeypatch):
    from ir.kernels.elementwise import Relu
    g = kit.small("mlp")
    monkeypatch.setattr(Relu, "compute", lambda self, xp, blocks, params: xp.maximum(blocks["x"][:1], 0))
    with pytest.raises(ValueError, match=r"op act1 \(relu\) shard 0: the kernel returned a block of shape \(1, 20\)"):
        execute(g)


def test_unknown_backend():
    with pytest.raises(BackendError, match="unknown backend"):
        get_backend("jax")


def _cupy_ok() -> bool:
    try:
        get_backend("cupy")
        return True
    except BackendError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cupy_ok(), reason="needs CuPy and an NVIDIA GPU")
def test_cupy_backend_matches_numpy(kit):
    for name in ("mlp", "transformer", "convnet"):
        g = kit.small(name)
        rng = np.random.default_rng(3)
        h = g
        for _ in range(20):
            h, _ = random_rewrite(h, rng, 4)
        rep = verify(h, reference=g, backend="cupy")
        assert rep.ok, f"{name}: {rep}"


def test_random_inputs_cover_sources_only(kit):
    g = kit.small("convnet")
    assert set(random_inputs(g)) == {n for n, t in g.tensors.items() if t.role in ("input", "parameter")}


def test_read_box_matches_a_zero_padded_reference():
    """Boxes inside, across and outside the array's edges (lo <= hi, within 3 cells of it) read
    what slicing the array padded with zeros reads: the fast path for inner boxes included."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((4, 5, 3))
    m = 3
    padded = np.pad(a, m)
    for _ in range(400):
        lo = rng.integers(-m, np.array(a.shape) + m)
        hi = lo + rng.integers(0, np.array(a.shape) + m - lo + 1)
        got = read_box(np, a, lo, hi)
        np.testing.assert_array_equal(got, padded[tuple(slice(x + m, y + m) for x, y in zip(lo, hi))])
