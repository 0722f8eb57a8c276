"""Timing real executions: whole plans and single shards.

On CPU (NumPy) times come from ``time.perf_counter``; on GPU (CuPy) from CUDA events recorded
around the work on the current stream (a device synchronisation ends each measurement). Every
figure is the median of ``repeats`` runs after ``warmup`` untimed runs.

``time_ops`` times each op's shards exactly as a device-aware plan run does
(``executor.device_run.compute_shard``: input boxes read from full-shape buffers, the block
written into a buffer allocated once), so that one-op calibration points and the shards of real
plans are the same measurement. (It used to allocate a fresh zeroed output per run, whose page
faults made a 16 MB elementwise point 3-4x slower than the same shard inside a plan.)
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from executor.backend import get_backend
from executor.run import execute, random_inputs
from ir.graph import Graph


def _timer(xp: Any) -> Callable[[Callable[[], Any]], float]:
    if xp.__name__ == "cupy":
        def gpu_time(fn: Callable[[], Any]) -> float:
            start, end = xp.cuda.Event(), xp.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return xp.cuda.get_elapsed_time(start, end) / 1e3  # ms -> s

        return gpu_time

    def cpu_time(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return cpu_time


STATISTICS = {"median": statistics.median, "min": min}


def median_time(fn: Callable[[], Any], xp: Any, repeats: int = 3, warmup: int = 1, statistic: str = "median") -> float:
    """``statistic`` (``median``, or ``min``: the least disturbed run on a shared machine) of
    ``repeats`` timed runs after ``warmup``."""
    timer = _timer(xp)
    for _ in range(warmup):
        timer(fn)
    return STATISTICS[statistic]([timer(fn) for _ in range(max(1, repeats))])


def time_plan(g: Graph, backend: str = "numpy", repeats: int = 3, warmup: int = 1, seed: int = 0) -> float:
    """Median seconds to execute the whole plan (shard by shard, in dependency order)."""
    xp = get_backend(backend)
    inputs = {k: xp.asarray(v) for k, v in random_inputs(g, seed).items()}
    return median_time(lambda: execute(g, inputs, backend), xp, repeats, warmup)


def time_ops(g: Graph, backend: str = "numpy", repeats: int = 3, warmup: int = 1, seed: int = 0,
             statistic: str = "median") -> dict[str, float]:
    """Median (or ``statistic``) seconds of each op (all its shards, one after another), with its
    inputs already computed, timed the way a plan run times shards (see the module docstring)."""
    from executor.device_run import DeviceMemory, compute_shard, prepare_ops

    xp = get_backend(backend)
    mem = DeviceMemory(xp, 0, None, {n: (t.shape, t.dtype) for n, t in g.tensors.items()})
    for k, v in random_inputs(g, seed).items():
        mem.buffer(k)[...] = xp.asarray(v)
    ops = prepare_ops(g)
    out = {}
    for name in g.topo_order:
        op = ops[name]
        mem.buffer(op.output)  # allocated (and zero-filled) once, as in a plan run

        def shards(op: Any = op) -> None:
            for i in range(op.n):
                compute_shard(xp, op, i, mem, check=False)

        out[name] = median_time(shards, xp, repeats, warmup, statistic)
    return out
