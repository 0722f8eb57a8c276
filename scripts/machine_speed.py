"""What machine a benchmark ran on, and how fast one of its cores is, for comparing runs.

The goals of ``bench_costmodel.py`` are evaluations a second on one core, and the machines this
project is measured on differ about twofold in single-core speed (a shared 2-vCPU VM: the same
code made 67-69 llama2-7b evaluations a second in one session and 26-27 in the next). So each
benchmark reports ``reference_ms``: the milliseconds a fixed single-threaded workload takes on
the pinned core (a Python loop over dicts and tuples, as the lowering's bookkeeping does, and a
NumPy argsort and cumulative sum of half a million values, as the simulator's array passes do);
the best of three runs, so a moment of load does not count. Compare rates of two runs as
``rate · reference_ms`` only as a rough guide: the ratio of two builds measured side by side on
one machine is the real measure.
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np

__all__ = ["describe_machine", "reference_ms"]


def _workload(values: np.ndarray) -> int:
    table: dict[int, tuple[int, int]] = {}
    acc = 0
    for i in range(150_000):
        key = (i * 7919) % 4096
        prev = table.get(key, (0, 0))
        table[key] = (prev[0] + 1, prev[1] ^ i)
        acc += prev[0]
    order = np.argsort(values, kind="stable")
    acc += int(np.cumsum(values[order])[-1] > 0)
    return acc


def reference_ms(repeats: int = 3) -> float:
    """Best-of-``repeats`` milliseconds of the fixed workload on the calling thread's core."""
    values = np.random.default_rng(0).standard_normal(500_000)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _workload(values)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def describe_machine() -> str:
    """Architecture, core count, CPU model (Linux) and Python version, as one line."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    cpu = f", {model}" if model else ""
    return f"{platform.machine()} {os.cpu_count()}-core{cpu}, Python {platform.python_version()}"
