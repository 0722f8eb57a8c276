"""``workload: {onnx: model.onnx, params: {...}}`` in a campaign, and ``tapestry export --program``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

onnx = pytest.importorskip("onnx")

import onnx_models  # noqa: E402

from optimizer.campaign.config import ConfigError, parse_config  # noqa: E402

TAPESTRY = [sys.executable, "-c", "from optimizer.cli import main; main()"]


def _config(tmp_path: Path, **workload) -> dict:
    return {"name": "onnx-mlp", "workload": workload, "hardware": "h100-sxm-8", "objectives": ["makespan"],
            "search": {"islands": 1, "population": 8, "steps_per_task": 10, "seed": 0},
            "budget": {"evaluations": 30, "wall_time": 30}, "cluster": {"workers": 1},
            "storage": {"url": str(tmp_path / "farm.db")}, "sampling": {"rate": 0.0}}


def test_config_onnx_workload(tmp_path):
    onnx.save(onnx_models.mlp(), str(tmp_path / "mlp.onnx"))
    cfg = parse_config(_config(tmp_path, onnx="mlp.onnx", params={"batch": 8}), "t", tmp_path)
    assert cfg.workload.onnx == str(tmp_path / "mlp.onnx")
    with pytest.raises(ConfigError, match="workload.onnx"):
        parse_config(_config(tmp_path, onnx="missing.onnx"), "t", tmp_path)
    with pytest.raises(ConfigError, match="exactly one"):
        parse_config(_config(tmp_path, onnx="mlp.onnx", name="mlp"), "t", tmp_path)


@pytest.mark.slow
def test_campaign_on_an_onnx_model_exports_programs(tmp_path):
    onnx.save(onnx_models.mlp(), str(tmp_path / "mlp.onnx"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_config(tmp_path, onnx="mlp.onnx", params={"batch": 8})))
    r = subprocess.run([*TAPESTRY, "run", str(cfg)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "out"
    r = subprocess.run([*TAPESTRY, "export", "onnx-mlp", "--db", str(tmp_path / "farm.db"), "--out", str(out),
                        "--program"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    progs = sorted((out / "plans").glob("*.py"))
    assert progs and (out / "program.npz").exists()
    assert all(p.with_suffix(".placements.json").exists() for p in progs)
    for p in progs:  # running generated programs is tests/codegen's job; here: valid Python, the plan inside
        assert "PLAN = json.loads" in p.read_text()
        ast.parse(p.read_text())
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**_config(tmp_path, onnx="mlp.onnx", params={"batch": 8, "seq": 3}),
                                   "name": "bad"}))
    r = subprocess.run([*TAPESTRY, "run", str(bad)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and "seq" in r.stderr and "Traceback" not in r.stderr
