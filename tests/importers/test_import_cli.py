"""``tapestry import`` / ``verify`` / ``codegen``: files written, weights found by name, and one
clear error (exit 2, no traceback) for unsupported ops, bad files and unbindable dims."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

import onnx_models  # noqa: E402
from onnx import helper  # noqa: E402

from ir.importers.values import load_values  # noqa: E402
from ir.serialize import load  # noqa: E402
from optimizer.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> int:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    return int(e.value.code or 0)


@pytest.fixture()
def gpt2_file(tmp_path) -> Path:
    p = tmp_path / "gpt2.onnx"
    onnx.save(onnx_models.gpt2_block(), str(p))
    return p


def test_import_verify_codegen(tmp_path, gpt2_file, capsys):
    prog = tmp_path / "program.json"
    assert run_cli("import", str(gpt2_file), "-o", str(prog), "--set", "batch=2", "--set", "seq=4") == 0
    g = load(prog)
    vals = load_values(tmp_path / "program.npz")
    assert g.tensors["x"].shape == (2, 4, 16) and set(vals) == {n for n, t in g.tensors.items()
                                                                 if t.role == "parameter"}
    assert "attn.c_attn.W" in vals
    plan = tmp_path / "plan.json"
    assert run_cli("graph", "rewrite", str(prog), "split{op=h.0_attn_MatMul_qk,dim=1,parts=2}",
                   "place{op=h.0_attn_MatMul_qk,devices=[0,1]}", "-o", str(plan)) == 0
    capsys.readouterr()
    assert run_cli("verify", str(plan), "--values", str(tmp_path / "program.npz")) == 0
    assert "PASS" in capsys.readouterr().out
    out = tmp_path / "run_plan.py"
    assert run_cli("codegen", str(plan), "-o", str(out), "--hardware", "h100-sxm-8") == 0
    placements = json.loads((tmp_path / "run_plan.placements.json").read_text())
    assert placements["mesh"]["devices"] == [0, 1]
    assert placements["tensors"]["sc"]["placements"] == ["Shard(1)"]  # scores sharded by heads
    assert not placements["expressible"]  # the rest of the block runs on device 0 only
    r = subprocess.run([sys.executable, str(out), "--check", "--values", str(tmp_path / "program.npz")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stderr[-2000:]


def _expect_error(capsys, *args: str) -> str:
    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def test_errors_exit_2(tmp_path, gpt2_file, capsys):
    out = str(tmp_path / "p.json")
    err = _expect_error(capsys, "import", str(gpt2_file), "-o", out, "--set", "batch=2")
    assert "seq" in err and "--set" in err
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model" * 30)
    assert "not an ONNX model" in _expect_error(capsys, "import", str(bad), "-o", out)
    assert "does not exist" in _expect_error(capsys, "import", str(tmp_path / "nope.onnx"), "-o", out)
    x = helper.make_tensor_value_info("x", 1, [2, 3])
    m = helper.make_model(helper.make_graph([helper.make_node("Hardmax", ["x"], ["y"], name="hm")], "g", [x],
                                            [helper.make_tensor_value_info("y", 1, [2, 3])]),
                          opset_imports=[helper.make_opsetid("", 17)])
    unsup = tmp_path / "unsup.onnx"
    onnx.save(m, str(unsup))
    assert "Hardmax: hm" in _expect_error(capsys, "import", str(unsup), "-o", out)
    assert not Path(out).exists()
    assert "--example-input" in _expect_error(capsys, "import", "model.py:make", "-o", out)


def test_verify_finds_values_beside_the_program(tmp_path, gpt2_file, capsys):
    """Weights matter: the imported program with its own values differs from random weights."""
    prog = tmp_path / "program.json"
    assert run_cli("import", str(gpt2_file), "-o", str(prog), "--set", "batch=1", "--set", "seq=3") == 0
    vals = load_values(tmp_path / "program.npz")
    ref = onnx_models.gpt2_block()
    np.testing.assert_array_equal(vals["ln1.g"], onnx.numpy_helper.to_array(ref.graph.initializer[0]))
    capsys.readouterr()
    assert run_cli("verify", str(prog)) == 0


def test_import_train_writes_a_training_step(tmp_path, gpt2_file, capsys):
    """``--train mse --optimizer sgd``: the program is the step (loss, gradients, updates) of the
    imported forward, and it verifies with the imported weights; bad values exit 2."""
    prog = tmp_path / "step.json"
    assert run_cli("import", str(gpt2_file), "-o", str(prog), "--set", "batch=2", "--set", "seq=4",
                   "--train", "mse", "--optimizer", "sgd") == 0
    g = load(prog)
    assert {"target", "loss", "attn.c_attn.W.next"} <= set(g.tensors)
    assert {o.kernel for o in g.ops.values()} >= {"mse_loss", "sgd_update"}
    capsys.readouterr()
    assert run_cli("verify", str(prog)) == 0 and "PASS" in capsys.readouterr().out
    out = str(tmp_path / "p.json")
    assert "mse or cross_entropy" in _expect_error(capsys, "import", str(gpt2_file), "-o", out, "--set", "batch=2",
                                                   "--set", "seq=4", "--train", "nll")
    assert "--train" in _expect_error(capsys, "import", str(gpt2_file), "-o", out, "--set", "batch=2",
                                      "--set", "seq=4", "--optimizer", "sgd")
    assert "optimizer 'lion'" in _expect_error(capsys, "import", str(gpt2_file), "-o", out, "--set", "batch=2",
                                               "--set", "seq=4", "--train", "mse", "--optimizer", "lion")
    assert not Path(out).exists()
