"""Shared fixtures for campaign tests: small configs, running the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def small_config(name: str, db: str, **over) -> dict:
    cfg = {
        "name": name,
        "workload": {"name": "mlp", "params": {"batch": 64, "widths": [256, 1024, 256]}},
        "hardware": "h100-sxm-8",
        "objectives": ["makespan", "peak_memory"],
        "search": {"islands": 2, "population": 12, "steps_per_task": 60, "seed": 3},
        "budget": {"evaluations": 1500},
        "cluster": {"workers": 1},
        "storage": {"url": db},
        "checkpoint_seconds": 0.5,
        # Tests count archived rows; on a loaded machine a campaign can outlive the default
        # grace period. Retention's own tests turn it on (tests/farm/test_retention_campaign.py).
        "retention": {"enabled": False},
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


def write_config(tmp_path: Path, cfg: dict) -> Path:
    p = tmp_path / f"{cfg['name']}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def cli(*args: str, timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "optimizer.cli", *args], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=str(ROOT))
    if check and res.returncode != 0:
        raise AssertionError(f"tapestry {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return res


def popen_cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "optimizer.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT), start_new_session=True)


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "farm.db")
