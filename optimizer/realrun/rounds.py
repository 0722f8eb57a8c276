"""Interleaved repeated passes: time calibration kernels and plans in rounds, the order shuffled
each round, and keep per item the statistic over all its rounds.

Why: on a shared machine the load drifts over tens of seconds. Measured one after another
(calibration first, then plan after plan, each with all its repeats at once), a slow spell
lands on whichever items were being timed then: the calibration made in a quiet first ten
seconds predicted every plan of a busier minute ~0.3-0.4 log units too fast, and plans timed
in a busy spell ranked as slower plans (docs/benchmarks.md, "Model fidelity on this CPU").
Spread over ``rounds`` passes, each a fresh random order of *all* items (kernel points and
plans together), every item is timed in every part of the run, and with ``statistic="min"`` it
keeps its least disturbed figure, so drift hits the calibration and every plan alike.

:func:`measure_rounds` returns what the one-pass functions return: kernel records as
``optimizer.realrun.calibration.measure_spread`` makes them (``seconds`` = ``statistic`` over the
rounds' figures, each itself ``statistic`` of ``repeats`` timed runs; ``rounds`` added) and per
plan the records of ``optimizer.realrun.measurement.measure_plan``, merged over the rounds by
``merge_rounds``. ``rounds=1`` is the one-pass measurement, in a shuffled order.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import numpy as np

from executor.measure import STATISTICS, time_ops
from optimizer.realrun.calibration import Case, record_of
from optimizer.realrun.measurement import measure_plan, merge_rounds

__all__ = ["measure_rounds"]


def measure_rounds(cases: Sequence[Case], plans: Sequence[tuple[Hashable, Any]], hw: Any, backend: str = "numpy",
                   rounds: int = 3, repeats: int = 2, warmup: int = 1, statistic: str = "min", seed: int = 0,
                   progress: Callable[[int, int], None] | None = None
                   ) -> tuple[list[dict[str, Any]], dict[Hashable, list[dict[str, Any]]]]:
    """Time ``cases`` (one-op calibration points) and ``plans`` (``(key, Graph)`` pairs; keys
    unique) in ``rounds`` interleaved passes (see the module docstring); ``repeats`` timed runs
    per item and round, after ``warmup``. ``hw``: the hardware ``measure_plan`` predicts with.
    ``progress(round, rounds)`` is called after each round. Returns ``(kernel records in the
    order of cases, {plan key: merged records})``."""
    if rounds < 1:
        raise ValueError(f"rounds: at least 1, got {rounds}")
    keys = [k for k, _ in plans]
    if len(set(keys)) != len(keys):
        raise ValueError("measure_rounds: plan keys must be unique")
    pick = STATISTICS[statistic]
    graphs = [c.build() for c in cases]
    kernel_s: list[list[float]] = [[] for _ in cases]
    plan_r: list[list[list[dict[str, Any]]]] = [[] for _ in plans]
    rng = np.random.default_rng([seed, 7])
    n = len(cases) + len(plans)
    for r in range(rounds):
        for j in rng.permutation(n):
            j = int(j)
            if j < len(cases):
                (name,) = graphs[j].topo_order
                kernel_s[j].append(time_ops(graphs[j], backend, repeats=repeats, warmup=warmup,
                                            statistic=statistic)[name])
            else:
                p = j - len(cases)
                plan_r[p].append(measure_plan(plans[p][1], hw, backend, repeats=repeats, warmup=warmup,
                                              statistic=statistic))
        if progress is not None:
            progress(r + 1, rounds)
    kernels = []
    for c, g, secs in zip(cases, graphs, kernel_s):
        rec = record_of(g, float(pick(secs)))
        rec["case"] = c.name
        rec["rounds"] = len(secs)
        kernels.append(rec)
    return kernels, {k: merge_rounds(rs, statistic) for k, rs in zip(keys, plan_r)}
