"""Shared fixtures of the execution tests: small workloads and random rewritten plans."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ir import workloads
from ir.graph import Graph
from ir.rewrites import RewriteError, random_walk

SMALL = {
    "mlp": dict(batch=6, widths=(12, 20, 10)),
    "transformer": dict(batch=2, seq=6, d_model=8, heads=2, d_ff=12),
    "convnet": dict(batch=2, channels=(3, 4, 4), size=6),
}


def random_plan(name: str, seed: int, n_devices: int = 4, steps: int = 14) -> Graph:
    """A small workload after ``steps`` random legal rewrites over ``n_devices`` devices."""
    rng = np.random.default_rng([seed, len(name)])
    return random_walk(workloads.build(name, **SMALL[name]), rng, n_devices, steps)


def spread_plan(name: str, seed: int, n_devices: int = 4) -> Graph:
    """A random plan whose ops are additionally spread over all devices (many transfers)."""
    from ir.rewrites import place

    g = random_plan(name, seed, n_devices)
    rng = np.random.default_rng(seed)
    for op in list(g.ops):
        k = len(g.ops[op].shards)
        start = int(rng.integers(n_devices))
        try:
            g = place(g, op, tuple((start + i) % n_devices for i in range(k)))
        except RewriteError:  # already placed so
            pass
    return g


@pytest.fixture(scope="session")
def plans() -> SimpleNamespace:
    return SimpleNamespace(SMALL=SMALL, random_plan=random_plan, spread_plan=spread_plan)
