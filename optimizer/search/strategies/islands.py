"""Native asynchronous island evolution (NSGA-II style selection over graph rewrites).

Each island keeps a population; a task takes ``parents_per_task`` parents chosen by binary
tournament on (rank, crowding) plus, every ``migration_interval`` tasks, a migrant from the
global front, runs hundreds of mutate-and-evaluate steps on a worker and returns its new
non-dominated plans; survivors are chosen by NSGA-II (rank, then crowding). The random-search
baseline is the same machinery with plain random rewrites restarted from the program.

Restarts: an island whose best value of every objective (its ideal point) has not improved by
0.1% for ``search.restart_after`` of its tasks starts again from the start plans (the program,
and the baselines where seeded), and takes no migrant for as many tasks, so that its new walk is
its own. A population that took a step no single move undoes (a reduction split, then its
combine fused with the activation) otherwise stays in that basin for good; the archive keeps
every plan found, so nothing is lost. (The island's first front as a set is no test of progress:
some trade-off point in the middle of a front changes in nearly every task.)
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from optimizer.search.mutation import DEFAULT_OPERATOR_WEIGHTS, AdaptiveWeights
from optimizer.search.pareto import rank_and_crowding, select_nsga2
from optimizer.search.strategies.base import SearchContext, Strategy
from optimizer.search.worker import SearchTaskSpec, search_task


def _member(r: dict, names: list[str]) -> dict:
    return {"digest": r["digest"], "graph_json": r["graph_json"], "f": [float(r["objectives"][n]) for n in names]}


class IslandStrategy(Strategy):
    name = "native"
    mode = "evolve"

    def __init__(self, ctx: SearchContext) -> None:
        super().__init__(ctx)
        s = ctx.search
        self.n_islands = s.islands
        self.population = s.population
        self.islands: list[list[dict]] = [[] for _ in range(self.n_islands)]
        self.island_tasks = [0] * self.n_islands
        base = dict(DEFAULT_OPERATOR_WEIGHTS)
        base.update(s.mutation_weights)
        self.weights = AdaptiveWeights(base, s.adaptive_weights)
        self.next_island = 0
        self.start: list[dict] = []  # the plans every island starts (and restarts) from
        self.stale = [0] * self.n_islands  # tasks since some best value of the island last improved
        self.quiet = [0] * self.n_islands  # tasks left without a migrant (after a restart)
        self.restarts = 0

    def seed_population(self, records: list[dict]) -> None:
        self.start = [_member(r, self.ctx.objectives) for r in records]
        for isl in self.islands:
            isl.extend(self.start)

    def _parents(self, rng: np.random.Generator, pop: list[dict], k: int) -> list[dict]:
        if len(pop) <= k:
            return list(pop)
        F = np.array([m["f"] for m in pop])
        rank, crowd = rank_and_crowding(F)
        chosen: list[int] = []
        for _ in range(k * 3):
            a, b = rng.integers(len(pop), size=2)
            win = a if (rank[a], -crowd[a]) <= (rank[b], -crowd[b]) else b
            if int(win) not in chosen:
                chosen.append(int(win))
            if len(chosen) == k:
                break
        return [pop[i] for i in chosen]

    def next_task(self, rng: np.random.Generator, front: list[dict] | None = None) -> tuple[Callable, SearchTaskSpec,
                                                                                            dict] | None:
        """The next island's task, or None when there is nothing to start from (no population and
        no front: a campaign whose start failed before its baselines were archived)."""
        if self.mode == "evolve" and not any(self.islands) and not front:
            return None
        i = self.next_island
        self.next_island = (i + 1) % self.n_islands
        pop = self.islands[i]
        k = self.ctx.search.parents_per_task
        parents = self._parents(rng, pop, k)
        migrate = not parents or (self.island_tasks[i] % self.ctx.search.migration_interval == 0 and not self.quiet[i])
        if front and migrate:
            parents.append(front[int(rng.integers(len(front)))])
        self.quiet[i] = max(self.quiet[i] - 1, 0)
        if not parents:  # this island is empty: borrow a member of another
            donors = [m for isl in self.islands for m in isl]
            parents = [donors[int(rng.integers(len(donors)))]]
        if self.mode == "random":
            parents = [{"digest": self.ctx.base_digest, "graph_json": self.ctx.base_json}]
        self.island_tasks[i] += 1
        self.task_index += 1
        names, p = self.weights.probabilities()
        spec = SearchTaskSpec(**self.common_spec(), parents=tuple((m["digest"], m["graph_json"]) for m in parents),
                              seed=(self.ctx.seed, i, self.task_index), steps=self.ctx.search.steps_per_task,
                              weights=dict(zip(names, p.tolist())) if self.mode == "evolve" else {"rewrite": 1.0},
                              adaptive=self.ctx.search.adaptive_weights, returns=self.ctx.search.returns_per_task,
                              mode=self.mode, time_limit=None)
        return search_task, spec, {"island": i, "task": self.task_index}

    def on_result(self, meta: dict, result: dict, front: list[dict]) -> list[dict]:
        self.weights.merge_stats(result.get("tries", {}), result.get("wins", {}))
        i = meta["island"]
        pop = self.islands[i]
        before = _ideal(pop)
        seen = {m["digest"] for m in pop}
        for r in result["results"]:
            if r["digest"] not in seen:
                pop.append(_member(r, self.ctx.objectives))
                seen.add(r["digest"])
        if len(pop) > self.population:
            keep = select_nsga2(np.array([m["f"] for m in pop]), self.population, np.random.default_rng(
                [self.ctx.seed, i, meta["task"], 7]))
            self.islands[i] = [pop[j] for j in sorted(keep)]
        self._maybe_restart(i, before)
        return result["results"]

    def _maybe_restart(self, i: int, before: np.ndarray | None) -> None:
        after = self.ctx.search.restart_after
        if self.mode != "evolve" or not after or not self.start:
            return
        now = _ideal(self.islands[i])
        better = before is None or (now is not None and bool(np.any(now < before * (1.0 - IMPROVEMENT))))
        self.stale[i] = 0 if better else self.stale[i] + 1
        if self.stale[i] >= after:
            self.islands[i] = list(self.start)
            self.stale[i], self.quiet[i] = 0, after
            self.restarts += 1

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "islands": [[{"digest": m["digest"], "f": m["f"]} for m in isl]
                                                  for isl in self.islands],
                "island_tasks": self.island_tasks, "next_island": self.next_island,
                "weights": self.weights.to_json(), "start": [{"digest": m["digest"], "f": m["f"]} for m in self.start],
                "stale": self.stale, "quiet": self.quiet, "restarts": self.restarts}

    def load_json(self, state: dict, fetch_graph: Callable[[str], str]) -> None:
        super().load_json(state, fetch_graph)
        self.islands = [[{"digest": m["digest"], "f": m["f"], "graph_json": fetch_graph(m["digest"])} for m in isl]
                        for isl in state["islands"]]
        self.island_tasks = list(state["island_tasks"])
        self.next_island = int(state["next_island"])
        self.weights = AdaptiveWeights.from_json(state["weights"])
        # checkpoints written before restarts existed: no start plans, so no restarts
        self.start = [{"digest": m["digest"], "f": m["f"], "graph_json": fetch_graph(m["digest"])}
                      for m in state.get("start", [])]
        n = len(self.islands)
        self.stale = list(state.get("stale", [0] * n))
        self.quiet = list(state.get("quiet", [0] * n))
        self.restarts = int(state.get("restarts", 0))


#: the relative gain in some objective's best value that counts as progress (restarts)
IMPROVEMENT = 1e-3


def _ideal(pop: list[dict]) -> np.ndarray | None:
    """The best value of each objective over a population (None when it is empty)."""
    return np.array([m["f"] for m in pop]).min(axis=0) if pop else None


class RandomSearch(IslandStrategy):
    """Baseline: random walks of plain random rewrites from the unsharded program."""

    name = "random"
    mode = "random"
