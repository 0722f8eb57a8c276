"""Island restarts: an island whose best value of every objective stays the same for
``search.restart_after`` tasks starts again from the start plans and takes no migrant for as
many tasks; checkpoints keep it."""

from __future__ import annotations

import numpy as np

from costmodel.presets import PRESETS
from ir import workloads
from ir.serialize import dumps
from optimizer.campaign.config import ConstraintsConfig, SearchConfig
from optimizer.search.strategies.base import SearchContext
from optimizer.search.strategies.islands import IslandStrategy
from optimizer.search.worker import TaskConstraints


def _strategy(restart_after: int | None) -> IslandStrategy:
    g = workloads.mlp(batch=16, widths=(64, 128, 64))
    ctx = SearchContext(campaign="c", hardware=PRESETS["h100-sxm-8"].to_dict(), objectives=("makespan", "energy"),
                        constraints=TaskConstraints(**ConstraintsConfig().model_dump()),
                        search=SearchConfig(islands=1, population=6, restart_after=restart_after,
                                            migration_interval=1),
                        seed=3, base_json=dumps(g), base_digest=g.digest, n_devices=8, storage_url="sqlite://")
    s = IslandStrategy(ctx)
    s.seed_population([_rec("program", 10.0, 10.0)])
    return s


def _rec(digest: str, makespan: float, energy: float) -> dict:
    return {"digest": digest, "graph_json": "{}", "objectives": {"makespan": makespan, "energy": energy}}


def _task(s: IslandStrategy, results: list[dict], front: list[dict]) -> list[str]:
    _fn, spec, meta = s.next_task(np.random.default_rng(0), front)
    s.on_result(meta, {"results": results}, front)
    return [d for d, _ in spec.parents]


def test_an_island_whose_best_values_stand_still_restarts_without_migrants():
    s = _strategy(restart_after=3)
    front = [{"digest": "elite", "graph_json": "{}", "f": [1.0, 1.0]}]
    _task(s, [_rec("a", 5.0, 5.0)], front)  # a betters both objectives
    for k in range(3):  # then a trade-off point (the front changes, no best value) and worse ones
        assert s.restarts == 0
        _task(s, [_rec(f"worse{k}", 4.9999 if k == 0 else 6.0 + k, 9.0 if k == 0 else 6.0 + k)], front)
    assert s.restarts == 1 and [m["digest"] for m in s.islands[0]] == ["program"]
    # three tasks without the global front's member (the new walk improving), then migration resumes
    parents = [_task(s, [_rec(f"new{k}", 9.0 - k, 9.0 - k)], front) for k in range(4)]
    assert ["elite" in p for p in parents] == [False, False, False, True]


def test_an_island_that_keeps_improving_and_restart_after_null_never_restart():
    for after, step in ((3, 1.0), (None, 0.0)):
        s = _strategy(restart_after=after)
        for k in range(10):  # each child better than the last (or, with null, the same all along)
            _task(s, [_rec(f"c{k}", 9.0 - k * step, 9.0 - k * step)], [])
        assert s.restarts == 0


def test_restart_state_survives_a_checkpoint():
    s = _strategy(restart_after=3)
    _task(s, [_rec("a", 5.0, 5.0)], [])
    _task(s, [_rec("b", 6.0, 6.0)], [])
    state = s.to_json()
    t = _strategy(restart_after=3)
    t.load_json(state, lambda d: "{}")
    assert (t.stale, t.quiet, t.restarts, [m["digest"] for m in t.start]) == ([1], [0], 0, ["program"])
    _task(t, [_rec("c", 7.0, 7.0)], [])
    _task(t, [_rec("d", 8.0, 8.0)], [])
    assert t.restarts == 1 and [m["digest"] for m in t.islands[0]] == ["program"]
