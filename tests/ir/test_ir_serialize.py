"""JSON form: round trips keep the digest; loading always validates; bad documents are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ir import workloads
from ir.graph import FORMAT
from ir.rewrites import RewriteError, random_rewrite
from ir.serialize import GraphFormatError, dumps, from_json, load, loads, save
from ir.validate import InvalidGraph


@pytest.mark.parametrize("name", ["mlp", "transformer", "convnet"])
def test_round_trip_keeps_digest_for_every_workload(name, tmp_path):
    g = workloads.build(name)
    h = loads(dumps(g))
    assert h.digest == g.digest and h == g
    assert dumps(h) == dumps(g)
    save(g, tmp_path / "plan.json")
    assert load(tmp_path / "plan.json").digest == g.digest
    assert loads(dumps(g, indent=None)).digest == g.digest


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["mlp", "transformer", "convnet"]), seed=st.integers(0, 2**32 - 1),
       steps=st.integers(1, 25), n_devices=st.integers(1, 8))
def test_round_trip_of_randomly_rewritten_graphs(kit, name, seed, steps, n_devices):
    g = kit.random_walk(kit.small(name), np.random.default_rng(seed), steps, n_devices)
    h = loads(dumps(g))
    assert h.digest == g.digest
    assert [o.kernel for o in h.ops.values()] == [o.kernel for o in g.ops.values()]
    for n, o in g.ops.items():
        assert h.ops[n].shards == o.shards


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(["mlp", "transformer", "convnet"]), seed=st.integers(0, 2**32 - 1),
       steps=st.integers(1, 25))
def test_an_ops_canonical_text_is_its_sorted_json(kit, name, seed, steps):
    """``Op.canonical_text`` is written field by field from cached parts (the digest's speed); it
    must be exactly the sorted compact JSON of ``to_json()``, fused ops and whole shards included."""
    g = kit.small(name)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        try:
            g, _ = random_rewrite(g, rng, 4)
        except RewriteError:
            break
        for o in g.ops.values():
            assert o.canonical_text == json.dumps(o.to_json(), sort_keys=True, separators=(",", ":"))


def test_a_shard_tables_text_memo_is_not_pickled():
    import pickle

    from ir.graph import Op, Shards

    s = Shards([[0, 0], [2, 0]], [[2, 3], [4, 3]], [0, 1])
    text, digest = s.canonical_text, s.content_digest
    back = pickle.loads(pickle.dumps(s))
    assert back == s and not hasattr(back, "_text") and not hasattr(back, "_digest")
    assert back.canonical_text == text and back.content_digest == digest
    assert Shards([[0, 0], [2, 0]], [[2, 3], [4, 3]], [0, 2]).content_digest != digest
    assert text == json.dumps({"device": [0, 1], "hi": [[2, 3], [4, 3]], "lo": [[0, 0], [2, 0]]},
                              separators=(",", ":"))
    op = Op("é\"x", "relu", (("x", "a"),), "b", {"z": 1, "a": [1.5]}, None)  # escapes; no shards
    assert op.canonical_text == json.dumps(op.to_json(), sort_keys=True, separators=(",", ":"))


def test_digest_ignores_order_and_whitespace_but_not_content():
    g = workloads.mlp()
    data = json.loads(dumps(g))
    data["ops"].reverse()
    data["tensors"].reverse()
    assert from_json(data).digest == g.digest
    data["ops"][0]["shards"]["device"] = [3]
    assert from_json(data).digest != g.digest


def test_file_edited_to_be_invalid_is_refused(tmp_path):
    g = workloads.mlp()
    path = tmp_path / "plan.json"
    save(g, path)
    data = json.loads(path.read_text())
    fc1 = next(o for o in data["ops"] if o["name"] == "fc1")
    fc1["shards"] = {"lo": [[0, 0], [0, 0]], "hi": [[4, 256], [8, 128]], "device": [0, 1]}  # overlap + gap
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidGraph) as e:
        load(path)
    assert not isinstance(e.value, GraphFormatError)  # well-formed, but not a valid plan
    assert [(i.code, i.path) for i in e.value.issues] == [("shard-overlap", "ops.fc1.shards")]
    assert str(path) in str(e.value)
    with pytest.raises(InvalidGraph):
        loads(path.read_text())
    # from_json validates by default as well; only an explicit opt-out skips it.
    with pytest.raises(InvalidGraph):
        from_json(data)
    assert from_json(data, validate=False).ops["fc1"].shards.lo.shape == (2, 2)


def test_malformed_json_raises_format_error():
    with pytest.raises(GraphFormatError) as e:
        loads('{"format": "tapestry-graph/1", "tensors": [')
    (issue,) = e.value.issues
    assert issue.code == "bad-json" and issue.path.startswith("line 1 column")


def test_a_placements_file_is_named_as_such():
    """``export --program`` writes ``NN_<digest>.placements.json`` beside the plan (a ``00_*.json``
    glob picks it up): the refusal says what it is, not "re-export the plan"."""
    from executor.codegen.dtensor import dtensor_placements
    from costmodel.transfers import transfer_plan

    g = workloads.mlp()
    doc = dtensor_placements(g, transfer_plan(g, 1).to_json()["residency"])
    with pytest.raises(GraphFormatError, match="DTensor placements file written beside a generated program"):
        loads(json.dumps(doc))


def test_wrong_format_version_refused():
    data = json.loads(dumps(workloads.mlp()))
    data["format"] = "tapestry-graph/0"
    with pytest.raises(GraphFormatError, match="format must be 'tapestry-graph/1'") as e:
        loads(json.dumps(data))
    assert e.value.issues[0].path == "$.format"
    del data["format"]
    with pytest.raises(GraphFormatError):
        from_json(data)
    assert FORMAT == "tapestry-graph/1"


@pytest.mark.parametrize("edit,path", [
    (lambda d: d.update(tensors={}), "$.tensors"),
    (lambda d: d.update(ops=None), "$.ops"),
    (lambda d: d["tensors"].append(dict(d["tensors"][0])), "$.tensors[8]"),
    (lambda d: d["tensors"][0].update(shape="8x64"), "$.tensors[0].shape"),
    (lambda d: d["tensors"][0].update(colour="red"), "$.tensors[0]"),
    (lambda d: d["ops"][0].update(kernal="linear"), "$.ops[0]"),
    (lambda d: d["ops"][0].pop("kernel"), "$.ops[0].kernel"),
    (lambda d: d["ops"][0].update(inputs=["x"]), "$.ops[0].inputs"),
    (lambda d: d["ops"][0].update(params=[]), "$.ops[0].params"),
    (lambda d: d["ops"][0].update(shards={"lo": [[0, 0]]}), "$.ops[0].shards"),
    (lambda d: d["ops"][0].update(shards={"lo": [[0, 0]], "hi": [[8]], "device": [0]}), "$.ops[0].shards"),
    (lambda d: d["ops"].append(dict(d["ops"][0])), "$.ops[3]"),
    (lambda d: d["ops"][0]["shards"].update(hi=[[8, 255.5]]), "$.ops[0].shards.hi"),
    (lambda d: d["ops"][0]["shards"].update(device=[True]), "$.ops[0].shards.device"),
    (lambda d: d["tensors"][0].update(shape=[8, True]), "$.tensors[0].shape"),
], ids=["tensors-not-list", "ops-not-list", "duplicate-tensor", "shape-not-list", "unknown-tensor-field",
        "unknown-op-field", "no-kernel", "inputs-not-object", "params-not-object", "shards-incomplete",
        "shards-lo-hi-differ", "duplicate-op", "fractional-shard", "boolean-device", "boolean-extent"])
def test_malformed_documents_raise_format_error(edit, path):
    data = json.loads(dumps(workloads.mlp()))
    edit(data)
    with pytest.raises(GraphFormatError) as e:
        loads(json.dumps(data), source="plan.json")
    assert e.value.issues[0].path == path
    assert str(e.value).startswith("plan.json is not a valid plan")


def test_not_an_object_and_missing_file(tmp_path):
    with pytest.raises(GraphFormatError, match="JSON object"):
        loads("[1, 2]")
    with pytest.raises(GraphFormatError) as e:
        load(tmp_path / "missing.json")
    assert e.value.issues[0].code == "no-file"


def test_text_form_has_one_line_per_op_in_dependency_order(kit):
    g = kit.small("transformer")
    lines = str(g).splitlines()
    assert len(lines) == len(g.ops)
    names = [line.split("  # ")[1].split(":")[0] for line in lines]
    assert names == list(g.topo_order)
    assert lines[0].startswith("%ln1.out : float32[2, 6, 8] = layernorm")
