"""Generated programs over torch.distributed (``--backend torch``): gloo on the host, 4 ranks as
separate processes, for a data-parallel, a Megatron and a pipelined plan of the imported MLP,
checked against the unsharded program. NCCL needs a GPU per rank (none here): its safety rests on
the posting order, which the structural test below checks for every plan."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")

from costmodel.transfers import transfer_plan  # noqa: E402
from executor.codegen import CodegenError, generate_program  # noqa: E402
from executor.codegen.program import global_order  # noqa: E402
from executor.run import execute, random_inputs  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.importers.values import save_values  # noqa: E402
from ir.rewrites import random_walk, unshard  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "importers"))
import codegen_plans as plans  # noqa: E402
import onnx_models  # noqa: E402

PLANS = [plans.data_parallel, plans.megatron, plans.pipeline]
IDS = ["data_parallel", "megatron", "pipeline"]


@pytest.fixture(scope="module")
def program():
    return import_onnx(onnx_models.mlp(), {"batch": 8})


def _source(g) -> str:
    tp = transfer_plan(g, 4).to_json()
    return generate_program(g, tp["transfers"], tp["residency"])


def _pair_sequences(src: str) -> tuple[dict, dict]:
    """Per (src, dst) pair, the transfer indices in the order the sender posts its sends and the
    order the receiver posts its receives, read from the generated device functions."""
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    device = None
    for line in src.splitlines():
        m = re.match(r"def device_(\d+)\(dev\):", line)
        if m:
            device = int(m.group(1))
        m = re.match(r"    dev\.(send|recv)\((\d+), (\d+),", line)
        if m and device is not None:
            k, other = int(m.group(2)), int(m.group(3))
            if m.group(1) == "send":
                sends.setdefault((device, other), []).append(k)
            else:
                recvs.setdefault((other, device), []).append(k)
    return sends, recvs


@pytest.mark.parametrize("seed", [3, 11])
def test_every_pair_posts_sends_and_receives_in_one_order(program, seed):
    """NCCL matches a pair's messages in posting order (no tags): for every ordered device pair the
    receiver's receives must come in the sender's send order, for the three plans and for random
    plans (splits, fusions, split reductions) of an attention block."""
    gpt, _ = import_onnx(onnx_models.gpt2_block(), {"batch": 2, "seq": 8})
    graphs = [make(program[0]) for make in PLANS] + [random_walk(gpt, np.random.default_rng(seed), 4, 40)]
    for g in graphs:
        sends, recvs = _pair_sequences(_source(g))
        assert sends == recvs
    assert any(len(v) > 1 for v in sends.values())


def test_global_order_refuses_a_cycle():
    order = {0: [("a", 0), ("b", 0)], 1: [("c", 0), ("d", 0)]}
    assert global_order(order, [(("a", 0), ("d", 0))]) == [("a", 0), ("c", 0), ("b", 0), ("d", 0)]
    with pytest.raises(CodegenError, match="cycle"):
        global_order(order, [(("b", 0), ("c", 0)), (("d", 0), ("a", 0))])


def test_torch_backend_without_torch_is_a_clear_error(tmp_path, program):
    """Where PyTorch is not installed the generated program says so (exit 2), no traceback."""
    prog = tmp_path / "run_plan.py"
    prog.write_text(_source(plans.megatron(program[0])))
    code = (f"import sys; sys.modules['torch'] = None; sys.argv = ['run_plan.py', '--backend', 'torch']; "
            f"import runpy; runpy.run_path({str(prog)!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "needs PyTorch" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("make", PLANS, ids=IDS)
def test_gloo_program_reproduces_unsharded_outputs(tmp_path, program, make):
    pytest.importorskip("torch")
    g0, values = program
    g = make(g0)
    src = _source(g)
    ast.parse(src)
    prog = tmp_path / "run_plan.py"
    prog.write_text(src)
    save_values(values, tmp_path / "program.npz")
    r = subprocess.run([sys.executable, str(prog), "--backend", "torch", "--check", "--values",
                        str(tmp_path / "program.npz"), "--out", str(tmp_path / "out.npz")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout
    assert "torch.distributed: gloo, 4 ranks" in r.stdout and "PASS" in r.stdout
    inputs = random_inputs(g0, 0)
    inputs.update(values)
    ref = execute(unshard(g0), inputs)
    with np.load(tmp_path / "out.npz") as z:
        np.testing.assert_allclose(z["y"], ref["y"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_gloo_training_step_with_state_transfers(tmp_path, program):
    """A ZeRO-sharded training step: the parameters' gathers (state transfers, first in the
    global order) and the gradient transfers go over gloo; the new parameters match."""
    pytest.importorskip("torch")
    from ir.autodiff import training_step

    step = plans.zero_sharded(training_step(program[0], loss="mse", optimizer="sgd"))
    tp = transfer_plan(step, 4).to_json()
    assert tp["state_transfers"]
    prog = tmp_path / "run_step.py"
    prog.write_text(generate_program(step, tp["transfers"], tp["residency"], state_transfers=tp["state_transfers"]))
    sends, recvs = _pair_sequences(prog.read_text())
    assert sends == recvs
    save_values(program[1], tmp_path / "program.npz")
    r = subprocess.run([sys.executable, str(prog), "--backend", "torch", "--check", "--values",
                        str(tmp_path / "program.npz")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "PASS" in r.stdout and "W1.next" in r.stdout, r.stderr[-3000:]
