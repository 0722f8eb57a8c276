"""Live progress of a campaign: phase (compiling, searching), time and evaluations toward the
budget, evaluations/s, front size, hypervolume, best makespan and gap.

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
    """The live display of one campaign run.

    Until the first search task returns, the workers are compiling (numba compiles per process,
    seconds to a minute on a cold cache): the display says so, with the elapsed time, rather than
    showing a rate of 0/s. Then it shows evaluations toward the budget, the rate since the search
    started, the front, its hypervolume, the best makespan and the gap to the lower bound."""

    def __init__(self, campaign: str, quiet: bool = False, interval: float = 5.0, budget: Any = None) -> None:
        self.campaign = campaign
        self.quiet = quiet
        self.budget = budget  # optimizer.campaign.farm.Budget or None
        self.console = Console(stderr=True)
        self.live: Live | None = None
        self.interval = interval
        self._last = 0.0
        self._t0 = time.monotonic()
        self._e0: int | None = None
        self._t_search: float | None = None  # when the first task returned

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
        now = time.monotonic()
        if self._e0 is None:
            self._e0 = c["evaluations"]
        compiling = c.get("tasks_done", 0) == 0 and not getattr(farm, "stop_reason", None)
        if not compiling and self._t_search is None:
            self._t_search, self._e_search = now, c["evaluations"]
        rate = 0.0
        if self._t_search is not None and now - self._t_search > 1e-3:
            rate = (c["evaluations"] - self._e_search) / (now - self._t_search)
        F = farm.front.objectives()
        best = None
        if len(F) and "makespan" in farm.objectives:
            best = float(F[:, farm.objectives.index("makespan")].min())
        b = self.budget
        return {"evaluations": c["evaluations"], "rate": rate, "front": len(F), "hv": farm.hypervolume(),
                "best_makespan": best, "gap": farm.best_gap, "failed": c.get("tasks_failed", 0),
                "phase": "compiling" if compiling else "searching", "elapsed": now - self._t0,
                "budget_evaluations": getattr(b, "evaluations", None), "budget_wall": getattr(b, "wall_time", None),
                "wall_seconds": float(c.get("wall_seconds", 0.0))}

    @staticmethod
    def _budget_text(s: dict[str, Any]) -> tuple[str, str]:
        """(evaluations "1,234 of 5,000 (25%)", time "12 s of 90 s")."""
        ev = f"{s['evaluations']:,}"
        if s["budget_evaluations"]:
            ev += f" of {s['budget_evaluations']:,} ({100 * s['evaluations'] / s['budget_evaluations']:.0f}%)"
        tm = f"{s['elapsed']:.0f} s"
        if s["budget_wall"]:
            tm = f"{s['wall_seconds']:.0f} s of {s['budget_wall']:.0f} s"
        return ev, tm

    def update(self, farm: Any, force: bool = False) -> None:
        if self.quiet:
            return
        s = self.snapshot(farm)
        ev, tm = self._budget_text(s)
        compiling = s["phase"] == "compiling"
        if self.live:
            t = Table(title=f"campaign {self.campaign}", show_header=True)
            for col in ("phase", "time", "evaluations", "evals/s", "front", "hypervolume", "best makespan",
                        "gap to bound"):
                t.add_column(col, justify="right")
            t.add_row("compiling (numba, first tasks)" if compiling else "searching", tm, ev,
                      "-" if compiling else f"{s['rate']:.0f}", str(s["front"]), f"{s['hv']:.4g}",
                      fmt_seconds(s["best_makespan"]) if s["best_makespan"] is not None else "-",
                      f"{s['gap']:.2f}×" if s["gap"] < float("inf") else "-")
            self.live.update(t)
            return
        now = time.monotonic()
        if force or now - self._last >= self.interval:
            self._last = now
            if compiling:
                print(f"[{self.campaign}] compiling (numba, first tasks): {s['elapsed']:.0f} s elapsed; "
                      f"{ev} evaluations", file=sys.stderr, flush=True)
                return
            bm = fmt_seconds(s["best_makespan"]) if s["best_makespan"] is not None else "-"
            gap = f"{s['gap']:.2f}x" if s["gap"] < float("inf") else "-"
            print(f"[{self.campaign}] {tm}; {ev} evaluations ({s['rate']:.0f}/s); front {s['front']}, "
                  f"hypervolume {s['hv']:.4g}, best makespan {bm} (gap {gap})", file=sys.stderr, flush=True)
