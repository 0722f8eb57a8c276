"""Plan documents list a shard table that several ops use once (``tapestry-graph/2``): a whole model
shards its repeated layers alike, and writing each layer's tables again made a 512-GPU plan too
large to read back. The digest, the ops and their tables are the same either way."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ir import serialize, workloads
from ir.graph import FORMAT, Graph
from ir.rewrites import unshard
from ir.serialize import FORMAT_SHARED, GraphFormatError, document, dumps, loads, loads_document
from ir.validate import InvalidGraph
from optimizer.search.baselines import zero3


@pytest.fixture(scope="module")
def plan() -> Graph:
    g = workloads.build("llama", layers=3, d_model=64, heads=4, kv_heads=2, d_ff=128, vocab=256, seq=32, batch=8,
                        mode="train")
    return zero3(g, 8)


def _inline(g: Graph) -> str:
    """The document with every table written inline (``tapestry-graph/1``)."""
    return json.dumps(g.to_json(), separators=(",", ":"))


def test_a_plan_of_repeated_layers_lists_each_table_once(plan):
    text = dumps(plan, indent=None)
    doc = json.loads(text)
    assert doc["format"] == FORMAT_SHARED
    refs = [o["shards"] for o in doc["ops"] if type(o["shards"]) is int]
    tables = doc["shard_tables"]
    assert sorted(set(refs)) == list(range(len(tables)))  # every table used, numbered by first use
    assert refs.index(0) < refs.index(1) and all(refs.count(i) >= 2 for i in range(len(tables)))
    # the three layers are sharded alike: a shared table for each of a layer's sharded ops at least
    assert len(refs) >= 3 * len(tables) and len(text) < 0.75 * len(_inline(plan))
    # each table is the plan's, and each op names its own
    for o, d in zip(plan.ops.values(), doc["ops"]):
        written = tables[d["shards"]] if type(d["shards"]) is int else d["shards"]
        assert written == o.shards.to_json()
    assert document(plan) == doc


def test_a_shared_document_reads_back_to_the_same_plan(plan):
    for text in (dumps(plan, indent=None), dumps(plan), dumps(plan, program=unshard(plan))):
        g = loads(text)
        assert g.digest == plan.digest
        assert all(g.ops[n].shards == o.shards for n, o in plan.ops.items())
        assert dumps(g, indent=None) == dumps(plan, indent=None)
    # the ops that name one table share one object
    g, prov = loads_document(dumps(plan, program=unshard(plan)))
    doc = json.loads(dumps(plan, indent=None))
    users: dict[int, set[int]] = {}
    for d in doc["ops"]:
        if type(d["shards"]) is int:
            users.setdefault(d["shards"], set()).add(id(g.ops[d["name"]].shards))
    assert users and all(len(objs) == 1 for objs in users.values())
    assert prov.program is not None and prov.program.digest == unshard(plan).digest


def test_a_plan_without_shared_tables_is_written_as_before():
    g = workloads.mlp()
    text = dumps(g, indent=None)
    assert json.loads(text) == g.to_json() and json.loads(dumps(g)) == g.to_json()
    assert json.loads(text)["format"] == FORMAT and "shard_tables" not in text
    # a one-shard table is written inline even where ops share it
    from ir.graph import Shards
    assert Shards.whole((8, 64)) is Shards.whole((8, 64))
    assert "shard_tables" not in dumps(workloads.build("llama", layers=2, d_model=64, heads=4, kv_heads=2, d_ff=128,
                                                       vocab=256, seq=32, batch=8), indent=None)


def _shared_doc(plan: Graph) -> dict:
    return json.loads(dumps(plan, indent=None))


def _first_ref(doc: dict) -> int:
    return next(i for i, o in enumerate(doc["ops"]) if type(o["shards"]) is int)


@pytest.mark.parametrize("edit,path,words", [
    (lambda d, i: d["ops"][i].update(shards=len(d["shard_tables"])), "$.ops[{i}].shards", "does not exist"),
    (lambda d, i: d["ops"][i].update(shards=-1), "$.ops[{i}].shards", "does not exist"),
    (lambda d, i: d["ops"][i].update(shards=True), "$.ops[{i}].shards", "lo, hi and device"),
    (lambda d, i: d["ops"][i].update(shards=0.0), "$.ops[{i}].shards", "lo, hi and device"),
    (lambda d, i: d.pop("shard_tables"), "$.shard_tables", "lists the shard tables"),
    (lambda d, i: d.update(shard_tables={}), "$.shard_tables", "lists the shard tables"),
    (lambda d, i: d["shard_tables"][0].update(device=[0.5]), "$.shard_tables[0].device", "integers"),
    (lambda d, i: d["shard_tables"][0].pop("hi"), "$.shard_tables[0]", "lo, hi and device"),
    (lambda d, i: d.update(format=FORMAT), "$.ops[{i}].shards", "needs the format tapestry-graph/2"),
], ids=["index-past-end", "negative-index", "boolean-index", "fractional-index", "no-tables", "tables-not-list",
        "fractional-device", "table-without-hi", "reference-in-v1"])
def test_bad_references_and_tables_are_refused_with_their_place(plan, edit, path, words):
    doc = _shared_doc(plan)
    i = _first_ref(doc)
    edit(doc, i)
    with pytest.raises(GraphFormatError) as e:
        loads(json.dumps(doc), source="plan.json")
    assert e.value.issues[0].path == path.format(i=i) and words in str(e.value)
    assert str(e.value).startswith("plan.json is not a valid plan")


def test_an_op_pointed_at_a_table_of_another_index_space_is_named(plan):
    """Validation checks a shared table once per index space it is used for: another op that names it
    gets its own issue, and the ops it fits do not."""
    doc = _shared_doc(plan)
    i = _first_ref(doc)
    table = doc["ops"][i]["shards"]
    hull = [max(col) for col in zip(*doc["shard_tables"][table]["hi"])]
    other = next(j for j, o in enumerate(plan.ops.values())
                 if len(plan.signature(o).index.end) == len(hull) and list(plan.signature(o).index.end) != hull)
    doc["ops"][other]["shards"] = table
    with pytest.raises(InvalidGraph) as e:
        loads(json.dumps(doc))
    assert {i.path for i in e.value.issues} == {f"ops.{doc['ops'][other]['name']}.shards"}


def test_a_bad_device_in_a_shared_table_is_named_for_every_op_that_uses_it(plan):
    doc = _shared_doc(plan)
    table = doc["ops"][_first_ref(doc)]["shards"]
    users = [o["name"] for o in doc["ops"] if o["shards"] == table and type(o["shards"]) is int]
    doc["shard_tables"][table]["device"][-1] = 8
    with pytest.raises(InvalidGraph) as e:
        serialize.from_json(doc, n_devices=8)
    assert len(users) >= 2
    named = [i.path.removeprefix("ops.").rsplit(".shards", 1)[0] for i in e.value.issues if i.code == "bad-device"]
    assert sorted(named) == sorted(users)


def test_shards_in_all_are_bounded_counting_each_use_of_a_table(plan, monkeypatch):
    doc = _shared_doc(plan)
    written = sum(len(t["device"]) for t in doc["shard_tables"]) + sum(
        len(o["shards"]["device"]) for o in doc["ops"] if type(o["shards"]) is dict)
    in_all = sum(len(o.shards) for o in plan.ops.values())
    assert written < in_all
    monkeypatch.setattr(serialize, "MAX_SHARDS", in_all - 1)
    with pytest.raises(GraphFormatError, match="counting a shared table for each op"):
        loads(json.dumps(doc))
    monkeypatch.setattr(serialize, "MAX_SHARDS", in_all)
    assert loads(json.dumps(doc)).digest == plan.digest


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 12))
def test_randomly_rewritten_plans_of_repeated_layers_read_back_the_same(kit, plan, seed, steps):
    g = kit.random_walk(plan, np.random.default_rng(seed), steps, 8)
    for text in (dumps(g, indent=None), dumps(g)):
        h = loads(text)
        assert h.digest == g.digest and all(h.ops[n].shards == o.shards for n, o in g.ops.items())


def test_an_indented_document_has_a_line_per_tensor_op_and_table(plan):
    text = dumps(plan)
    doc = json.loads(text)
    assert doc == json.loads(dumps(plan, indent=None))
    lines = text.splitlines()
    assert len(lines) == len(doc["tensors"]) + len(doc["ops"]) + len(doc["shard_tables"]) + 9
    assert json.loads(lines[len(doc["tensors"]) + 5].rstrip(",")) == doc["ops"][0]
    with_program = json.loads(dumps(plan, program=unshard(plan), indent=4))
    assert with_program["program"] == document(unshard(plan)) and with_program["ops"] == doc["ops"]
