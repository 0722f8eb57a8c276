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


def _key_bias_attention(b: int = 2, s: int = 6, d: int = 8):
    """One attention head with biased q/k/v projections: softmax is shift-invariant along the keys,
    so the key bias's gradient is exactly zero, and computed it is rounding noise."""
    from ir.builder import GraphBuilder
    g = GraphBuilder()
    x = g.input("x", (b, s, d))
    q, k, v = (g.linear(x, g.parameter(f"W{n}", (d, d)), g.parameter(f"b{n}", (d,)), name=n) for n in "qkv")
    p = g.softmax(g.bmm(q, g.permute(k, name="k_t", perm=[0, 2, 1]), name="qk", alpha=0.5), name="probs")
    g.bmm(p, v, name="av")
    return g.build()


@pytest.fixture(scope="module")
def key_bias_step():
    from ir.autodiff import training_step
    return training_step(_key_bias_attention(), loss="mse", optimizer="sgd")


@pytest.mark.parametrize("seed", [0, 3, 4])
def test_a_gradient_that_is_rounding_noise_passes(key_bias_step, seed):
    """A zero-initialised key bias (as Hugging Face initialises BERT's) stays zero up to noise:
    plan and program disagree on that noise by far more than the tolerance relative to it, which
    is no error of the plan; it is judged against the program's own float32 error instead."""
    from executor.run import execute, random_inputs
    from ir.rewrites import random_walk, unshard
    zero = {"bk": np.zeros(8, np.float32)}
    plan = random_walk(key_bias_step, np.random.default_rng(seed), 4, 20)
    inputs = {**random_inputs(key_bias_step, 0), **zero}
    noise = rel_error(execute(plan, inputs)["bk.next"], execute(unshard(plan), inputs)["bk.next"])
    assert noise > TOLERANCE["float32"]  # what the relative error alone said
    rep = verify(plan, values=zero)
    assert rep.ok, str(rep)
    assert set(rep.rounding) == {"bk.next"} and 0 < rep.rounding["bk.next"] < 1e-8
    assert "bk.next is rounding noise in the program itself" in str(rep)


def test_an_output_near_zero_in_the_program_still_fails_when_the_plan_is_wrong(kit, key_bias_step):
    """The float64 re-run rescues noise only: a plan whose key-bias update reads the query bias's
    gradient (a real value where the program's is noise) fails, on that output."""
    zero = {"bk": np.zeros(8, np.float32)}
    h = kit.edited(key_bias_step, lambda d: kit.op_json(d, "bk.update")["inputs"].update(g="bq.grad"))
    rep = verify(h, reference=key_bias_step, values=zero)
    assert not rep.ok and rep.per_output["bk.next"] > 1e3 * rep.tolerance, str(rep)
    assert all(v <= rep.tolerance for k, v in rep.per_output.items() if k != "bk.next")


def test_rounding_error_scales_with_the_programs_own_error():
    from executor.verify import NOISE_FACTOR, rounding_error
    exact = np.zeros(5)
    ref = np.array([1e-9, -2e-9, 0.0, 1e-9, 0.0])  # the program's float32 run: noise of 2e-9
    tol = 1e-4
    ok, own = rounding_error(ref + 2e-9, ref, exact, tol)
    assert own == pytest.approx(2e-9) and ok == pytest.approx(2e-9 / (NOISE_FACTOR * 2e-9 / tol))
    assert ok <= tol
    bad, _ = rounding_error(ref + 2 * NOISE_FACTOR * 2e-9, ref, exact, tol)
    assert bad == pytest.approx(2 * tol)
    # a program that is exact in float32 leaves the relative error as it was
    same, own = rounding_error(np.array([1.0, 2.0]), np.array([1.0, 2.5]), np.array([1.0, 2.5]), tol)
    assert own == 0.0 and same == pytest.approx(0.5 / 2.5)
