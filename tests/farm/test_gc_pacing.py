"""The evaluator's garbage-collector pacing (``costmodel.gc_pacing``) frees cyclic garbage over a
campaign (issue 16): no freeze pins garbage, a short-lived evaluator leaves the collector alone,
and the farm's driver unfreezes on its minute timer."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from costmodel.gc_pacing import GcPacer
from optimizer.campaign import farm as farm_module
from optimizer.campaign.farm import Budget, Farm


class _Node:
    """A reference cycle (``self.me = self``): only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    gc.unfreeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()


def _cycle() -> tuple[list, weakref.ref]:
    holder = [_Node()]
    return holder, weakref.ref(holder[0])


def test_no_freeze_pins_garbage_that_exists_when_it_freezes() -> None:
    _holder, alive = _cycle()
    garbage = _Node()
    dead = weakref.ref(garbage)
    del garbage  # cyclic garbage, not collected yet
    pacer = GcPacer(every=2000)
    for _ in range(21):  # tick 20: the first freeze
        pacer.tick()
    assert pacer.collections == 1
    assert dead() is None  # collected before the freeze, not frozen with the live objects
    assert alive() is not None
    assert gc.get_freeze_count() > 0


def test_an_object_frozen_alive_that_dies_in_a_cycle_is_freed_at_the_next_freeze() -> None:
    holder, ref = _cycle()
    pacer = GcPacer(every=2000)
    for _ in range(21):
        pacer.tick()
    holder.clear()  # the frozen cycle is garbage now; a plain collection does not look at it
    gc.collect()
    assert ref() is not None
    for _ in range(180):  # ticks 21..200: the warm-up's second freeze
        pacer.tick()
    assert pacer.collections == 2
    assert ref() is None


def test_a_short_lived_evaluator_leaves_the_collector_alone() -> None:
    pacer = GcPacer(every=2000)
    for _ in range(GcPacer.WARMUP[0]):  # fewer ticks than the first warm-up freeze
        pacer.tick()
    assert pacer.collections == 0
    assert gc.get_freeze_count() == 0


def test_pacing_off() -> None:
    pacer = GcPacer(every=0)
    for _ in range(300):
        pacer.tick()
    assert pacer.collections == 0 and gc.get_freeze_count() == 0
    assert gc.get_threshold() == (700, 10, 10)


def test_the_first_freeze_raises_the_thresholds_and_young_cycles_are_still_freed() -> None:
    pacer = GcPacer(every=2000)
    for _ in range(GcPacer.WARMUP[0]):
        pacer.tick()
    assert gc.get_threshold() == (700, 10, 10)  # a short-lived evaluator changes nothing
    pacer.tick()
    assert gc.get_threshold() == GcPacer.THRESHOLDS
    refs = []
    for _ in range(3):  # cycles made after the freeze die in a young collection
        garbage = _Node()
        refs.append(weakref.ref(garbage))
        del garbage
    junk = [[i] for i in range(3 * GcPacer.THRESHOLDS[0])]  # enough allocations for young collections
    del junk
    assert all(r() is None for r in refs)


def test_the_drivers_trim_unfreezes_and_collects(monkeypatch: pytest.MonkeyPatch) -> None:
    class Client:
        def run(self, fn, *args, wait: bool = True) -> None:
            pass

    monkeypatch.setattr(farm_module, "trim_memory", lambda: True)
    farm = Farm("c", archive=None, client=Client(), strategy=None, objectives=["makespan"], reference=[1.0],
                budget=Budget(None, None, None), epsilon=0.01, checkpoint_seconds=60.0,
                rng=np.random.default_rng(0))
    holder, ref = _cycle()
    gc.freeze()  # as a sampler refit's rescore Evaluator would
    holder.clear()
    farm.trim_memory()
    assert ref() is None
    assert gc.get_freeze_count() == 0
