"""``search.layers``: campaigns on models of repeated layers evaluate by repetition and tie moves."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from costmodel import Evaluator
from costmodel.hardware_io import load_hardware
from costmodel.repetition import AUTO_LAYERS, layers_mode
from ir import workloads
from ir.layers import layer_classes
from ir.serialize import dumps, loads
from optimizer.campaign.config import SearchConfig
from optimizer.search.baselines import zero3
from optimizer.search.worker import SearchTaskSpec, TaskConstraints, search_task

TINY = dict(d_model=32, heads=4, kv_heads=2, d_ff=64, vocab=64, seq=8, batch=8, mode="train")


def test_auto_picks_repeat_for_deep_models_only():
    assert layers_mode(workloads.build("llama", layers=AUTO_LAYERS, **TINY)) == "repeat"
    assert layers_mode(workloads.build("llama", layers=4, **TINY)) == "whole"
    assert layers_mode(workloads.build("mlp", batch=8, widths=[8, 16, 8])) == "whole"
    assert layers_mode(workloads.build("llama", layers=4, **TINY), "repeat") == "repeat"
    with pytest.raises(ValidationError, match="layers"):
        SearchConfig(layers="some")


def test_a_repeat_search_task_keeps_layers_tied_and_scores_them_right():
    g = zero3(workloads.build("llama", layers=8, **TINY), 8)
    hw = load_hardware("h100-sxm-8")
    spec = SearchTaskSpec(parents=((g.digest, dumps(g, indent=None)),), hardware=hw.to_dict(),
                          objectives=("makespan", "peak_memory"), constraints=TaskConstraints(True, None, None),
                          max_shards_per_op=None, seed=(5,), steps=40, weights={"rewrite": 1.0, "layout": 1.0},
                          adaptive=False, returns=16, mode="evolve", time_limit=None, layers="repeat")
    assert SearchTaskSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    old = spec.to_json()
    del old["layers"]  # a checkpoint written before the field existed
    assert SearchTaskSpec.from_json(old).layers == "whole"
    out = search_task(spec)
    assert out["results"]
    whole = Evaluator(hw)
    for r in out["results"]:
        plan = loads(r["graph_json"])
        c = layer_classes(plan)
        assert len(set(c[1:7])) <= 2, c  # the middle layers stay (nearly) one class: moves were tied
        e = whole(plan)
        assert abs(r["objectives"]["makespan"] / e.makespan - 1) < 0.01
        assert abs(r["objectives"]["peak_memory"] / e.peak_memory - 1) < 0.01
