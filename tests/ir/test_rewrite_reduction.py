"""split_reduction / merge_reduction: a partial op with a leading block dim plus an accumulate op."""

from __future__ import annotations

import numpy as np
import pytest

from executor import execute
from ir.builder import GraphBuilder
from ir.rewrites import RewriteError, fuse, merge_reduction, place, split, split_reduction, unshard


def test_split_linear_reduction(kit, mlp):
    h = split_reduction(mlp, "fc2", 4)  # fc2: f = 16 features into 4 blocks of 4
    o = h.ops["fc2"]
    assert o.params["split"] == {"reduction": "f", "parts": 4}
    assert o.output == "fc2.partial" and h.tensors["fc2.partial"].shape == (4, 10, 8)
    acc = h.ops["fc2.acc"]
    assert acc.kernel == "accumulate" and acc.params == {"monoid": "sum"} and acc.output == "fc2.out"
    assert h.signature("fc2").dims == ("kb", "n", "o")
    kit.assert_rewrite_ok(h, mlp)


def test_bias_is_added_in_exactly_one_partial(mlp):
    h = split_reduction(mlp, "fc2", 2)
    env = execute(h)
    x, W, b = env["act1.out"], env["W2"], env["b2"]
    p = env["fc2.partial"]
    np.testing.assert_allclose(p[0], x[:, :8] @ W[:8] + b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p[1], x[:, 8:] @ W[8:], rtol=1e-5, atol=1e-6)


def test_partial_and_accumulate_can_be_sharded(kit, mlp):
    h = split_reduction(split(mlp, "fc2", "n", 2), "fc2", 4)
    assert h.ops["fc2.acc"].shards.lo.tolist() == h.ops["fc2"].shards.lo[:, 1:].tolist()
    h = place(split(h, "fc2", "kb", 2), "fc2", [0, 1, 2, 3])
    h = place(split(h, "fc2.acc", "d1", 2), "fc2.acc", [3, 1])
    kit.assert_rewrite_ok(h, mlp)


def test_split_conv_channels_and_einsum_reductions(kit):
    c = kit.small("convnet")
    kit.assert_rewrite_ok(split_reduction(c, "conv2", 2), c)
    assert split_reduction(c, "conv2", 4).ops["conv2"].params["split"]["reduction"] == "ci"
    t = kit.small("transformer")  # o_proj = einsum bhse,hed->bsd: reductions h (2) and e (4)
    kit.assert_rewrite_ok(split_reduction(t, "o_proj", 2, "h"), t)
    kit.assert_rewrite_ok(split_reduction(t, "o_proj", 4, "e"), t)
    kit.assert_rewrite_ok(split_reduction(t, "attn_qk", 2), t)


def test_split_max_reduction_accumulates_with_max(kit):
    b = GraphBuilder()
    b.reduce_max(b.input("x", (6, 8)), name="rmax", dim=1)
    g = b.build()
    h = split_reduction(g, "rmax", 4)
    assert h.ops["rmax.acc"].params == {"monoid": "max"}
    kit.assert_rewrite_ok(h, g)


def test_merge_reduction_is_the_inverse(kit, mlp):
    h = split_reduction(mlp, "fc1", 4)
    assert merge_reduction(h, "fc1").digest == mlp.digest
    # After sharding the accumulate, the merged op takes the accumulate's shards.
    h2 = place(split(h, "fc1.acc", "d1", 2), "fc1.acc", [1, 2])
    m = merge_reduction(h2, "fc1")
    assert m.ops["fc1"].shards is h2.ops["fc1.acc"].shards
    assert "fc1.acc" not in m.ops and "fc1.partial" not in m.tensors
    kit.assert_rewrite_ok(m, mlp)


def test_split_and_merge_with_a_blocked_output_projection(kit):
    """A strided conv's input gradient writes a block of 2x2 cells per index point: the
    accumulate gets the output boxes of the partial op's shards, and merging maps whole-block
    boxes of the accumulate back to index boxes (a box that cuts a block: one whole shard)."""
    b = GraphBuilder()
    b.op("conv2d_input_grad", "dx", {"dy": b.input("dy", (2, 4, 4, 4)), "w": b.input("w", (4, 3, 3, 3))},
         stride=2, padding=1, size=[8, 7])
    g = b.build()
    h = split_reduction(place(split(g, "dx", "hb", 2), "dx", [0, 1]), "dx", 2)
    acc = h.ops["dx.acc"]
    assert h.tensors["dx.out"].shape == (2, 3, 8, 8)
    assert acc.shards.lo[:, 2].tolist() == [0, 4] and acc.shards.hi[:, 2].tolist() == [4, 8]
    kit.assert_rewrite_ok(h, g)
    h2 = place(split(h, "dx.acc", "d3", 2), "dx.acc", [2, 3, 0, 1])
    m = merge_reduction(h2, "dx")
    assert m.ops["dx"].shards.hi[:, 2:].tolist() == [[2, 2], [2, 4], [4, 2], [4, 4]]
    assert m.ops["dx"].shards.device.tolist() == [2, 3, 0, 1]
    kit.assert_rewrite_ok(m, g)
    odd = place(split(h, "dx.acc", "d2", 3), "dx.acc", [0, 1, 2])  # rows 0-2, 3-5, 6-7: not whole blocks
    assert len(merge_reduction(odd, "dx").ops["dx"].shards) == 1
    kit.assert_rewrite_ok(merge_reduction(odd, "dx"), g)


def test_split_again_after_merge(kit, mlp):
    h = split_reduction(merge_reduction(split_reduction(mlp, "fc1", 2), "fc1"), "fc1", 4)
    kit.assert_rewrite_ok(h, mlp)


def test_split_reduction_refusals(mlp):
    with pytest.raises(RewriteError, match="act1: kernel relu has no splittable reduction"):
        split_reduction(mlp, "act1", 2)
    with pytest.raises(RewriteError, match="reduction 'f' of extent 16 does not split into 3 equal blocks"):
        split_reduction(mlp, "fc2", 3)
    with pytest.raises(RewriteError, match="does not split into 1"):
        split_reduction(mlp, "fc2", 1)
    with pytest.raises(RewriteError, match="no reduction 'k'; splittable: \\['f'\\]"):
        split_reduction(mlp, "fc2", 2, "k")
    h = split_reduction(mlp, "fc2", 2)
    with pytest.raises(RewriteError, match="already split into 2 blocks"):
        split_reduction(h, "fc2", 4)
    f = fuse(mlp, "fc1", "act1")
    with pytest.raises(RewriteError, match="fused op's reduction cannot be split"):
        split_reduction(f, "fc1+act1", 2)
    with pytest.raises(RewriteError, match="no operation"):
        split_reduction(mlp, "fc3", 2)


def test_merge_reduction_refusals(kit, mlp):
    with pytest.raises(RewriteError, match="fc2: its reduction is not split"):
        merge_reduction(mlp, "fc2")
    h = fuse(split_reduction(mlp, "fc1", 2), "fc1.acc", "act1")  # the partials now feed a fused op
    with pytest.raises(RewriteError, match="not read by exactly one accumulate op"):
        merge_reduction(h, "fc1")
    kit.assert_rewrite_ok(h, mlp)
    assert unshard(h).digest == mlp.digest


@pytest.mark.parametrize("kind", ["matmul", "bmm", "linear1d", "linear2d", "linear3d"])
def test_blocks_of_a_shard_run_batched_as_the_loop_runs_them(kind, monkeypatch):
    """A shard over several reduction blocks computes them in one batched matmul (one launch, not
    one per block): the partials equal the block-by-block loop's and the closed form, the bias in
    block 0 alone (also when the shard starting at block 3 holds no block 0), alpha applied."""
    from ir.kernels import get_kernel
    from ir.kernels.base import Kernel

    b = GraphBuilder()
    if kind == "matmul":
        b.matmul(b.input("a", (5, 12)), b.parameter("w", (12, 7)), name="op", alpha=0.5)
    elif kind == "bmm":
        b.bmm(b.input("a", (2, 3, 5, 12)), b.input("w", (2, 3, 12, 7)), name="op", alpha=2.0)
    else:
        shape = {"linear1d": (12,), "linear2d": (5, 12), "linear3d": (2, 5, 12)}[kind]
        b.linear(b.input("a", shape), b.parameter("w", (12, 7)), b.parameter("bias", (7,)), name="op")
    g = b.build()
    h = split(split_reduction(g, "op", 6), "op", "kb", 2)  # two shards of 3 blocks of 2
    assert h.ops["op"].shards.lo[:, 0].tolist() == [0, 3]
    batched = execute(h)
    env = dict(batched)
    for cls in (Kernel, type(get_kernel(g.ops["op"].kernel))):  # the loop over blocks, as before
        monkeypatch.setattr(cls, "batched_partials", lambda self, *a: None)
    looped = execute(h)
    np.testing.assert_array_equal(batched["op.partial"], looped["op.partial"])
    a, w = env["a"], env["w"]
    alpha = {"matmul": 0.5, "bmm": 2.0}.get(kind, 1.0)
    for j in range(6):
        want = alpha * (a[..., 2 * j:2 * j + 2] @ (w[..., 2 * j:2 * j + 2, :]))
        if kind.startswith("linear") and j == 0:
            want = want + env["bias"]
        np.testing.assert_allclose(batched["op.partial"][j], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batched["op.out"], execute(g)["op.out"], rtol=1e-5, atol=1e-5)
