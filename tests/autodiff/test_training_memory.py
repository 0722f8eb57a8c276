"""Memory of a real training step, by hand: Llama-2 7B, AdamW, bf16 with fp32 master weights and
states, batch 8 x seq 4096, fused attention, on one H100 node (``h100-sxm-8``, 80 GB per GPU).

Per parameter the step keeps 12 bytes of loop-carried state (fp32 master weight, AdamW m and v)
plus transient bf16 copies of weights and gradients (2 + 2 bytes): the familiar 16 bytes per
parameter, 108 GB for N = 6.74e9. The IR has no replicated computation (shards partition an
op's index space), so the state of every parameter has exactly one home: either whole (here on
device 0, the state of plain data parallelism held once) or sharded over the data-parallel group
(ZeRO-3/FSDP). Whole state alone is 12·N = 80.9 GB on its device: infeasible. Sharded 8 ways
it is 12·N/8 = 10.1 GB per device and the step fits.
"""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.evaluate import Evaluator
from ir import workloads
from ir.autodiff import training_step
from ir.rewrites import fuse_attention
from tests.autodiff.plans import data_parallel

pytestmark = pytest.mark.slow  # a 32-layer, 3,100-op step: about a minute


@pytest.fixture(scope="module")
def step():
    fwd = workloads.build("llama", preset="llama2-7b", batch=8, dtype="bfloat16")
    for i in range(32):
        fwd = fuse_attention(fwd, f"l{i}.attn_qk")
    return training_step(fwd, loss="cross_entropy", optimizer="adamw")


def test_llama2_7b_state_whole_is_infeasible_and_zero_sharded_fits(step):
    n_params = sum(int(np.prod(t.shape)) for t in step.tensors.values() if t.role == "parameter")
    assert n_params == 6_738_415_616  # Llama-2 7B (Touvron et al. 2023): 6.74 B
    for p in ("l0_Wq", "l0_Wq.m", "l0_Wq.v"):
        assert step.tensors[p].dtype == "float32"
    state = sum(int(np.prod(t.shape)) * 4 for t in step.tensors.values() if t.role in ("parameter", "state"))
    assert state == 12 * n_params
    ev = Evaluator("h100-sxm-8")

    batch_rows = 2 * 4096 * 4  # each device also holds its sequence of token ids and of labels (int32)
    whole = ev(data_parallel(step, 8, batch=8, zero=False), keep=True)
    resident = whole.lowered.resident
    assert resident[0] == 12 * n_params + batch_rows  # 80.9 GB of state on device 0
    np.testing.assert_array_equal(resident[1:], batch_rows)
    assert not whole.feasible and whole.peak_memory_per_device[0] > 80e9

    zero = ev(data_parallel(step, 8, batch=8, zero=True), keep=True)
    resident = zero.lowered.resident
    assert resident.sum() == 12 * n_params + 8 * batch_rows
    np.testing.assert_allclose(resident, 12 * n_params / 8, rtol=2e-3)  # 10.1 GB each (near-equal splits)
    assert zero.feasible and zero.peak_memory < 80e9
    assert zero.makespan < whole.makespan  # the sharded update runs on all eight devices
