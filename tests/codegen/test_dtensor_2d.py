"""DTensor placements over 2-D meshes for plans laid out by ``layout{...}`` on ``ir.mesh`` meshes:
DP x TP on a (dp, tp) mesh, the reverse, a refusal for a pipeline, and (slow, with torch) real
DTensors built on a CPU gloo mesh from the placements hold exactly the plan's boxes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnx")

from costmodel.transfers import transfer_plan  # noqa: E402
from executor.codegen.dtensor import _bounding, _held, dtensor_placements, expected_box  # noqa: E402
from ir.importers.onnx import import_onnx  # noqa: E402
from ir.mesh import Mesh  # noqa: E402
from ir.rewrites.layout import layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "importers"))
import codegen_plans as plans  # noqa: E402
import onnx_models  # noqa: E402


@pytest.fixture(scope="module")
def mlp():
    return import_onnx(onnx_models.mlp(), {"batch": 8})[0]


def _placements(g, **kw):
    return dtensor_placements(g, transfer_plan(g, 4).to_json()["residency"], **kw)


def test_expected_box_is_torch_chunk_outer_first():
    # 10 rows over a 2x2 mesh sharded twice: chunk(10, 2) = 5, 5; chunk(5, 2) = 3, 2
    assert [expected_box([10], ["Shard(0)", "Shard(0)"], [2, 2], c)[0][0] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]] \
        == [0, 3, 5, 8]
    assert expected_box([7, 4], ["Replicate()", "Shard(1)"], [2, 2], (1, 1)) == ((0, 2), (7, 4))


def test_dp_by_tp_layout(mlp):
    """layout{mesh=2x2,use=b.t}: the batch over the outer mesh dim, Megatron over the inner one."""
    g = layout(mlp, "all", Mesh((2, 2), 4), ("b", "t"))
    p = _placements(g, mesh=Mesh((2, 2), 4), axis_names=("b", "t"))
    assert p["expressible"] and p["mesh"]["names"] == ["dp", "tp"] and p["mesh"]["shape"] == [2, 2]
    t = p["tensors"]
    assert t["x"]["placements"] == ["Shard(0)", "Replicate()"]
    assert t["W1"]["placements"] == ["Replicate()", "Shard(1)"]  # column parallel
    assert t["a1"]["placements"] == ["Shard(0)", "Shard(1)"]  # TP x DP: (Shard(0), Shard(1))
    assert t["W3"]["placements"] == ["Replicate()", "Shard(0)"]  # row parallel
    assert t["fc2.out@before_accumulate"]["placements"] == ["Shard(0)", "Partial()"]
    # chosen without being told: 2x2 expresses every tensor, 1-D does not
    auto = _placements(g)
    assert auto["mesh"]["shape"] == [2, 2] and auto["expressible"]
    assert not _placements(g, mesh=[4])["expressible"]


def test_tp_by_dp_layout_swaps_the_mesh_dims(mlp):
    g = layout(mlp, "all", Mesh((2, 2), 4), ("t", "b"))
    t = _placements(g, mesh=Mesh((2, 2), 4), axis_names=("t", "b"))["tensors"]
    assert t["a1"]["placements"] == ["Shard(1)", "Shard(0)"]
    assert t["fc2.out@before_accumulate"]["placements"] == ["Partial()", "Shard(0)"]


def test_data_parallel_stays_one_dimensional(mlp):
    p = _placements(plans.data_parallel(mlp))
    assert p["mesh"]["shape"] == [4] and p["tensors"]["x"]["placements"] == ["Shard(0)"]


def test_not_expressible_reasons(mlp):
    """A pipeline needs sub-meshes; a 1-D mesh cannot hold a 2-D tiling; a mesh of the wrong size
    is refused."""
    p = _placements(plans.pipeline(mlp))
    assert not p["expressible"] and "sub-mesh" in p["tensors"]["a2"]["why"]
    g = layout(mlp, "all", Mesh((2, 2), 4), ("b", "t"))
    why = _placements(g, mesh=[4])["tensors"]["a1"]["why"]
    assert "change in tensor dims [0, 1]" in why
    with pytest.raises(ValueError, match="does not cover"):
        _placements(g, mesh=[2, 3])


@pytest.mark.slow
def test_placements_build_real_dtensors_on_gloo(tmp_path, mlp):
    pytest.importorskip("torch")
    g = layout(mlp, "all", Mesh((2, 2), 4), ("b", "t"))
    residency = transfer_plan(g, 4).to_json()["residency"]
    p = dtensor_placements(g, residency, mesh=Mesh((2, 2), 4), axis_names=("b", "t"))
    held, partial_of = _held(g, residency)
    rank = {d: r for r, d in enumerate(p["mesh"]["devices"])}

    def boxes(name):
        return {str(rank[d]): [list(x) for x in _bounding(b)] for d, b in held[name].items()}

    tensors = [{"name": n, "shape": list(g.tensors[n].shape), "placements": e["placements"], "boxes": boxes(n)}
               for n, e in p["tensors"].items() if n in g.tensors and e["expressible"]]
    partials = [{"name": part, "shape": list(g.tensors[part].shape),
                 "placements": p["tensors"][out + "@before_accumulate"]["placements"], "boxes": boxes(part)}
                for part, out in partial_of.items()]
    assert len(tensors) == len(g.tensors) and len(partials) == 2
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"mesh": {"shape": p["mesh"]["shape"], "names": p["mesh"]["names"]},
                                "tensors": tensors, "partials": partials}))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "codegen" / "dtensor_gloo_check.py"), str(spec)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and f"OK {len(tensors) + len(partials)}" in r.stdout, r.stderr[-3000:]
