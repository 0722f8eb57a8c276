"""Generated programs run as separate processes (NumPy, 4 devices) and reproduce the unsharded
outputs for a data-parallel, a Megatron and a pipelined plan of an imported ONNX MLP."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")

from costmodel.transfers import transfer_plan  # noqa: E402
from executor.codegen import CodegenError, generate_program  # noqa: E402
from executor.run import execute, random_inputs  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.importers.values import save_values  # noqa: E402
from ir.rewrites import random_walk, unshard  # noqa: E402
from optimizer.cli.import_cmds import write_plan_program  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "importers"))
import codegen_plans as plans  # noqa: E402
import onnx_models  # noqa: E402


@pytest.fixture(scope="module")
def program():
    return import_onnx(onnx_models.mlp(), {"batch": 8})


def _run(tmp_path: Path, g, values, transfers=None) -> subprocess.CompletedProcess:
    tp = transfer_plan(g, 4).to_json()
    src = generate_program(g, tp["transfers"] if transfers is None else transfers, tp["residency"])
    ast.parse(src)  # the program is valid Python
    prog = tmp_path / "run_plan.py"
    prog.write_text(src)
    save_values(values, tmp_path / "program.npz")
    return subprocess.run([sys.executable, str(prog), "--check", "--values", str(tmp_path / "program.npz"),
                           "--out", str(tmp_path / "out.npz")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("make", [plans.data_parallel, plans.megatron, plans.pipeline],
                         ids=["data_parallel", "megatron", "pipeline"])
def test_generated_program_reproduces_unsharded_outputs(tmp_path, program, make):
    g0, values = program
    g = make(g0)
    assert len(g.devices) == 4
    r = _run(tmp_path, g, values)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout
    assert "PASS" in r.stdout
    # independent of the program's own check: its outputs equal our executor on the unsharded program
    inputs = random_inputs(g0, 0)
    inputs.update(values)
    ref = execute(unshard(g0), inputs)
    with np.load(tmp_path / "out.npz") as z:
        np.testing.assert_allclose(z["y"], ref["y"], rtol=1e-5, atol=1e-6)
    src = (tmp_path / "run_plan.py").read_text()
    assert "def fc1__s0(dev):" in src and "def device_3(dev):" in src
    n_transfers = len(transfer_plan(g, 4).transfers)
    assert src.count("dev.send(") == n_transfers == src.count("dev.recv(")
    if make is not plans.data_parallel:
        assert n_transfers > 0


def test_a_missing_transfer_fails_loudly(tmp_path, program):
    g = plans.megatron(program[0])
    tp = transfer_plan(g, 4).to_json()
    r = _run(tmp_path, g, program[1], transfers=tp["transfers"][1:])
    assert r.returncode == 1
    assert "not on this device" in r.stderr


def test_bad_transfer_refused(program):
    g = plans.megatron(program[0])
    tp = transfer_plan(g, 4).to_json()
    bad = [dict(tp["transfers"][0], producer="nope")]
    with pytest.raises(CodegenError, match="nope"):
        generate_program(g, bad, tp["residency"])


def test_training_step_with_sharded_state(tmp_path, program):
    """A ZeRO-sharded training step of the imported MLP: parameters start at their homes, the
    state transfers gather them where read, and the new parameters and loss match."""
    step = plans.zero_sharded(training_step(program[0], loss="mse", optimizer="sgd"))
    tp = transfer_plan(step, 4).to_json()
    assert tp["state_transfers"]
    src = generate_program(step, tp["transfers"], tp["residency"], state_transfers=tp["state_transfers"])
    assert src.count("# state transfer") == 2 * len(tp["state_transfers"])  # one send, one receive each
    prog = tmp_path / "run_step.py"
    prog.write_text(src)
    save_values(program[1], tmp_path / "program.npz")
    r = subprocess.run([sys.executable, str(prog), "--check", "--values", str(tmp_path / "program.npz")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "PASS" in r.stdout and "W1.next" in r.stdout, r.stderr[-3000:]


def test_random_plan_of_an_attention_block(tmp_path):
    """Whatever the search may produce (fusions, split reductions, retiles over 4 devices) on the
    imported GPT-2 block: the generated program, in the cost model's simulated order, matches."""
    g0, values = import_onnx(onnx_models.gpt2_block(), {"batch": 2, "seq": 8})
    g = random_walk(g0, np.random.default_rng(11), 4, 40)
    assert len(g.devices) > 1
    prog, _, _ = write_plan_program(g, tmp_path / "run_plan.py", "h100-sxm-8")
    save_values(values, tmp_path / "program.npz")
    r = subprocess.run([sys.executable, str(prog), "--check", "--values", str(tmp_path / "program.npz")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stderr[-3000:]


def test_check_compares_with_the_embedded_program(tmp_path):
    """The generated ``--check`` compared the outputs with the plan's own unsharded form, so a plan
    whose relu was edited into a gelu PASSed; it now compares with the program embedded by
    ``write_plan_program`` (from the plan file's provenance), and says which it used."""
    from ir import workloads
    from ir.graph import Op
    from ir.rewrites import place, split

    program = workloads.mlp(batch=8, widths=(12, 20, 10))
    g = place(split(program, "fc1", "n", 2), "fc1", (0, 1))
    act = g.ops["act1"]
    edited = g.with_ops({"act1": Op(act.name, "gelu", act.inputs, act.output, act.params, act.shards)})
    for plan, code, word in ((g, 0, "PASS"), (edited, 1, "FAIL")):
        prog, _, _ = write_plan_program(plan, tmp_path / "run_plan.py", None, program)
        r = subprocess.run([sys.executable, str(prog), "--check"], capture_output=True, text=True, cwd=ROOT,
                           timeout=300)
        assert r.returncode == code, r.stdout + r.stderr[-2000:]
        assert word in r.stdout and "the program the plan derives from" in r.stdout
    prog, _, _ = write_plan_program(edited, tmp_path / "run_plan.py")  # nothing embedded: the weaker check, said
    r = subprocess.run([sys.executable, str(prog), "--check"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "no program embedded" in r.stdout
