"""Timing real executions: whole plans and single shards.

On CPU (NumPy) times come from ``time.perf_counter``; on GPU (CuPy) from CUDA events recorded
around the work on the current stream (a device synchronisation ends each measurement). Every
figure is the median of ``repeats`` runs after ``warmup`` untimed runs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from executor.backend import get_backend
from executor.run import execute, random_inputs, run_op
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


def median_time(fn: Callable[[], Any], xp: Any, repeats: int = 3, warmup: int = 1) -> float:
    timer = _timer(xp)
    for _ in range(warmup):
        timer(fn)
    return statistics.median(timer(fn) for _ in range(max(1, repeats)))


def time_plan(g: Graph, backend: str = "numpy", repeats: int = 3, warmup: int = 1, seed: int = 0) -> float:
    """Median seconds to execute the whole plan (shard by shard, in dependency order)."""
    xp = get_backend(backend)
    inputs = {k: xp.asarray(v) for k, v in random_inputs(g, seed).items()}
    return median_time(lambda: execute(g, inputs, backend), xp, repeats, warmup)


def time_ops(g: Graph, backend: str = "numpy", repeats: int = 3, warmup: int = 1, seed: int = 0) -> dict[str, float]:
    """Median seconds of each op (all its shards), with its inputs already computed."""
    xp = get_backend(backend)
    env: dict[str, Any] = {k: xp.asarray(v) for k, v in random_inputs(g, seed).items()}
    out = {}
    for name in g.topo_order:
        out[name] = median_time(lambda: run_op(xp, g, name, dict(env)), xp, repeats, warmup)
        run_op(xp, g, name, env)
    return out
