"""Search tasks that run on Dask workers. Stateless: plain data in, plain data out.

A task receives parent plans (JSON), the hardware (as a dict), objectives, constraints and a
seed, runs many mutate-and-evaluate steps locally (hundreds, so Dask's per-task milliseconds
are amortised), and returns its best new plans with their objectives. The only per-process
state is a cache of ``Evaluator`` objects (numba is compiled and caches are warm after the
first task in a process).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import numpy as np

from ir.graph import Graph
from ir.rewrites import RewriteError
from ir.serialize import dumps, loads
from optimizer.search.mutation import DEFAULT_OPERATOR_WEIGHTS, AdaptiveWeights, MutationContext, mutate
from optimizer.search.pareto import crowding_distance

_EVALUATORS: dict[str, Any] = {}

#: steps of one random walk before the random-search baseline restarts from the program
RANDOM_WALK_LENGTH = 30


@dataclass(frozen=True)
class TaskConstraints:
    """The campaign's constraints as a task sees them (values from the config's ``constraints``)."""

    feasible_only: bool
    max_devices: int | None
    max_peak_memory: float | None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TaskConstraints:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class SearchTaskSpec:
    """What one ``search_task`` runs. Every field is set by the strategy from the campaign config
    (defaults live there, once); the spec crosses to a Dask worker and into checkpoints
    (``to_json`` / ``from_json``).

    ``parents``: (digest, graph JSON) pairs; ``seed``: entropy for ``SeedSequence``; ``steps``:
    mutate-and-evaluate steps; ``weights``: operator weights; ``returns``: at most this many plans
    come back (by crowding distance); ``mode``: ``"evolve"`` (parents chosen from the task's
    front) or ``"random"`` (random walks of plain random rewrites restarting from the first
    parent: the baseline); ``time_limit``: seconds after which the task stops stepping and
    returns what it has (set by the farm from the wall-time budget; None: no limit)."""

    parents: tuple[tuple[str, str], ...]
    hardware: dict[str, Any]
    objectives: tuple[str, ...]
    constraints: TaskConstraints
    max_shards_per_op: int | None
    seed: tuple[int, ...]
    steps: int
    weights: dict[str, float]
    adaptive: bool
    returns: int
    mode: Literal["evolve", "random"]
    time_limit: float | None
    layers: str = "whole"  # "repeat": Evaluator(layers="repeat") and tied moves (search.layers)

    def max_evaluations(self) -> int:
        """The most evaluations this task can count (its parents and every step)."""
        return len(self.parents) + self.steps

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SearchTaskSpec:
        d = {"time_limit": None, "layers": "whole", **d}  # checkpoints written before these existed
        kw = {f.name: d[f.name] for f in fields(cls)}
        kw.update(parents=tuple((str(a), str(b)) for a, b in d["parents"]), objectives=tuple(d["objectives"]),
                  constraints=TaskConstraints.from_json(d["constraints"]), seed=tuple(d["seed"]))
        return cls(**kw)


@dataclass(frozen=True)
class EvaluateTaskSpec:
    """What one ``evaluate_task`` runs: ``plans`` as (trial number, graph JSON), each refined by
    ``refine_steps`` local mutations (the Optuna strategy's trials), refinement stopping after
    ``time_limit`` seconds. Set from the config."""

    plans: tuple[tuple[int, str], ...]
    hardware: dict[str, Any]
    objectives: tuple[str, ...]
    constraints: TaskConstraints
    max_shards_per_op: int | None
    seed: tuple[int, ...]
    refine_steps: int
    time_limit: float | None
    layers: str = "whole"

    def max_evaluations(self) -> int:
        return len(self.plans) * (1 + self.refine_steps)

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EvaluateTaskSpec:
        d = {"time_limit": None, "layers": "whole", **d}  # checkpoints written before these existed
        kw = {f.name: d[f.name] for f in fields(cls)}
        kw.update(plans=tuple((int(a), str(b)) for a, b in d["plans"]), objectives=tuple(d["objectives"]),
                  constraints=TaskConstraints.from_json(d["constraints"]), seed=tuple(d["seed"]))
        return cls(**kw)


def evaluator_for(hw_dict: dict, layers: str = "whole") -> Any:
    """The process's evaluator for this hardware and ``layers`` mode (created, and numba warmed
    up, once)."""
    from costmodel.evaluate import Evaluator
    from costmodel.hardware import Hardware
    from costmodel.lowering import warmup as warm_lowering
    from costmodel.simulate import warmup

    key = hashlib.sha256(json.dumps([hw_dict, layers], sort_keys=True).encode()).hexdigest()
    ev = _EVALUATORS.get(key)
    if ev is None:
        warmup()  # numba compiles per process: once per worker, not per task
        warm_lowering()
        ev = _EVALUATORS[key] = Evaluator(Hardware.from_dict(hw_dict), layers=layers)
    return ev


class _PlanCache:
    """Plans this process already parsed and validated, by the SHA-256 of their text: the
    ``max_plans`` latest, up to ``max_shards`` shards in all. The farm sends the same parents (front
    members) again and again: parsing and validating a whole-model plan takes up to seconds
    (llama2-7b ZeRO-3 on 64 GPUs: 0.3 s; llama2-70b on 512: 0.9 s), hashing its text milliseconds;
    and the very same Graph object lets the lowering reuse its pieces."""

    def __init__(self, max_shards: int = 2_000_000, max_plans: int = 64) -> None:
        self.max_shards, self.max_plans = max_shards, max_plans
        self.d: OrderedDict[bytes, Graph] = OrderedDict()
        self.shards = 0
        self.hits = self.misses = 0

    def get(self, text: str, what: str) -> Graph:
        key = hashlib.sha256(text.encode()).digest()
        g = self.d.get(key)
        if g is not None:
            self.d.move_to_end(key)
            self.hits += 1
            return g
        self.misses += 1
        g = loads(text, f"plan {what[:16]}")
        if g.n_shards <= self.max_shards // 4:
            self.d[key] = g
            self.shards += g.n_shards
            while self.shards > self.max_shards or len(self.d) > self.max_plans:
                self.shards -= self.d.popitem(last=False)[1].n_shards
        return g


_PLANS = _PlanCache()


def plan_from_archive(text: str, what: str) -> Graph:
    """A plan read from the archive (or sent by the driver), validated: a corrupted or hand-edited
    row fails the task with the plan's problems instead of computing on a broken graph. A text
    validated before in this process is not parsed again (``_PlanCache``)."""
    return _PLANS.get(text, what)


def worker_name() -> str:
    try:
        from distributed import get_worker

        return get_worker().name if not isinstance(get_worker().name, int) else f"worker-{get_worker().name}"
    except (ImportError, ValueError):
        return f"{socket.gethostname()}:{os.getpid()}"


def objective_vector(ev: Any, names: list[str]) -> np.ndarray:
    o = ev.objectives()
    return np.array([o[n] for n in names], dtype=np.float64)


def acceptable(ev: Any, constraints: TaskConstraints) -> bool:
    """Whether an evaluated plan may enter a front under the campaign's constraints."""
    if constraints.feasible_only and not ev.feasible:
        return False
    if constraints.max_devices and ev.devices > constraints.max_devices:
        return False
    if constraints.max_peak_memory and ev.peak_memory > constraints.max_peak_memory:
        return False
    return True


def record(g: Graph, ev: Any, parent: str | None, move: str | None, seconds: float) -> dict:
    """The plain-data result of one plan, in the archive's ``add_results`` item form (less seq)."""
    return {"digest": g.digest, "graph_json": dumps(g, indent=None), "parent_digest": parent, "rewrite": move,
            "objectives": {**ev.objectives(), "devices": int(ev.devices)}, "feasible": bool(ev.feasible), "lower_bound": ev.lower_bound,
            "gap": ev.gap, "eval_seconds": seconds}


class LocalFront:
    """The task's own non-dominated set (small; vectorised dominance checks)."""

    def __init__(self) -> None:
        self.F = np.zeros((0, 0))
        self.items: list[tuple[Graph, Any, str | None, str | None, float]] = []

    def offer(self, f: np.ndarray, item: tuple) -> bool:
        if len(self.items):
            if np.any(np.all(self.F <= f, axis=1)):
                return False  # dominated by (or equal to) a member
            keep = ~np.all(f <= self.F, axis=1)
            self.F = self.F[keep]
            self.items = [it for it, k in zip(self.items, keep) if k]
            self.F = np.vstack([self.F, f])
        else:
            self.F = f[None, :].copy()
        self.items.append(item)
        return True


def search_task(spec: SearchTaskSpec) -> dict:
    """Run ``spec.steps`` mutate-and-evaluate steps from ``spec.parents`` (see ``SearchTaskSpec``)."""
    t0 = time.perf_counter()
    if not spec.parents:
        raise ValueError("a search task needs at least one parent plan; the strategy sent none")
    loaded = [(plan_from_archive(text, digest), digest) for digest, text in spec.parents]  # validated first
    ev_fn = evaluator_for(spec.hardware, spec.layers)
    tied = spec.layers == "repeat"  # repeated layers keep one layout: a move is made in all alike
    names = list(spec.objectives)
    constraints = spec.constraints
    rng = np.random.default_rng(np.random.SeedSequence(list(spec.seed)))
    n_dev = ev_fn.hw.n_devices
    ctx = MutationContext(n_dev, spec.max_shards_per_op or max(8, 4 * n_dev),
                          devices_per_node=ev_fn.hw.devices_per_node)
    weights = AdaptiveWeights(dict(spec.weights), spec.adaptive)
    front = LocalFront()
    parents: list[tuple[Graph, str]] = []
    parent_digests = set()
    for g, digest in loaded:
        parents.append((g, digest))
        parent_digests.add(digest)
        e = ev_fn(g)
        if acceptable(e, constraints):
            front.offer(objective_vector(e, names), (g, e, None, None, 0.0))
    evaluations = len(parents)
    random_mode = spec.mode == "random"
    walk_len = RANDOM_WALK_LENGTH
    current, cur_digest = parents[0]
    deadline = math.inf if spec.time_limit is None else t0 + spec.time_limit
    for step in range(int(spec.steps)):
        if time.perf_counter() >= deadline:
            break
        if random_mode:
            if step % walk_len == 0:
                current, cur_digest = parents[0]
            parent = current
            op_name = "rewrite"
        else:
            if front.items and rng.random() < 0.85:
                parent = front.items[int(rng.integers(len(front.items)))][0]
            else:
                parent = parents[int(rng.integers(len(parents)))][0]
            op_name = weights.choose(rng)
            if op_name == "crossover":
                ctx.mates = [it[0] for it in front.items] + [p for p, _ in parents]
        try:
            child, move = mutate(parent, op_name, rng, ctx, tied)
        except RewriteError:
            weights.record(op_name, False)
            continue
        ts = time.perf_counter()
        e = ev_fn(child)
        dt = time.perf_counter() - ts
        evaluations += 1
        win = False
        if acceptable(e, constraints):
            win = front.offer(objective_vector(e, names), (child, e, parent, str(move), dt))
        weights.record(op_name, win)
        if random_mode:
            current = child
    out = []
    for g, e, parent, move, dt in front.items:
        if g.digest in parent_digests:
            continue
        out.append(record(g, e, parent.digest if isinstance(parent, Graph) else None, move, dt))
    if len(out) > spec.returns:
        F = np.array([[r["objectives"][n] for n in names] for r in out])
        keep = np.argsort(-crowding_distance(F), kind="stable")[: spec.returns]
        out = [out[i] for i in sorted(keep)]
    return {"results": out, "evaluations": evaluations, "tries": weights.tries, "wins": weights.wins,
            "seconds": time.perf_counter() - t0, "worker": worker_name()}


def evaluate_task(spec: EvaluateTaskSpec) -> dict:
    """Evaluate given plans (the Optuna strategy's trials), each refined by ``spec.refine_steps``
    local mutations; returns one best record per plan."""
    t0 = time.perf_counter()
    ev_fn = evaluator_for(spec.hardware, spec.layers)
    names = list(spec.objectives)
    constraints = spec.constraints
    rng = np.random.default_rng(np.random.SeedSequence(list(spec.seed)))
    ctx = MutationContext(ev_fn.hw.n_devices, spec.max_shards_per_op or max(8, 4 * ev_fn.hw.n_devices),
                          devices_per_node=ev_fn.hw.devices_per_node)
    weights = AdaptiveWeights(dict(DEFAULT_OPERATOR_WEIGHTS), False)
    out, evaluations = [], 0
    deadline = math.inf if spec.time_limit is None else t0 + spec.time_limit
    for key, text in spec.plans:
        g = plan_from_archive(text, f"trial {key}")
        ts = time.perf_counter()
        best_e, best_g, best_move = ev_fn(g), g, None
        evaluations += 1
        dt = time.perf_counter() - ts
        scalar = lambda e: float(np.sum(np.log(np.maximum(objective_vector(e, names), 1e-30))))  # noqa: E731
        for _ in range(int(spec.refine_steps)):
            if time.perf_counter() >= deadline:
                break
            op = weights.choose(rng)
            try:
                child, move = mutate(best_g, op, rng, ctx, spec.layers == "repeat")
            except RewriteError:
                continue
            e = ev_fn(child)
            evaluations += 1
            if acceptable(e, constraints) and (not acceptable(best_e, constraints) or scalar(e) < scalar(best_e)):
                best_e, best_g, best_move = e, child, str(move)
        r = record(best_g, best_e, g.digest if best_move else None, best_move, dt)
        r["trial"] = key
        r["acceptable"] = acceptable(best_e, constraints)
        out.append(r)
    return {"results": out, "evaluations": evaluations, "seconds": time.perf_counter() - t0,
            "worker": worker_name()}
