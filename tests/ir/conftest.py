"""Shared helpers for the IR tests, handed out as the session fixture ``kit``.

(Helpers live in a fixture rather than an importable module: ``tests/`` has several conftest
files and no packages, so ``from conftest import ...`` would be ambiguous.)
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest

from executor import verify
from ir import workloads
from ir.graph import Graph
from ir.rewrites import RewriteError, random_rewrite
from ir.serialize import from_json
from ir.validate import Issue, validate

# Small sizes keep every executed check in milliseconds; extents are > 1 and ragged splits occur.
SMALL = {
    "mlp": dict(batch=6, widths=(12, 20, 10)),
    "transformer": dict(batch=2, seq=6, d_model=8, heads=2, d_ff=12),
    "convnet": dict(batch=2, channels=(3, 4, 4), size=6),
}


def small(name: str) -> Graph:
    return workloads.build(name, **SMALL[name])


def edited(g: Graph, edit: Callable[[dict], Any]) -> Graph:
    """``g`` with its JSON document changed by ``edit`` (in place), loaded *without* validation."""
    data = copy.deepcopy(json.loads(json.dumps(g.to_json())))
    edit(data)
    return from_json(data, validate=False)


def op_json(data: dict, name: str) -> dict:
    return next(o for o in data["ops"] if o["name"] == name)


def tensor_json(data: dict, name: str) -> dict:
    return next(t for t in data["tensors"] if t["name"] == name)


def issues_with(g: Graph, code: str) -> list[Issue]:
    return [i for i in validate(g) if i.code == code]


def assert_rewrite_ok(h: Graph, g: Graph) -> None:
    """The two checks every rewrite must pass: ``h`` is valid and computes what ``g`` computes."""
    issues = validate(h)
    assert issues == [], "\n".join(map(str, issues))
    rep = verify(h, reference=g)
    assert rep.ok, str(rep)


def assert_shared_except(h: Graph, g: Graph, changed: set[str]) -> None:
    """Copy-on-write: every op of ``g`` not in ``changed`` is the same object in ``h``, arrays shared."""
    for name, o in g.ops.items():
        if name in changed:
            continue
        assert h.ops[name] is o, name
        assert h.ops[name].shards.lo is o.shards.lo and h.ops[name].shards.device is o.shards.device


def random_walk(g: Graph, rng: np.random.Generator, steps: int, n_devices: int) -> Graph:
    """``g`` after up to ``steps`` random legal rewrites (fewer where no legal move is found in the
    bounded draws)."""
    for _ in range(steps):
        try:
            g, _ = random_rewrite(g, rng, n_devices)
        except RewriteError:
            break
    return g


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    return SimpleNamespace(SMALL=SMALL, small=small, edited=edited, op_json=op_json, tensor_json=tensor_json,
                           issues_with=issues_with, assert_rewrite_ok=assert_rewrite_ok,
                           assert_shared_except=assert_shared_except, random_walk=random_walk)


@pytest.fixture
def mlp() -> Graph:
    """x[10,12] -> fc1 (linear, 16) -> act1 (relu) -> fc2 (linear, 8): extent 10 splits raggedly."""
    return workloads.mlp(batch=10, widths=(12, 16, 8))
