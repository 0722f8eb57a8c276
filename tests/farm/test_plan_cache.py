"""Whole-model plans cross the farm cheaply: compact ``dumps`` from cached op texts, and workers
parse and validate a plan text once."""

from __future__ import annotations

import json

import pytest

from ir import workloads
from ir.serialize import InvalidGraph, document, dumps, loads
from optimizer.search.baselines import zero3
from optimizer.search.worker import _PlanCache

TINY = dict(d_model=32, heads=4, kv_heads=2, d_ff=64, vocab=64, seq=8, batch=8, mode="train")


def test_compact_dumps_is_the_same_document():
    g = zero3(workloads.build("llama", layers=3, **TINY), 8)
    compact = dumps(g, indent=None)
    assert json.loads(compact) == json.loads(dumps(g, indent=1)) == document(g)  # shared tables: tests/ir
    assert loads(compact).digest == g.digest


def test_workers_parse_a_plan_text_once():
    g = zero3(workloads.build("llama", layers=3, **TINY), 8)
    text = dumps(g, indent=None)
    cache = _PlanCache(max_shards=4 * g.n_shards)
    a, b = cache.get(text, "p"), cache.get(text, "p")
    assert a is b and a.digest == g.digest and (cache.hits, cache.misses) == (1, 1)
    bad = text.replace('"device":[', '"device":[999,', 1)  # a corrupted row still fails, every time
    for _ in range(2):
        with pytest.raises(InvalidGraph):
            cache.get(bad, "p")
    other = zero3(workloads.build("llama", layers=2, **TINY), 8)
    cache.get(dumps(other, indent=None), "q")
    cache.get(dumps(zero3(workloads.build("llama", layers=4, **TINY), 8), indent=None), "r")
    assert cache.shards <= cache.max_shards  # the oldest are dropped to stay under the cap
    few = _PlanCache(max_plans=2)
    for layers in (2, 3, 4):
        few.get(dumps(zero3(workloads.build("llama", layers=layers, **TINY), 8), indent=None), "s")
    assert len(few.d) == 2 and few.shards == sum(g.n_shards for g in few.d.values())
