"""retile: replace an op's shards by a regular grid, placed round-robin."""

from __future__ import annotations

import pytest

from ir.rewrites import RewriteError, retile, split


def test_retile_grid_row_major_round_robin(kit, mlp):
    h = retile(mlp, "fc1", (2, 4), devices=(0, 1, 2))
    sh = h.ops["fc1"].shards
    assert len(sh) == 8
    assert sh.lo.tolist()[:4] == [[0, 0], [0, 4], [0, 8], [0, 12]]
    assert sh.device.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    kit.assert_rewrite_ok(h, mlp)


def test_retile_ragged_and_default_device(kit, mlp):
    h = retile(mlp, "act1", (4, 3))
    sh = h.ops["act1"].shards
    assert sorted(set((sh.hi[:, 0] - sh.lo[:, 0]).tolist())) == [2, 3]
    assert set(sh.device.tolist()) == {0}
    kit.assert_rewrite_ok(h, mlp)


def test_retile_replaces_any_previous_sharding(kit, mlp):
    h = split(split(mlp, "fc1", "o", 3), "fc1", "n", 2)
    assert retile(h, "fc1", (1, 1)).digest == mlp.digest
    kit.assert_rewrite_ok(retile(h, "fc1", (5, 2), (1,)), mlp)


def test_retile_conv_all_dims(kit):
    g = kit.small("convnet")
    h = retile(g, "conv1", (2, 2, 3, 2), devices=range(4))
    assert len(h.ops["conv1"].shards) == 24
    kit.assert_rewrite_ok(h, g)


@pytest.mark.parametrize("parts,devices,message", [
    ((2,), None, "one part count per index dim"),
    ((11, 1), None, "cannot cut extent 10 of 'n' into 11 tiles"),
    ((0, 1), None, "into 0 tiles"),
    ((2, 2), (0, -1), "device numbers must be >= 0"),
])
def test_retile_refusals(mlp, parts, devices, message):
    with pytest.raises(RewriteError, match=message):
        retile(mlp, "fc1", parts, devices)
