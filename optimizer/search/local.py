"""A single-process search over the native mutation operators, for benchmarks and quick looks.

``local_search(program, hw, budget_s, seeds=...)`` runs a (μ+1) evolution on makespan: each step
picks a parent by binary tournament from the μ best plans (feasible ones first), draws an
operator with the farm's adaptive weights (``AdaptiveWeights``: wins / tries per operator), and
keeps the child if it beats the population's worst. A population stuck in one basin restarts
(see ``local_search``). Every plan carries its lineage as move texts,
so a plan found on a *proxy* (the same model with fewer identical layers: layout moves name
regions such as ``all`` or ``l1.*``, not layer counts) replays on the full model
(``replay``). That is how whole-model searches exploit layer repetition on the search side: the
proxy is cheap to evaluate, the full model is evaluated for the few plans that matter.

The farm (``optimizer.campaign``) runs the same operators on Dask workers with a Pareto archive;
this loop is its one-objective, one-process counterpart with the same moves.
"""

from __future__ import annotations

import re

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from costmodel.evaluate import Evaluator
from ir.graph import Graph
from ir.rewrites import RewriteError, parse_move
from ir.rewrites.tie import tie
from optimizer.search.mutation import DEFAULT_OPERATOR_WEIGHTS, AdaptiveWeights, MutationContext, mutate

SEED_PREFIX = "seed:"


@dataclass
class Plan:
    graph: Graph
    lineage: tuple[str, ...]  # "seed:<baseline>" then move texts
    makespan: float
    peak_memory: float
    feasible: bool

    @property
    def key(self) -> tuple[bool, float]:
        return (not self.feasible, self.makespan)


@dataclass
class SearchRun:
    best: Plan
    population: list[Plan]
    trace: list[tuple[float, float]]  # (seconds, best feasible makespan) at each improvement
    archive: list[tuple[float, float]]  # (makespan, peak memory) of every feasible evaluation
    evaluations: int
    seconds: float
    tries: dict[str, int] = field(default_factory=dict)
    wins: dict[str, int] = field(default_factory=dict)
    restarts: list[int] = field(default_factory=list)  # the evaluation count at each restart


#: evaluations without a better plan before a population restarts, at least (``local_search``)
RESTART_PATIENCE = 1000


def _evaluate(ev: Evaluator, g: Graph, lineage: tuple[str, ...]) -> Plan:
    e = ev(g)
    return Plan(g, lineage, float(e.makespan), float(e.peak_memory), bool(e.feasible))


def local_search(program: Graph, ev: Evaluator, budget_s: float, seeds: Mapping[str, Graph] | None = None,
                 seed: int = 0, mu: int = 12, weights: Mapping[str, float] | None = None,
                 replayable: bool = False, tie_layers: bool = False,
                 patience: int | None = RESTART_PATIENCE) -> SearchRun:
    """Search from ``program`` (and the ``seeds`` plans, by name) for ``budget_s`` seconds.

    ``replayable`` leaves out crossover (its children cannot be replayed from text alone).
    ``tie_layers``: a move in one layer is made in every layer of its class (``ir.rewrites.tie``),
    so repeated layers keep one layout (``replay(..., tie_from=...)`` rebuilds such a lineage).

    Restarts: the population starts again from the start plans (the program and the seeds) when
    its best has not improved for ``max(patience, 2 × e)`` evaluations, ``e`` being the
    evaluations this start took to reach that best. A walk that took a step no single move undoes
    (a reduction split, then its combine fused with the activation: the merge that would undo the
    split no longer applies) keeps its whole population in that basin; a restart walks elsewhere,
    while a run that is still finding better plans, however slowly, is left alone. The operator
    weights carry over; ``population`` holds the ``mu`` best plans of all starts. ``patience=None``:
    no restarts."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    hw = ev.hw
    ctx = MutationContext(hw.n_devices, max(8, 4 * hw.n_devices), devices_per_node=hw.devices_per_node)
    base = dict(DEFAULT_OPERATOR_WEIGHTS if weights is None else weights)
    if replayable:
        base.pop("crossover", None)
    aw = AdaptiveWeights(base, True)
    pop = [_evaluate(ev, program, ())]
    for name, g in (seeds or {}).items():
        pop.append(_evaluate(ev, g, (SEED_PREFIX + name,)))
    seen = {p.graph.digest for p in pop}
    archive = [(p.makespan, p.peak_memory) for p in pop if p.feasible]
    pop.sort(key=lambda p: p.key)
    start = list(pop)
    best = pop[0]
    trace = [(time.perf_counter() - t0, best.makespan if best.feasible else float("inf"))]
    n_eval = len(pop)
    hall: list[Plan] = []  # the populations of earlier starts
    restarts: list[int] = []
    began, gained, start_best = n_eval, n_eval, best.key
    while time.perf_counter() - t0 < budget_s:
        if patience is not None and n_eval - gained >= max(patience, 2 * (gained - began)):
            hall = _best_of(hall + pop, mu)
            pop, seen = list(start), {p.graph.digest for p in start}
            restarts.append(n_eval)
            began, gained, start_best = n_eval, n_eval, start[0].key
        i, j = rng.integers(len(pop), size=2)
        parent = pop[min(i, j)]  # sorted: the lower index is the better plan
        op = aw.choose(rng)
        if op == "crossover":
            ctx.mates = [p.graph for p in pop]
        try:
            child, move = mutate(parent.graph, op, rng, ctx, tie_layers)
        except RewriteError:
            aw.record(op, False)
            continue
        if child.digest in seen:
            aw.record(op, False)
            continue
        seen.add(child.digest)
        plan = _evaluate(ev, child, parent.lineage + (str(move),))
        n_eval += 1
        if plan.feasible:
            archive.append((plan.makespan, plan.peak_memory))
        win = len(pop) < mu or plan.key < pop[-1].key
        aw.record(op, win)
        if win:
            pop.append(plan)
            pop.sort(key=lambda p: p.key)
            del pop[mu:]
            if plan.key < start_best:
                start_best, gained = plan.key, n_eval
            if plan.key < best.key:
                best = plan
                trace.append((time.perf_counter() - t0, best.makespan if best.feasible else float("inf")))
    return SearchRun(best, _best_of(hall + pop, mu), trace, archive, n_eval, time.perf_counter() - t0,
                     dict(aw.tries), dict(aw.wins), restarts)


def _best_of(plans: list[Plan], mu: int) -> list[Plan]:
    """The ``mu`` best of ``plans``, one per digest, best first."""
    out: dict[str, Plan] = {}
    for p in sorted(plans, key=lambda p: p.key):
        out.setdefault(p.graph.digest, p)
    return list(out.values())[:mu]


_LAYER1 = re.compile(r"\bl1(?=[._])")


def replay(program: Graph, lineage: tuple[str, ...], seeds: Callable[[str], Graph] | None = None,
           broadcast: bool = False, tie_from: int | None = None, strict: bool = True,
           skipped: list[str] | None = None) -> Graph:
    """Rebuild a plan from its lineage on ``program`` (e.g. the full model of a proxy's plan);
    ``seeds(name)`` builds a named seed plan on it. Raises ``RewriteError`` if a move does not
    apply there.

    ``broadcast``: a 2-layer proxy's moves on layer 1 (ops ``l1.…``, parameters ``l1_…``) are
    applied to every layer ``1 .. L-1`` of ``program`` (layer 0 keeps its own): the proxy's layer 1
    stands for the repeated middle of the model. A copy that does not apply to some layer is
    skipped there; the move on layer 1 itself must apply.

    ``tie_from``: the lineage was made by ``local_search(..., tie_layers=True)`` on a proxy of
    ``P = tie_from`` layers: a move naming the proxy's last layer is made on ``program``'s last
    layer ``L - 1`` (and the layer before it, ``P - 2``, on ``L - 2``), and every move is tied to
    its layer's class (``ir.rewrites.tie``), as in the search. ``strict=False`` skips a move
    that does not apply on ``program`` (the proxy's classes may have split where the model's did
    not) instead of raising; ``skipped`` (a list) collects their texts."""
    g = program
    n_layers = 0
    if tie_from is not None:
        from ir.rewrites.pipeline import op_layers

        last = re.compile(rf"\bl{tie_from - 1}(?=[._])")
        before = re.compile(rf"\bl{tie_from - 2}(?=[._])")
        n_model = op_layers(program)[1]
    if broadcast:
        from ir.rewrites.pipeline import op_layers

        n_layers = op_layers(program)[1]
    for text in lineage:
        if text.startswith(SEED_PREFIX):
            if seeds is None:
                raise RewriteError(f"lineage starts from seed {text[len(SEED_PREFIX):]!r}, and no seeds were given")
            g = seeds(text[len(SEED_PREFIX):])
            continue
        if tie_from is not None:
            if last.search(text):
                text = before.sub(f"l{n_model - 2}", last.sub(f"l{n_model - 1}", text))
            # a move of several parts (a crossover's retiles of every layer) is tied part by part:
            # as a whole it edits several layers, which ``tie`` leaves as they are, and on the
            # model it names only the proxy's layers (1 .. P-3, and P-2 as L-2), not the others
            for part in [t for t in text.split(";") if t.strip()]:
                try:
                    g = tie(g, parse_move(part).apply(g))
                except RewriteError:
                    if strict:
                        raise
                    if skipped is not None:
                        skipped.append(part.strip())
            continue
        g = parse_move(text).apply(g)
        if n_layers > 2 and _LAYER1.search(text):
            for k in range(2, n_layers):
                try:
                    g = parse_move(_LAYER1.sub(f"l{k}", text)).apply(g)
                except RewriteError:
                    continue
    return g


def time_to_within(trace: list[tuple[float, float]], final: float, tol: float = 0.05) -> float:
    """Seconds until the best makespan first came within ``tol`` of ``final``."""
    for t, v in trace:
        if v <= final * (1 + tol):
            return t
    return float("nan")


__all__ = ["Plan", "SearchRun", "local_search", "replay", "time_to_within"]
