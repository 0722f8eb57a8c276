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
"""

from __future__ import annotations

import gc

__all__ = ["GcPacer"]


class GcPacer:
    """Call :meth:`tick` once per evaluation. Ticks 0, 20 and 200 (while the caches warm up)
    and every ``every``-th tick: one full collection, then freeze what survives.
    ``every=0`` leaves the collector alone."""

    WARMUP = (20, 200)

    def __init__(self, every: int = 2000) -> None:
        self.every = every
        self._n = -1

    def tick(self) -> None:
        if self.every <= 0:
            return
        self._n += 1
        if self._n % self.every and self._n not in self.WARMUP:
            return
        if self._n:
            gc.unfreeze()
            gc.collect()
        gc.freeze()
