"""place and move: change shard devices only (the boxes are shared, not copied)."""

from __future__ import annotations

import pytest

from ir.rewrites import RewriteError, move, place, split


def test_place_round_robin(kit, mlp):
    h = place(split(mlp, "fc1", "o", 4), "fc1", [2, 7])
    assert h.ops["fc1"].shards.device.tolist() == [2, 7, 2, 7]
    assert h.devices == {0, 2, 7}
    kit.assert_rewrite_ok(h, mlp)


def test_place_shares_boxes(mlp):
    h = split(mlp, "fc1", "o", 4)
    p = place(h, "fc1", [1, 2, 3, 4])
    assert p.ops["fc1"].shards.lo is h.ops["fc1"].shards.lo
    assert p.ops["fc1"].shards.hi is h.ops["fc1"].shards.hi


def test_place_refusals(mlp):
    with pytest.raises(RewriteError, match="already placed on \\[0\\]"):
        place(mlp, "fc1", [0])
    with pytest.raises(RewriteError, match="at least one device"):
        place(mlp, "fc1", [])
    with pytest.raises(RewriteError, match="device numbers must be >= 0"):
        place(mlp, "fc1", [-3])
    with pytest.raises(RewriteError, match="no operation"):
        place(mlp, "fc7", [1])


def test_move_one_shard(kit, mlp):
    h = split(mlp, "act1", "d1", 3)
    m = move(h, "act1", 1, 5)
    assert m.ops["act1"].shards.device.tolist() == [0, 5, 0]
    assert m.ops["act1"].shards.lo is h.ops["act1"].shards.lo
    assert h.ops["act1"].shards.device.tolist() == [0, 0, 0]  # the parent is unchanged
    kit.assert_rewrite_ok(m, mlp)


def test_move_refusals(mlp):
    h = split(mlp, "act1", "d1", 3)
    with pytest.raises(RewriteError, match="no shard 3; it has 3"):
        move(h, "act1", 3, 1)
    with pytest.raises(RewriteError, match="no shard -1"):
        move(h, "act1", -1, 1)
    with pytest.raises(RewriteError, match="already on device 0"):
        move(h, "act1", 0, 0)
    with pytest.raises(RewriteError, match="must be >= 0"):
        move(h, "act1", 0, -1)
