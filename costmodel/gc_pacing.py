"""Garbage-collector pacing for processes that evaluate plans in a loop.

An evaluator keeps hundreds of thousands of long-lived objects in its caches (lowered pieces,
structures, signatures). CPython's cyclic collector traverses every tracked object on each full
(generation-2) collection, and the many small tuples and lists an evaluation allocates trigger
such collections every few evaluations: measured on a 12-layer GPT-2 training step on 8 devices
(about 370,000 tracked objects), collections took two thirds of the evaluation time
(``scripts/bench_costmodel.py``; ``docs/benchmarks.md``).

``GcPacer`` moves the long-lived objects out of the collector's sight with ``gc.freeze()``
(Python >= 3.7: "move all objects tracked by the garbage collector into a permanent generation,
i.e. ignore them in all future collections", the ``gc`` module documentation). Frozen objects
are still freed by reference counting as caches evict them; only reference *cycles* among frozen
objects would outlive their use, so every ``every`` ticks the pacer unfreezes, runs one full
collection and freezes again: memory stays flat over a multi-day campaign (issue 16) for one
full collection per ``every`` evaluations instead of one per few.

The pacer also raises the collector's thresholds at its first freeze (``THRESHOLDS``: a young
collection every 20,000 net allocations instead of 700, older generations 50 times rarer than
that): an evaluation allocates tens of thousands of short-lived tuples and lists, most freed by
reference counting, and with the default thresholds the collections of the objects made since the
last freeze still took a fifth of a training step's evaluation (gpt2-small-train@8: 77-89 ->
91-98 evaluations/s; with the collector off, 97). The pacer's own full collection every
``every`` ticks still reclaims cycles.

Every freeze follows a full collection (``gc.unfreeze(); gc.collect(); gc.freeze()``), the first
one too: ``gc.freeze()`` is process-wide, so a freeze without a collection pins whatever cyclic
garbage the process holds at that moment, and objects frozen while alive that later become
cyclic garbage stay until the next freeze. An evaluator used for fewer than ``WARMUP[0]``
evaluations (``evaluate()``, a rescore of a few plans in the campaign's driver) never freezes;
one used a little longer pins at most what dies before the process's next freeze (the farm's
driver also unfreezes and collects once a minute, ``optimizer.campaign.farm.Farm.trim_memory``).
"""

from __future__ import annotations

import gc

__all__ = ["GcPacer", "collect_and_freeze"]


class GcPacer:
    """Call :meth:`tick` once per evaluation. Ticks 20 and 200 (while the caches warm up) and
    every ``every``-th tick after the first: one full collection, then freeze what survives
    (see the module docstring). ``every=0`` leaves the collector alone."""

    WARMUP = (20, 200)
    #: ``gc.set_threshold`` from the first freeze on (see the module docstring)
    THRESHOLDS = (20_000, 50, 50)

    def __init__(self, every: int = 2000) -> None:
        self.every = every
        self._n = -1
        self.collections = 0  # freezes done by this pacer (each after one full collection)

    def tick(self) -> None:
        if self.every <= 0:
            return
        self._n += 1
        if self._n not in self.WARMUP and (self._n == 0 or self._n % self.every):
            return
        collect_and_freeze()
        if not self.collections and gc.get_threshold()[0] < self.THRESHOLDS[0]:
            gc.set_threshold(*self.THRESHOLDS)
        self.collections += 1


def collect_and_freeze() -> None:
    """Unfreeze, run one full collection, freeze the survivors."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
