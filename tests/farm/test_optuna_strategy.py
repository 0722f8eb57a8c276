"""The Optuna strategy on resume: the study continues from the database, and the sampler is
reseeded from the checkpoint (deterministic, and not a replay of the first run's draws)."""

from __future__ import annotations

import numpy as np

from costmodel.presets import PRESETS
from ir import workloads
from ir.serialize import dumps
from optimizer.campaign.config import ConstraintsConfig, SearchConfig
from optimizer.search.strategies.base import SearchContext
from optimizer.search.strategies.optuna_search import OptunaStrategy
from optimizer.search.worker import TaskConstraints


def _ctx(url: str) -> SearchContext:
    g = workloads.mlp(batch=16, widths=(64, 128, 64))
    return SearchContext(campaign="c", hardware=PRESETS["h100-sxm-8"].to_dict(), objectives=("makespan", "energy"),
                         constraints=TaskConstraints(**ConstraintsConfig().model_dump()),
                         search=SearchConfig(population=8), seed=3, base_json=dumps(g), base_digest=g.digest,
                         n_devices=8, storage_url=url)


def _draws(s: OptunaStrategy) -> list[list[str]]:
    _fn, spec, _meta = s.next_task(np.random.default_rng(0))
    return [p for _n, p in spec.plans]


def test_resume_reseeds_the_sampler_from_the_checkpoint(tmp_path):
    fresh = _draws(OptunaStrategy(_ctx(f"sqlite:///{tmp_path / 'a.db'}")))
    again = _draws(OptunaStrategy(_ctx(f"sqlite:///{tmp_path / 'b.db'}")))
    assert fresh == again  # same seed, same first draws

    def resumed(db: str) -> tuple[OptunaStrategy, list[list[str]]]:
        s = OptunaStrategy(_ctx(f"sqlite:///{tmp_path / db}"))
        s.load_json({"task_index": 5}, lambda d: "")
        return s, _draws(s)

    s1, r1 = resumed("c.db")
    s2, r2 = resumed("d.db")
    assert r1 == r2 and s1.task_index == 6  # deterministic given the checkpoint
    assert r1 != fresh  # the resumed run does not replay the start's draws
