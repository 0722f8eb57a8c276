"""Live progress of a campaign: evaluations/s, front size, hypervolume, best makespan and gap.

A rich live table on a terminal; one plain line every few seconds otherwise (logs, CI).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


def fmt_seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s:.3g} s"


def fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


class Progress:
    def __init__(self, campaign: str, quiet: bool = False, interval: float = 5.0) -> None:
        self.campaign = campaign
        self.quiet = quiet
        self.console = Console(stderr=True)
        self.live: Live | None = None
        self.interval = interval
        self._last = 0.0
        self._t0 = time.monotonic()
        self._e0: int | None = None

    def __enter__(self) -> Progress:
        if not self.quiet and self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def snapshot(self, farm: Any) -> dict[str, Any]:
        c = farm.counters
        if self._e0 is None:
            self._e0 = c["evaluations"]
        dt = max(time.monotonic() - self._t0, 1e-9)
        F = farm.front.objectives()
        best = None
        if len(F) and "makespan" in farm.objectives:
            best = float(F[:, farm.objectives.index("makespan")].min())
        return {"evaluations": c["evaluations"], "rate": (c["evaluations"] - self._e0) / dt, "front": len(F),
                "hv": farm.hypervolume(), "best_makespan": best, "gap": farm.best_gap,
                "failed": c.get("tasks_failed", 0)}

    def update(self, farm: Any, force: bool = False) -> None:
        if self.quiet:
            return
        s = self.snapshot(farm)
        if self.live:
            t = Table(title=f"campaign {self.campaign}", show_header=True)
            for col in ("evaluations", "evals/s", "front", "hypervolume", "best makespan", "gap to bound"):
                t.add_column(col, justify="right")
            t.add_row(str(s["evaluations"]), f"{s['rate']:.0f}", str(s["front"]), f"{s['hv']:.4g}",
                      fmt_seconds(s["best_makespan"]) if s["best_makespan"] is not None else "-",
                      f"{s['gap']:.2f}×" if s["gap"] < float("inf") else "-")
            self.live.update(t)
            return
        now = time.monotonic()
        if force or now - self._last >= self.interval:
            self._last = now
            bm = fmt_seconds(s["best_makespan"]) if s["best_makespan"] is not None else "-"
            gap = f"{s['gap']:.2f}x" if s["gap"] < float("inf") else "-"
            print(f"[{self.campaign}] {s['evaluations']} evaluations ({s['rate']:.0f}/s), front {s['front']}, "
                  f"hypervolume {s['hv']:.4g}, best makespan {bm} (gap {gap})", file=sys.stderr, flush=True)
