"""Optuna strategy: NSGA-II or TPE over per-operation shard factors, placements, reduction splits.

Ask-and-tell from the driver; the study lives in the campaign's database (optuna's RDB
storage), so optuna-dashboard can browse it. Optuna with an RDB manages about ten trials per
second, so one trial is not one cheap evaluation: each task evaluates a batch of trials and
refines each with a few local mutations, and the trial reports the refined plan's objectives.

Parameters per op of the program: ``<op>.<dim>`` parts (powers of two up to the fleet and the
extent), ``<op>.offset`` (first device of its round-robin placement) and, for ops with a hidden
reduction, ``<op>.red`` (reduction blocks, 1 = not split).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np

from ir.graph import Graph
from ir.rewrites import RewriteError, retile, split_reduction
from ir.serialize import dumps, loads
from optimizer.search.strategies.base import SearchContext, Strategy
from optimizer.search.worker import EvaluateTaskSpec, evaluate_task

TRIALS_PER_TASK = 4


def _choices(extent: int, n: int) -> list[int]:
    return [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= min(extent, n)]


def decode(base: Graph, params: dict[str, Any], n_devices: int) -> Graph:
    """Build the plan a trial's parameters describe."""
    g = base
    for name in list(base.ops):
        sig = base.signature(name)
        parts = [int(params.get(f"{name}.{d}", 1)) for d in sig.dims]
        offset = int(params.get(f"{name}.offset", 0))
        red = int(params.get(f"{name}.red", 1))
        n_tiles = int(np.prod(parts)) if parts else 1
        if red > 1:
            g = split_reduction(g, name, red)
            tiles = red * n_tiles
            g = retile(g, name, [red] + parts, [(offset + i) % n_devices for i in range(tiles)])
            g = retile(g, f"{name}.acc", parts, [(offset + i) % n_devices for i in range(n_tiles)])
        elif sig.dims:
            g = retile(g, name, parts, [(offset + i) % n_devices for i in range(n_tiles)])
    return g


def suggest(trial: Any, base: Graph, n_devices: int) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for name in base.ops:
        sig = base.signature(name)
        for d, e in zip(sig.dims, sig.extents):
            params[f"{name}.{d}"] = trial.suggest_categorical(f"{name}.{d}", _choices(e, n_devices))
        params[f"{name}.offset"] = trial.suggest_int(f"{name}.offset", 0, n_devices - 1)
        if sig.reductions:
            ext = sig.reductions[0].extent
            params[f"{name}.red"] = trial.suggest_categorical(
                f"{name}.red", [k for k in _choices(ext, n_devices) if ext % k == 0])
    return params


def optuna_storage_url(url: str) -> str:
    from storage.engine import normalize_url

    return normalize_url(url).render_as_string(hide_password=False)


class OptunaStrategy(Strategy):
    name = "optuna"

    def __init__(self, ctx: SearchContext, sampler: str = "nsga2") -> None:
        super().__init__(ctx)
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.base = loads(ctx.base_json)
        self.sampler_name = sampler
        self.study = optuna.create_study(storage=optuna_storage_url(ctx.storage_url), study_name=ctx.campaign,
                                         sampler=self._sampler(ctx.seed),
                                         directions=["minimize"] * len(ctx.objectives), load_if_exists=True)
        with warnings.catch_warnings():  # experimental since Optuna 3.2, stable in use; only labels the dashboard
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.study.set_metric_names(list(ctx.objectives))
        self.refine = max(0, ctx.search.steps_per_task // (TRIALS_PER_TASK * 4))

    def _sampler(self, seed: int) -> Any:
        import optuna

        if self.sampler_name == "tpe":
            return optuna.samplers.TPESampler(seed=seed, multivariate=True)
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(8, self.ctx.search.population))

    def seed_population(self, records: list[dict]) -> None:
        pass  # the sampler starts from its own random trials

    def next_task(self, rng: np.random.Generator, front: list[dict] | None = None) -> tuple[Callable, EvaluateTaskSpec,
                                                                                            dict]:
        plans, trials = [], []
        for _ in range(TRIALS_PER_TASK):
            trial = self.study.ask()
            try:
                g = decode(self.base, suggest(trial, self.base, self.ctx.n_devices), self.ctx.n_devices)
            except RewriteError:
                self.study.tell(trial, state=_fail())
                continue
            plans.append((trial.number, dumps(g, indent=None)))
            trials.append(trial.number)
        self.task_index += 1
        spec = EvaluateTaskSpec(**self.common_spec(), plans=tuple(plans), seed=(self.ctx.seed, 0, self.task_index),
                                refine_steps=self.refine, time_limit=None)
        return evaluate_task, spec, {"trials": trials, "task": self.task_index}

    def on_result(self, meta: dict, result: dict, front: list[dict]) -> list[dict]:
        out = []
        for r in result["results"]:
            if r.pop("acceptable"):
                self.study.tell(r.pop("trial"), [float(r["objectives"][n]) for n in self.ctx.objectives])
                out.append(r)
            else:
                self.study.tell(r.pop("trial"), state=_fail())
        return out

    def on_failure(self, meta: dict) -> None:
        for t in meta.get("trials", []):
            self.study.tell(t, state=_fail())

    def load_json(self, state: dict, fetch_graph: Callable[[str], str]) -> None:
        import optuna

        super().load_json(state, fetch_graph)
        # The sampler's RNG is not in the checkpoint (Optuna keeps it in memory only); reseeding it
        # from the campaign seed and the restored task count keeps a resume deterministic without
        # replaying the draws the first run started with. The study itself (trials, NSGA-II
        # generations) lives in the database.
        self.study.sampler = self._sampler(int(np.random.SeedSequence([self.ctx.seed, 7, self.task_index])
                                               .generate_state(1)[0]))
        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            self.study.tell(t.number, state=_fail())  # asked before a crash, never told


def _fail():
    import optuna

    return optuna.trial.TrialState.FAIL
