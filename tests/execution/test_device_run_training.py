"""Device-aware runs of training plans: loop-carried state starts at its home and is gathered
where other devices read it (the transfer plan's ``state_transfers``); dropping a gather fails."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.transfers import transfer_plan
from executor.device_run import IncompleteCommunication, run_on_devices
from executor.run import execute, outputs, random_inputs
from executor.verify import rel_error
from ir import workloads
from tests.autodiff.plans import data_parallel


@pytest.fixture(scope="module")
def zero_plan():
    step = workloads.build("gpt", mode="train", layers=1, d_model=8, heads=2, d_ff=12, vocab=10, seq=4, batch=4)
    return step, data_parallel(step, 2, batch=4, zero=True)


def test_zero_sharded_step_runs_device_aware(zero_plan):
    step, plan = zero_plan
    tp = transfer_plan(plan, 2)
    assert tp.state_transfers, "sharded state read on the other device must be gathered"
    inputs = random_inputs(step, 0)
    run = run_on_devices(plan, tp.transfers, tp.residency, inputs=inputs, state_transfers=tp.state_transfers,
                         timing=True, repeats=1, warmup=0)
    ref = execute(step, inputs)
    for n in outputs(step):
        assert rel_error(run.outputs[n], np.asarray(ref[n])) < 1e-5, n
    assert sum(t["state"] for t in run.transfers) == len(tp.state_transfers)


def test_missing_gather_fails_loudly(zero_plan):
    step, plan = zero_plan
    tp = transfer_plan(plan, 2)
    with pytest.raises(IncompleteCommunication):
        run_on_devices(plan, tp.transfers, tp.residency, state_transfers=tp.state_transfers[1:])
