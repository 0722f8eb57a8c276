"""Every memo of the lowerer is capped (issue 16: flat worker memory over days), and evicting
entries never changes a result."""

from __future__ import annotations

import numpy as np

from costmodel import load_hardware
from costmodel.evaluate import Evaluator
from ir import workloads
from ir.rewrites import unshard
from ir.rewrites.moves import Split


def _programs() -> list:
    mlp = unshard(workloads.build("mlp", batch=32, widths=[64, 128, 64]))
    other = unshard(workloads.build("mlp", batch=16, widths=[32, 64, 32, 16]))
    tr = unshard(workloads.build("transformer"))
    plans = [mlp, other, tr]
    first = next(iter(mlp.ops))
    plans.append(Split(first, next(iter(mlp.signature(first).dims)), 2).apply(mlp))
    return plans


def test_caps_hold_and_results_do_not_change() -> None:
    hw = load_hardware("h100-sxm-8")
    capped, fresh = Evaluator(hw), Evaluator(hw)
    capped.lowerer.PACKS_CAP = 2
    capped.lowerer.PROGRAMS_CAP = 1
    plans = _programs()
    for _ in range(3):  # revisit every program after it was forgotten
        for g in plans:
            a, b = capped(g), Evaluator(hw)(g)
            assert a.objectives() == b.objectives()
            assert np.array_equal(a.peak_memory_per_device, b.peak_memory_per_device)
            assert len(capped.lowerer._packs) <= 2 and len(capped.lowerer._programs) <= 1
            assert len(capped._bounds) <= 1  # the evaluator's program facts follow the same cap
    assert fresh.lowerer.stats == {"exact": 0, "incremental": 0, "fresh": 0}  # untouched


def test_forgotten_program_numbers_are_never_reused() -> None:
    low = Evaluator(load_hardware("h100-sxm-8")).lowerer
    low.PROGRAMS_CAP = 1
    a, b, a2, a3 = (low._program_number(k) for k in ("a", "b", "a", "a"))
    assert a < b < a2 == a3  # "a" was forgotten when "b" came: a new number, never a reused one
    # numbers are unique in the process: another lowerer never hands out the same ones
    other = Evaluator(load_hardware("h100-sxm-8")).lowerer
    assert other._program_number("a") not in (a, b, a2)


def test_piece_cache_is_bounded_by_bytes_too() -> None:
    from optimizer.search.baselines import zero3

    hw = load_hardware("h100-sxm-8")
    g = workloads.build("llama", layers=3, d_model=64, heads=4, kv_heads=2, d_ff=128, vocab=256, seq=32, batch=8,
                        mode="train")
    plan = zero3(g, 8)
    small, big = Evaluator(hw), Evaluator(hw)
    small.lowerer.cache_bytes = 20_000  # a few group pieces
    for _ in range(2):
        a, b = small(plan), big(plan)
        assert a.makespan == b.makespan and np.array_equal(a.peak_memory_per_device, b.peak_memory_per_device)
    lw = small.lowerer
    assert lw._bytes <= lw.cache_bytes and lw._bytes == sum(lw._piece_bytes.values())
    assert set(lw._piece_bytes) <= set(lw._cache)
    assert big.lowerer._bytes > 20_000  # the bound did bind
