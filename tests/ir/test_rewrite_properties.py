"""Property tests: random sequences of legal rewrites keep every graph valid and equivalent.

For each workload (small sizes), hypothesis draws a seed for a NumPy Generator, a device count
and a sequence length; ``random_rewrite`` then applies up to 30 rewrites. Every intermediate
graph validates (the failing move is named), the final plan verifies against the original, and
the logical program behind it (``unshard``) is the original's.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor import verify
from ir.rewrites import DEFAULT_WEIGHTS, RewriteError, parse_move, random_rewrite, unshard
from ir.validate import validate

# Every kind gets real weight, so fusion and reduction splits occur often even in short runs.
HEAVY = {**DEFAULT_WEIGHTS, "split_reduction": 1.5, "merge_reduction": 0.8, "fuse": 1.5, "unfuse": 0.8}


def walk(kit, name: str, seed: int, n_devices: int, steps: int, weights=None):
    g = kit.small(name)
    rng = np.random.default_rng(seed)
    h, lineage = g, []
    for _ in range(steps):
        try:
            h, m = random_rewrite(h, rng, n_devices, weights)
        except RewriteError:
            # Documented: 40 unlucky draws end the walk (likeliest with one device, where place and
            # move never apply, and every op at the shard cap). The graph so far is still checked.
            break
        lineage.append(str(m))
        issues = validate(h)
        assert issues == [], f"after {'; '.join(lineage)}:\n" + "\n".join(map(str, issues))
        assert h.devices <= set(range(n_devices)), lineage
        assert h.topo_order == tuple(h.ops), f"op order is not program order after {'; '.join(lineage)}"
    return g, h, lineage


def check_equivalent(g, h, lineage):
    rep = verify(h, reference=g)
    assert rep.ok, f"{rep} after {'; '.join(lineage)}"
    assert unshard(h).digest == unshard(g).digest, "; ".join(lineage)
    assert verify(h).ok  # against its own unsharded program as well


PROPS = dict(seed=st.integers(0, 2**63 - 1), n_devices=st.integers(1, 8), steps=st.integers(1, 30))
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", ["mlp", "transformer", "convnet"])
@settings(max_examples=150, **SETTINGS)
@given(**PROPS)
def test_random_rewrites_preserve_meaning(kit, name, seed, n_devices, steps):
    check_equivalent(*walk(kit, name, seed, n_devices, steps))


@pytest.mark.parametrize("name", ["mlp", "transformer", "convnet"])
@settings(max_examples=40, **SETTINGS)
@given(**PROPS)
def test_random_rewrites_with_heavy_fusion_and_reduction_splits(kit, name, seed, n_devices, steps):
    g, h, lineage = walk(kit, name, seed, n_devices, steps, HEAVY)
    check_equivalent(g, h, lineage)
    if lineage:
        assert parse_move("; ".join(lineage)).apply(g).digest == h.digest  # lineage text replays


def test_random_rewrite_is_deterministic_per_seed(kit):
    a = walk(kit, "transformer", 123, 4, 30)[1]
    b = walk(kit, "transformer", 123, 4, 30)[1]
    assert a.digest == b.digest
