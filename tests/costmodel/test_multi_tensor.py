"""Optimizer updates and master-weight casts priced as multi-tensor kernels (``Lowerer(runtime=True)``,
the ``Evaluator``'s): each shard pays a 36th of a launch (PyTorch's foreach/fused AdamW, apex's
FusedAdam); the executor-faithful lowering (``runtime=False``, what measurements are predicted
with) still pays a launch per op, as this repository's executor runs them."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel import Evaluator
from costmodel.lowering import MULTI_TENSOR, Lowerer, multi_tensor
from costmodel.presets import PRESETS
from ir import workloads
from optimizer.search.baselines import zero3

HW = PRESETS["h100-sxm-8"]


def _step():
    return workloads.build("gpt", layers=2, d_model=128, heads=4, seq=32, batch=4, vocab=256, mode="train",
                           dtype="bfloat16", optimizer="adamw")


def test_only_optimizer_updates_and_master_casts_are_multi_tensor():
    g = _step()
    chosen = {n for n, o in g.ops.items() if multi_tensor(g, o)}
    params = [n for n, t in g.tensors.items() if t.role == "parameter"]
    # per parameter: its bf16 copy's cast, the two moments, the update; not the gradient's cast
    assert len(chosen) == 4 * len(params)
    assert {f"{p}.cast" for p in params} <= chosen and not any(n.endswith(".cast.dx") for n in chosen)
    assert {g.ops[n].kernel for n in chosen} == {"cast", "adam_moment", "adamw_update"}


@pytest.mark.parametrize("plan", ["single", "zero3"])
def test_each_such_shard_pays_a_36th_of_a_launch_at_runtime_only(plan):
    g = _step() if plan == "single" else zero3(_step(), 8)
    fast, slow = Lowerer(HW, runtime=True).lower(g), Lowerer(HW).lower(g)
    nc = fast.n_compute
    ops = list(fast.op_names)
    mt = np.repeat([multi_tensor(g, g.ops[n]) for n in ops], np.diff(fast.op_offsets))
    launch = HW.launch_overhead_for("elementwise")
    saved = slow.dur[:nc] - fast.dur[:nc]
    np.testing.assert_allclose(saved[mt], launch * (1 - 1 / MULTI_TENSOR), rtol=1e-9)
    np.testing.assert_array_equal(saved[~mt], 0.0)
    e = Evaluator(HW)(g)
    assert e.lower_bound <= e.makespan
