"""Megatron tensor parallelism vs data parallelism, redone for a training step (issue 10).

``mlp(batch=T, widths=[H, 4H, H])`` trained with SGD (float32) on ``h100-sxm-8``. Data
parallelism (``ir.rewrites.layout`` over the batch: the ZeRO/FSDP form, the only one a plan can
express, see ``optimizer.search.baselines``) reduces every weight gradient (a reduce-scatter:
the update op is sharded like the accumulate) and gathers every parameter where it is read (an
all-gather), so per step it moves ``2 · 7 · S_w`` bytes in point-to-point terms, ``S_w`` =
``4 · (8H² + 5H)`` the parameter bytes, and its communication alone takes at least the two NCCL
ring collectives ``2 · (7/8 · S_w / B + 7·α)``. Tensor parallelism splits the weights and moves
activations only: under the forward-only model data parallelism moved nothing and won every
large-batch case; with the gradients, TP inside the node wins a large block at small batch, and
DP still wins a small block at a large batch.
"""

from __future__ import annotations

import pytest

from costmodel import Evaluator
from costmodel.collectives import collective_time
from costmodel.presets import PRESETS
from ir import workloads
from ir.mesh import Mesh
from ir.rewrites import unshard
from ir.rewrites.layout import layout

HW = PRESETS["h100-sxm-8"]
MESH = Mesh((8,), 8)


def plans(T, H):
    g = workloads.build("mlp", batch=T, widths=[H, 4 * H, H], mode="train", optimizer="sgd")
    g = unshard(g)
    return layout(g, "all", MESH, ("b",)), layout(g, "all", MESH, ("t",))


def weight_bytes(H):
    return 4.0 * (8 * H * H + 5 * H)


@pytest.fixture(scope="module")
def ev():
    return Evaluator(HW)


@pytest.mark.parametrize("T", [8, 64, 512])
def test_large_block_small_batch_tensor_parallel_wins(ev, T):
    H = 4096
    dp, tp = (ev(p) for p in plans(T, H))
    S = weight_bytes(H)
    comm = collective_time("reduce_scatter", S, 8, HW).seconds + collective_time("all_gather", S, 8, HW).seconds
    assert dp.bytes_moved == pytest.approx(2 * 7 * S)  # every gradient reduced, every weight gathered
    assert dp.makespan >= comm
    assert tp.makespan < 0.5 * dp.makespan
    assert tp.bytes_moved < 0.05 * dp.bytes_moved
    assert tp.mfu > dp.mfu and 0 < dp.mfu < tp.mfu < 1


def test_small_block_large_batch_data_parallel_wins(ev):
    dp, tp = (ev(p) for p in plans(16384, 1024))
    assert dp.makespan < tp.makespan
    assert dp.bytes_moved == pytest.approx(2 * 7 * weight_bytes(1024))


def test_forward_only_data_parallel_moves_nothing_training_moves_the_gradients(ev):
    T, H = 64, 1024
    g = workloads.build("mlp", batch=T, widths=[H, 4 * H, H])
    fwd = layout(unshard(g), "all", MESH, ("b",))
    assert ev(fwd).bytes_moved == 0
    dp, _ = plans(T, H)
    e = ev(dp, keep=True)
    assert e.bytes_moved > 0
    # the state lives sharded: each device holds an eighth of the weights (plus its batch rows)
    assert e.memory_floor == pytest.approx(weight_bytes(H) / 8)
    assert e.lowered.resident.min() >= weight_bytes(H) / 8
