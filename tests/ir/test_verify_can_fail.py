"""``executor.verify`` must be able to fail: broken plans and broken kernels are caught."""

from __future__ import annotations

import numpy as np
import pytest

from executor import TOLERANCE, verify
from executor.verify import rel_error
from ir import workloads
from ir.kernels.contraction import Linear
from ir.kernels.rowwise import Softmax
from ir.rewrites import split, split_reduction
from ir.validate import validate


def test_correct_plan_passes(kit, mlp):
    rep = verify(split(mlp, "fc1", "n", 3), reference=mlp)
    assert rep.ok and rep.max_rel_error < 1e-6 and str(rep).startswith("PASS")
    assert set(rep.per_output) == {"fc2.out"}


def test_shards_covering_part_of_the_index_space_fail(kit, mlp):
    # fc1's only shard computes rows 0..5 of 10: the rest of fc1.out is never written.
    h = kit.edited(mlp, lambda d: kit.op_json(d, "fc1").update(shards={"lo": [[0, 0]], "hi": [[6, 16]],
                                                                         "device": [0]}))
    assert kit.issues_with(h, "shard-coverage")  # validation refuses it ...
    rep = verify(h, reference=mlp)  # ... and execution shows why
    assert not rep.ok and rep.max_rel_error > 0.1
    assert str(rep).startswith("FAIL")
    assert not verify(h).ok  # against its own unsharded program too


def test_overlapping_shards_with_a_gap_fail(kit, mlp):
    sh = {"lo": [[0, 0], [0, 0]], "hi": [[5, 16], [10, 8]], "device": [0, 1]}
    h = kit.edited(mlp, lambda d: kit.op_json(d, "act1").update(shards=sh))
    assert [i.code for i in validate(h)] == ["shard-overlap"]
    assert not verify(h, reference=mlp).ok


def test_valid_graph_of_a_different_program_fails(kit, mlp):
    # A plan that is perfectly valid, but accumulates the partials with max instead of sum.
    s = split_reduction(mlp, "fc2", 4)
    h = kit.edited(s, lambda d: kit.op_json(d, "fc2.acc")["params"].update(monoid="max"))
    assert validate(h) == []
    assert not verify(h, reference=mlp).ok
    # Or one that skips the activation: fc2 reads fc1.out instead of act1.out.
    h = kit.edited(mlp, lambda d: kit.op_json(d, "fc2")["inputs"].update(x="fc1.out"))
    assert validate(h) == []
    assert not verify(h, reference=mlp).ok


def test_broken_partial_kernel_is_caught(mlp, monkeypatch):
    plan = split_reduction(mlp, "fc2", 4)
    assert verify(plan, reference=mlp).ok
    # A kernel bug that only shows in split plans: the bias added to every partial, not once
    # (block by block, and in the batched form a shard over several blocks runs).
    monkeypatch.setattr(Linear, "partial_compute",
                        lambda self, xp, blocks, params, block: xp.matmul(blocks["x"], blocks["W"]) + blocks["b"])
    batched = Linear.batched_partials
    monkeypatch.setattr(Linear, "batched_partials",
                        lambda self, xp, blocks, *a: batched(self, xp, blocks, *a) + blocks["b"])
    rep = verify(plan, reference=mlp)
    assert not rep.ok, str(rep)
    assert verify(mlp, reference=mlp).ok  # the unsplit program is unaffected


def test_kernel_that_normalises_over_the_block_is_caught(kit, monkeypatch):
    # A classic block-kernel bug: softmax normalised over the whole block instead of per row.
    # Unsharded it is one block; sharded it is several, so plan and reference disagree.
    g = kit.small("transformer")
    plan = split(split(g, "attn_softmax", 0, 2), "attn_softmax", 2, 3)
    assert verify(plan, reference=g).ok

    def blockwise(self, xp, blocks, params):
        e = xp.exp(blocks["x"])
        return e / xp.sum(e)
    monkeypatch.setattr(Softmax, "compute", blockwise)
    rep = verify(plan, reference=g)
    assert not rep.ok and rep.max_rel_error > 10 * rep.tolerance


def test_tolerances_by_dtype():
    assert TOLERANCE["float16"] > TOLERANCE["float32"]
    g = workloads.mlp(batch=4, widths=(8, 16, 4), dtype="float16")
    rep = verify(split_reduction(g, "fc1", 4), reference=g)
    assert rep.ok and rep.tolerance == TOLERANCE["float16"]


def test_rel_error_shape_mismatch_is_infinite():
    assert rel_error(np.zeros((2, 3)), np.ones((3, 2))) == float("inf")
    assert rel_error(np.ones(3), np.ones(3)) == 0.0
    assert rel_error(np.array([1.0, 2.1]), np.array([1.0, 2.0])) == pytest.approx(0.05)
