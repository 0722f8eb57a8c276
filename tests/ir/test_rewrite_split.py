"""split: cut every shard of an op into near-equal pieces along one index dimension."""

from __future__ import annotations

import numpy as np
import pytest

from ir.rewrites import RewriteError, split


def extents(g, op, d):
    sh = g.ops[op].shards
    return (sh.hi[:, d] - sh.lo[:, d]).tolist()


def test_split_by_name(kit, mlp):
    h = split(mlp, "fc1", "o", 2)  # fc1 index dims (n, o) = (10, 16)
    assert len(h.ops["fc1"].shards) == 2
    assert h.ops["fc1"].shards.lo.tolist() == [[0, 0], [0, 8]]
    assert h.ops["fc1"].shards.hi.tolist() == [[10, 8], [10, 16]]
    kit.assert_rewrite_ok(h, mlp)


def test_split_by_position_equals_split_by_name(kit, mlp):
    by_name = split(mlp, "fc1", "o", 4)
    assert split(mlp, "fc1", 1, 4).digest == by_name.digest
    assert split(mlp, "fc1", -1, 4).digest == by_name.digest
    assert split(mlp, "fc1", "1", 4).digest == by_name.digest
    kit.assert_rewrite_ok(by_name, mlp)


def test_split_ragged_extent_10_into_4(kit, mlp):
    h = split(mlp, "act1", "d0", 4)  # act1 index (10, 16): extent 10 -> 3, 3, 2, 2
    assert extents(h, "act1", 0) == [3, 3, 2, 2]
    kit.assert_rewrite_ok(h, mlp)


def test_split_every_shard_and_keep_devices(kit, mlp):
    from ir.rewrites import place
    h = place(split(mlp, "fc1", "n", 2), "fc1", [3, 5])
    h2 = split(h, "fc1", "o", 3)
    assert len(h2.ops["fc1"].shards) == 6
    assert h2.ops["fc1"].shards.device.tolist() == [3, 3, 3, 5, 5, 5]
    assert extents(h2, "fc1", 1) == [6, 5, 5] * 2
    kit.assert_rewrite_ok(h2, mlp)


def test_split_works_on_every_kind_of_op(kit):
    for name in ("transformer", "convnet"):
        g = kit.small(name)
        h = g
        for op in g.ops:
            sig = h.signature(op)
            d = int(np.argmax(sig.extents))
            h = split(h, op, d, 2)
        assert h.n_shards == 2 * g.n_shards
        kit.assert_rewrite_ok(h, g)


def test_split_refused_when_a_shard_is_too_thin(kit, mlp):
    h = split(mlp, "act1", "d0", 4)  # shards of 3, 3, 2, 2 rows
    with pytest.raises(RewriteError, match=r"act1: shard 2 spans only 2 along 'd0', cannot cut it into 3"):
        split(h, "act1", "d0", 3)
    with pytest.raises(RewriteError, match="spans only 10"):
        split(mlp, "fc1", "n", 11)


@pytest.mark.parametrize("args,message", [
    (("fc1", "o", 1), "parts >= 2"),
    (("fc1", "o", 2.5), "parts >= 2"),
    (("fc1", "k", 2), "no index dimension 'k'"),
    (("fc1", 5, 2), "out of range"),
    (("nope", "o", 2), "no operation 'nope'"),
])
def test_split_refusals(mlp, args, message):
    with pytest.raises(RewriteError, match=message):
        split(mlp, *args)
