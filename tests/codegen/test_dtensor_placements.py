"""DTensor placements of plans: data parallel is Shard(0)/Replicate(), Megatron's hidden features
are Shard(1) with the row-parallel partials Partial(), and pipeline stages are not expressible on
one mesh (with the reason)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("onnx")

from costmodel.transfers import transfer_plan  # noqa: E402
from executor.codegen.dtensor import dtensor_placements  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "importers"))
import codegen_plans as plans  # noqa: E402
import onnx_models  # noqa: E402


@pytest.fixture(scope="module")
def mlp():
    return import_onnx(onnx_models.mlp(), {"batch": 8})[0]


def _placements(g):
    return dtensor_placements(g, transfer_plan(g, 4).to_json()["residency"])


def test_data_parallel(mlp):
    p = _placements(plans.data_parallel(mlp))
    assert p["expressible"] and p["mesh"]["devices"] == [0, 1, 2, 3]
    t = p["tensors"]
    assert t["x"]["placements"] == ["Shard(0)"] and t["y"]["placements"] == ["Shard(0)"]
    assert t["W1"]["placements"] == ["Replicate()"] and t["b3"]["placements"] == ["Replicate()"]


def test_megatron(mlp):
    g = plans.megatron(mlp)
    p = _placements(g)
    t = p["tensors"]
    assert t["W1"]["placements"] == ["Shard(1)"] and t["a1"]["placements"] == ["Shard(1)"]
    assert t["x"]["placements"] == ["Replicate()"]
    partial = g.ops["fc2.acc"].inputs[0][1]
    assert t[partial]["placements"] == ["Shard(0)"]
    assert t["fc2.out@before_accumulate"]["placements"] == ["Partial()"]
    assert t["fc2.out"]["placements"] == ["Shard(0)"]  # the accumulate is split: a reduce-scatter
    assert "a2" in p["not_expressible"]  # the tail runs on device 0 only


def test_pipeline_not_expressible(mlp):
    p = _placements(plans.pipeline(mlp))
    assert not p["expressible"]
    assert p["tensors"]["a2"]["devices"] == [2] and "sub-mesh" in p["tensors"]["a2"]["why"]
