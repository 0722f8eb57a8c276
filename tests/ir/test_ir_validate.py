"""Validation: one hand-broken graph per rule, each asserting the issue code and the path.

Every broken graph starts as a valid graph (``GraphBuilder``/workload), goes through its JSON
document, is edited there, and is loaded with ``from_json(..., validate=False)``.
"""

from __future__ import annotations

import json

import pytest

from ir import workloads
from ir.builder import GraphBuilder
from ir.graph import Graph, Tensor
from ir.kernels import REGISTRY, TensorSpec
from ir.kernels.base import Kernel, Signature
from ir.serialize import loads
from ir.validate import InvalidGraph, check, validate
from ir.zspace import Projection


@pytest.fixture
def g() -> Graph:
    """mlp: x[8,12] -> fc1 (linear, index [8,16]) -> act1 (relu) -> fc2 (linear, index [8,6])."""
    return workloads.mlp(batch=8, widths=(12, 16, 6))


def one(kit, h: Graph, code: str, where: str) -> None:
    """``h`` has an issue ``code`` whose path names ``where``; loading its JSON refuses it too."""
    found = kit.issues_with(h, code)
    assert found, f"no {code!r} issue; got {[str(i) for i in validate(h)]}"
    assert any(where in i.path for i in found), [str(i) for i in found]
    with pytest.raises(InvalidGraph) as e:
        loads(json.dumps(h.to_json()))
    assert any(i.code == code for i in e.value.issues)
    assert f"[{code}]" in str(e.value)


def test_valid_graphs_have_no_issues(g):
    assert validate(g) == []
    for name in ("mlp", "transformer", "convnet"):
        assert validate(workloads.build(name)) == []


def test_bad_shape(kit, g):
    h = kit.edited(g, lambda d: kit.tensor_json(d, "x").update(shape=[8, 0]))
    one(kit, h, "bad-shape", "tensors.x")
    h = kit.edited(g, lambda d: kit.tensor_json(d, "b1").update(shape=[]))
    one(kit, h, "bad-shape", "tensors.b1")


def test_bad_dtype(kit, g):
    h = kit.edited(g, lambda d: kit.tensor_json(d, "W1").update(dtype="float64"))
    one(kit, h, "bad-dtype", "tensors.W1")
    assert "float64" in kit.issues_with(h, "bad-dtype")[0].message


def test_bad_role(kit, g):
    h = kit.edited(g, lambda d: kit.tensor_json(d, "W1").update(role="weights"))
    one(kit, h, "bad-role", "tensors.W1")


def test_unknown_kernel(kit, g):
    h = kit.edited(g, lambda d: kit.op_json(d, "act1").update(kernel="rleu"))
    one(kit, h, "signature", "ops.act1")
    assert "unknown kernel 'rleu'" in kit.issues_with(h, "signature")[0].message


def test_unknown_tensor_read_and_written(kit, g):
    h = kit.edited(g, lambda d: kit.op_json(d, "act1")["inputs"].update(x="ghost"))
    one(kit, h, "unknown-tensor", "ops.act1.inputs")
    assert "ghost" in kit.issues_with(h, "unknown-tensor")[0].message
    h = kit.edited(g, lambda d: kit.op_json(d, "fc2").update(output="ghost"))
    one(kit, h, "unknown-tensor", "ops.fc2.output")


def test_signature_mismatch_wrong_shape(kit, g):
    # W1 no longer has x's 12 features as rows: linear refuses its inputs.
    h = kit.edited(g, lambda d: kit.tensor_json(d, "W1").update(shape=[11, 16]))
    one(kit, h, "signature", "ops.fc1")
    assert "W[11, 16]" in kit.issues_with(h, "signature")[0].message


def test_signature_mismatch_wrong_port(kit, g):
    def edit(d):
        ins = kit.op_json(d, "fc1")["inputs"]
        ins["w"] = ins.pop("W")
    h = kit.edited(g, edit)
    one(kit, h, "signature", "ops.fc1")


def test_malformed_params_are_an_issue_not_a_crash(kit):
    t = workloads.transformer(batch=1, seq=4, d_model=8, heads=2, d_ff=8)
    h = kit.edited(t, lambda d: kit.op_json(d, "q_proj")["params"].update(equation=5))
    one(kit, h, "signature", "ops.q_proj")
    h = kit.edited(t, lambda d: kit.op_json(d, "ff1")["params"].update(split=3))
    one(kit, h, "signature", "ops.ff1")


def test_output_mismatch(kit, g):
    h = kit.edited(g, lambda d: kit.tensor_json(d, "fc1.out").update(shape=[8, 15]))
    one(kit, h, "output-mismatch", "ops.fc1.output")
    assert "float32[8, 16]" in kit.issues_with(h, "output-mismatch")[0].message
    h = kit.edited(g, lambda d: kit.tensor_json(d, "fc2.out").update(dtype="float16"))
    one(kit, h, "output-mismatch", "ops.fc2.output")


class _Strided(Kernel):
    """A broken kernel: index point i writes cell 2i, so odd cells are never written."""

    name = "test_strided_writer"
    inputs = ("x",)

    def base_signature(self, ins, params):
        n = ins["x"].shape[0]
        return Signature(("i",), (n,), {"x": Projection(((1,),), (0,), (1,))}, Projection(((2,),), (0,), (1,)),
                         TensorSpec((2 * n - 1,), ins["x"].dtype), 1.0)


def test_output_coverage_of_a_kernel_with_holes(kit, monkeypatch):
    monkeypatch.setitem(REGISTRY, _Strided.name, _Strided())
    b = GraphBuilder()
    b.op(_Strided.name, "spread", {"x": b.input("x", (4,))})
    with pytest.raises(InvalidGraph, match="output-coverage"):
        b.build()
    bad = Graph(b._tensors, b._ops)
    found = kit.issues_with(bad, "output-coverage")
    assert found and found[0].path == "ops.spread.output"


def test_shard_rank(kit, g):
    h = kit.edited(g, lambda d: kit.op_json(d, "fc1").update(shards={"lo": [[0]], "hi": [[8]], "device": [0]}))
    one(kit, h, "shard-rank", "ops.fc1.shards")


def test_shard_outside(kit, g):
    h = kit.edited(g, lambda d: kit.op_json(d, "fc1").update(shards={"lo": [[0, 0]], "hi": [[9, 16]], "device": [0]}))
    one(kit, h, "shard-outside", "ops.fc1.shards")


def test_shard_coverage_gap(kit, g):
    sh = {"lo": [[0, 0], [5, 0]], "hi": [[4, 16], [8, 16]], "device": [0, 1]}  # row 4 is computed by nobody
    h = kit.edited(g, lambda d: kit.op_json(d, "fc1").update(shards=sh))
    one(kit, h, "shard-coverage", "ops.fc1.shards")


def test_shard_overlap_with_sizes_adding_up(kit, g):
    # [0:4, 0:16] and [0:8, 0:8]: 64 + 64 == 8*16, yet [0:4, 0:8] twice and [4:8, 8:16] never.
    sh = {"lo": [[0, 0], [0, 0]], "hi": [[4, 16], [8, 8]], "device": [0, 1]}
    h = kit.edited(g, lambda d: kit.op_json(d, "fc1").update(shards=sh))
    one(kit, h, "shard-overlap", "ops.fc1.shards")
    assert kit.issues_with(h, "shard-coverage") == []


def test_shard_overlap_minimal_2x2(kit):
    b = GraphBuilder()
    b.relu(b.input("x", (2, 2)), name="r")
    g = b.build()
    sh = {"lo": [[0, 0], [0, 0]], "hi": [[1, 2], [2, 1]], "device": [0, 0]}
    one(kit, kit.edited(g, lambda d: kit.op_json(d, "r").update(shards=sh)), "shard-overlap", "ops.r.shards")


def test_shard_inverted(kit, g):
    sh = {"lo": [[0, 0], [8, 0]], "hi": [[8, 16], [4, 0]], "device": [0, 0]}
    one(kit, kit.edited(g, lambda d: kit.op_json(d, "fc1").update(shards=sh)), "shard-inverted", "ops.fc1.shards")


def test_op_without_shards(kit, g):
    h = g.with_ops({"act1": g.ops["act1"].replace(shards=None)})
    found = kit.issues_with(h, "shard-coverage")
    assert found and found[0].path == "ops.act1.shards" and "no shards" in found[0].message


def test_negative_device(kit, g):
    sh = {"lo": [[0, 0], [4, 0]], "hi": [[4, 16], [8, 16]], "device": [0, -1]}
    one(kit, kit.edited(g, lambda d: kit.op_json(d, "fc1").update(shards=sh)), "bad-device", "ops.fc1.shards[1]")


def test_no_producer(kit, g):
    h = kit.edited(g, lambda d: d["ops"].remove(kit.op_json(d, "act1")))
    one(kit, h, "no-producer", "tensors.act1.out")


def test_multiple_producers(kit, g):
    def edit(d):
        twin = json.loads(json.dumps(kit.op_json(d, "act1")))
        twin["name"] = "act1_twin"
        d["ops"].append(twin)
    h = kit.edited(g, edit)
    one(kit, h, "multiple-producers", "tensors.act1.out")
    assert "act1_twin" in kit.issues_with(h, "multiple-producers")[0].message


def test_produced_source(kit, g):
    # An op writes a tensor declared as a graph input.
    h = kit.edited(g, lambda d: kit.tensor_json(d, "act1.out").update(role="input"))
    one(kit, h, "produced-source", "tensors.act1.out")
    h = kit.edited(g, lambda d: kit.tensor_json(d, "fc1.out").update(role="parameter"))
    one(kit, h, "produced-source", "tensors.fc1.out")


def test_cycle(kit):
    b = GraphBuilder()
    x = b.input("x", (3, 4))
    a = b.relu(x, name="a")
    b.tanh(a, name="t")
    g = b.build()
    h = kit.edited(g, lambda d: kit.op_json(d, "a")["inputs"].update(x="t.out"))  # a reads t, t reads a
    one(kit, h, "cycle", "ops")
    msg = kit.issues_with(h, "cycle")[0].message
    assert "'a'" in msg and "'t'" in msg


def test_all_issues_are_collected(kit, g):
    """A broken tensor does not hide an unrelated op's problem (Tapestry stopped at the first)."""
    def edit(d):
        kit.tensor_json(d, "b2").update(dtype="int8")  # fc2's bias
        kit.op_json(d, "fc1").update(shards={"lo": [[0, 0]], "hi": [[8, 16]], "device": [-2]})
        kit.tensor_json(d, "act1.out").update(role="input")
    codes = {(i.code, i.path) for i in validate(kit.edited(g, edit))}
    assert ("bad-dtype", "tensors.b2") in codes
    assert ("bad-device", "ops.fc1.shards[0]") in codes
    assert ("produced-source", "tensors.act1.out") in codes


def test_check_raises_listing_every_issue(kit, g):
    def edit(d):
        kit.tensor_json(d, "x").update(dtype="int4")
        kit.op_json(d, "fc2").update(shards={"lo": [[0, 0]], "hi": [[8, 5]], "device": [0]})
    h = kit.edited(g, edit)
    with pytest.raises(InvalidGraph) as e:
        check(h, "my plan")
    text = str(e.value)
    assert text.startswith("my plan is not a valid plan (2 problems)")
    assert "tensors.x: " in text and "ops.fc2.shards: " in text
    assert {i.code for i in e.value.issues} == {"bad-dtype", "shard-coverage"}


def test_issue_str_names_path_and_code(kit, g):
    h = kit.edited(g, lambda d: kit.tensor_json(d, "x").update(dtype="int4"))
    (issue,) = validate(h)
    assert str(issue).startswith("tensors.x: dtype 'int4'") and str(issue).endswith("[bad-dtype]")


def test_direct_graph_with_unhashable_shape_does_not_crash(kit, g):
    t = dict(g.tensors)
    t["x"] = Tensor("x", (8, 12.5), "float32", "input")  # a float extent, as a careless caller might write
    codes = {i.code for i in validate(Graph(t, g.ops))}
    assert "bad-shape" in codes


def test_op_names_that_break_move_text_are_refused():
    from ir import workloads
    from ir.serialize import from_json
    from ir.validate import validate

    doc = workloads.build("mlp", batch=4, widths=[8, 16, 8]).to_json()
    doc["ops"][0]["name"] = "fc1,dim=o"
    issues = validate(from_json(doc, validate=False))
    assert [i.code for i in issues] == ["bad-name"] and issues[0].path == "ops.fc1,dim=o"
