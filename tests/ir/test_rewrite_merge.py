"""merge: join neighbouring shards along a dimension (whole runs, or groups of ``factor``)."""

from __future__ import annotations

import pytest

from ir.rewrites import RewriteError, merge, place, split


def test_merge_full_undoes_split(kit, mlp):
    h = split(mlp, "fc1", "o", 4)
    back = merge(h, "fc1", "o")
    assert len(back.ops["fc1"].shards) == 1
    assert back.digest == mlp.digest
    kit.assert_rewrite_ok(back, mlp)


def test_merge_factor_2(kit, mlp):
    h = split(mlp, "act1", "d0", 4)  # rows 3, 3, 2, 2
    m = merge(h, "act1", "d0", 2)
    sh = m.ops["act1"].shards
    assert (sh.hi[:, 0] - sh.lo[:, 0]).tolist() == [6, 4]
    kit.assert_rewrite_ok(m, mlp)


def test_merge_factor_on_odd_runs_leaves_a_tail(kit, mlp):
    h = split(mlp, "fc1", "o", 3)  # o: 6, 5, 5
    m = merge(h, "fc1", "o", 2)
    sh = m.ops["fc1"].shards
    assert sorted((sh.hi[:, 1] - sh.lo[:, 1]).tolist()) == [5, 11]
    kit.assert_rewrite_ok(m, mlp)


def test_merge_only_joins_shards_that_agree_on_other_dims(kit, mlp):
    h = split(split(mlp, "fc1", "n", 2), "fc1", "o", 2)  # 2x2 grid
    m = merge(h, "fc1", "o")
    assert len(m.ops["fc1"].shards) == 2
    assert sorted(m.ops["fc1"].shards.lo.tolist()) == [[0, 0], [5, 0]]
    kit.assert_rewrite_ok(m, mlp)


def test_merged_shard_keeps_first_device(kit, mlp):
    h = place(split(mlp, "fc2", "o", 2), "fc2", [4, 6])
    m = merge(h, "fc2", "o")
    assert m.ops["fc2"].shards.device.tolist() == [4]
    kit.assert_rewrite_ok(m, mlp)


def test_merge_refused_when_nothing_to_merge(mlp):
    with pytest.raises(RewriteError, match="fc1: no neighbouring shards to merge along 'o'"):
        merge(mlp, "fc1", "o")
    h = split(mlp, "fc1", "n", 2)
    with pytest.raises(RewriteError, match="no neighbouring shards"):
        merge(h, "fc1", "o")  # the pieces are neighbours along n, not o


def test_merge_refusals(mlp):
    h = split(mlp, "fc1", "o", 2)
    with pytest.raises(RewriteError, match="factor must be >= 2"):
        merge(h, "fc1", "o", 1)
    with pytest.raises(RewriteError, match="no index dimension"):
        merge(h, "fc1", "x")
    with pytest.raises(RewriteError, match="no operation"):
        merge(h, "fc9", "o")
