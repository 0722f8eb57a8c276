"""``tapestry execute`` / ``optimizer.realrun.grid``: a 4-device plan on a 2-worker local Dask cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from costmodel.transfers import transfer_plan
from executor.device_run import IncompleteCommunication
from ir import workloads
from ir.rewrites import place, split
from ir.serialize import dumps

ROOT = Path(__file__).resolve().parents[2]


def four_device_plan():
    g = workloads.mlp(batch=8, widths=(12, 20, 10))
    g = place(split(g, "fc1", "n", 4), "fc1", (0, 1, 2, 3))
    g = place(split(g, "act1", "d1", 2), "act1", (1, 2))
    return place(split(g, "fc2", "o", 2), "fc2", (3, 0))


@pytest.fixture(scope="module")
def client():
    from optimizer.campaign.cluster import grid_client

    with grid_client(None, 2) as c:
        yield c


def test_plan_passes_on_two_workers_and_moves_the_planned_boxes(client):
    from optimizer.realrun.grid import run_plan_on_grid

    g = four_device_plan()
    assert g.devices == {0, 1, 2, 3}
    rep = run_plan_on_grid(g, client)
    assert rep.ok and rep.max_rel_error < 1e-5, str(rep)
    assert len(rep.workers) == 2
    assert rep.device_worker[0] == rep.device_worker[2] == rep.workers[0]
    assert rep.device_worker[1] == rep.device_worker[3] == rep.workers[1]
    tp = transfer_plan(g)
    assert rep.extract_tasks == sum(len(t["boxes"]) for t in tp.transfers) > 0
    assert rep.transfer_bytes == tp.transfer_bytes
    assert rep.op_tasks == 4 + 2 + 2
    assert "PASS" in str(rep)


def test_a_dropped_transfer_fails_on_the_worker(client):
    from optimizer.realrun.grid import run_plan_on_grid

    g = four_device_plan()
    tp = transfer_plan(g)
    tp.transfers = tp.transfers[1:]
    with pytest.raises(IncompleteCommunication):
        run_plan_on_grid(g, client, transfers=tp)


def _execute(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "optimizer.cli", "execute", *args, "--workers", "2"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=str(ROOT))


def test_execute_command_with_a_local_cluster(tmp_path):
    plan = tmp_path / "plan.json"
    program = workloads.mlp(batch=8, widths=(12, 20, 10))
    plan.write_text(dumps(four_device_plan(), program=program) + "\n")
    res = _execute(str(plan), "--json", str(tmp_path / "r.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    out = " ".join(res.stdout.split())
    assert "PASS" in out and "4 plan devices on 2 workers" in out and "the embedded program" in out
    assert "Traceback" not in res.stderr and "already in use" not in res.stderr
    import json

    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True


def test_execute_compares_with_the_program_not_the_plan_itself(tmp_path):
    """An edited plan (its relu made a gelu) agrees with its own unsharded form: execute PASSed it
    where verify FAILs it. It is now compared with the program it derives from, as verify does;
    a plan naming no program is refused (exit 2) unless --self-check asks for the weaker check."""
    from ir.graph import Op

    program = workloads.mlp(batch=8, widths=(12, 20, 10))
    g = four_device_plan()
    act = g.ops["act1"]
    edited = g.with_ops({"act1": Op(act.name, "gelu", act.inputs, act.output, act.params, act.shards)})
    bad = tmp_path / "edited.json"
    bad.write_text(dumps(edited, program=program) + "\n")
    res = _execute(str(bad))
    assert res.returncode == 1, res.stdout + res.stderr[-2000:]
    assert "FAIL" in res.stdout and "the embedded program" in " ".join(res.stdout.split())
    bare = tmp_path / "bare.json"
    bare.write_text(dumps(edited) + "\n")
    res = _execute(str(bare))
    assert res.returncode == 2 and "does not say which program" in " ".join(res.stderr.split())
    assert "Traceback" not in res.stderr
    res = _execute(str(bare), "--self-check")
    assert res.returncode == 0 and "own unsharded form" in " ".join(res.stdout.split())
    res = _execute(str(bad), "--reference", str(bare))  # a program other than the one the plan names
    assert res.returncode == 2 and "pass the program the plan was built from" in " ".join(res.stderr.split())


def test_zero_sharded_training_step_gathers_state_on_the_grid(client):
    from optimizer.realrun.grid import run_plan_on_grid
    from tests.autodiff.plans import data_parallel

    step = workloads.build("gpt", mode="train", layers=1, d_model=8, heads=2, d_ff=12, vocab=10, seq=4, batch=4)
    g = data_parallel(step, 2, batch=4, zero=True)
    tp = transfer_plan(g)
    assert tp.state_transfers
    rep = run_plan_on_grid(g, client)
    assert rep.ok, str(rep)
    assert rep.extract_tasks == sum(len(t["boxes"]) for t in tp.transfers + tp.state_transfers)
