"""Progress over days: what ``tapestry status`` shows about a campaign's course, and the
``progress.png`` that ``tapestry export`` draws.

Everything comes from committed data: the driver's counters (``hv_history`` points
``[evaluations, hypervolume, wall_seconds, best_makespan]`` appended whenever the hypervolume
grows; ``workers``: evaluations and busy seconds per worker; ``hv_improved_wall``) and the
archive's size (:meth:`storage.Archive.storage_stats`). Older campaigns whose history points
hold only ``[evaluations, hypervolume]`` show what they have.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from optimizer.campaign.progress import fmt_bytes, fmt_seconds

__all__ = ["eta_seconds", "fmt_duration", "plot_progress", "progress_lines", "progress_report"]


def _points(counters: dict[str, Any]) -> list[dict[str, float | None]]:
    out = []
    for p in counters.get("hv_history") or []:
        out.append({"evaluations": float(p[0]), "hypervolume": float(p[1]),
                    "wall_seconds": float(p[2]) if len(p) > 2 and p[2] is not None else None,
                    "best_makespan": float(p[3]) if len(p) > 3 and p[3] is not None else None})
    return out


def eta_seconds(counters: dict[str, Any], budget: dict[str, Any]) -> float | None:
    """Seconds of search left when the budget is evaluation- or time-bound (the sooner of the
    two); None when only a stall criterion bounds it or nothing has run yet."""
    wall = float(counters.get("wall_seconds") or 0.0)
    evaluations = int(counters.get("evaluations") or 0)
    left = []
    if budget.get("wall_time") is not None:
        left.append(max(0.0, float(budget["wall_time"]) - wall))
    if budget.get("evaluations") is not None and wall > 0 and evaluations > 0:
        rate = evaluations / wall
        left.append(max(0.0, (int(budget["evaluations"]) - evaluations) / rate))
    return min(left) if left else None


def progress_report(row: dict[str, Any], stats: dict[str, Any] | None,
                    now: datetime | None = None) -> dict[str, Any]:
    """Plain-data progress of a campaign row (``Archive.get_campaign``) and its storage stats."""
    c = row["counters"]
    # the running (or last) driver's budget: a resume may have changed the config's
    budget = c.get("budget") or (row.get("config") or {}).get("config", {}).get("budget", {})
    wall = float(c.get("wall_seconds") or 0.0)
    evaluations = int(c.get("evaluations") or 0)
    points = _points(c)
    improved = c.get("hv_improved_wall")
    since = None if improved is None else max(0.0, wall - float(improved))
    if since is not None and row.get("status") == "running":  # counters lag the live driver
        now = now or datetime.now(UTC)
        since += max(0.0, (now - row["updated_at"]).total_seconds())
    workers = {}
    for name, w in sorted((c.get("workers") or {}).items()):
        busy = float(w.get("seconds") or 0.0)
        workers[name] = {"evaluations": int(w.get("evaluations") or 0),
                         "evals_per_s": int(w.get("evaluations") or 0) / wall if wall > 0 else None,
                         "evals_per_busy_s": int(w.get("evaluations") or 0) / busy if busy > 0 else None}
    return {
        "evaluations": evaluations,
        "wall_seconds": wall,
        "evals_per_s": evaluations / wall if wall > 0 else None,
        "workers": workers,
        "history": points,
        "seconds_since_improvement": since,
        "eta_seconds": eta_seconds(c, budget),
        "archive_bytes": None if stats is None else stats.get("bytes"),
        "archive_rows": None if stats is None else stats.get("rows"),
        "retention": c.get("retention"),
        # processes replaced on their lifetimes (``cluster.driver_lifetime``, ``worker_lifetime``)
        "driver_restarts": int(c.get("driver_restarts") or 0),
        "worker_restarts": int(c.get("worker_restarts") or 0),
    }


def fmt_duration(seconds: float | None) -> str:
    """``93784`` → ``1d 2h 03m``; None → ``-``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {s:02d}s" if minutes else f"{s}s"


def plot_progress(report: dict[str, Any], path: str | Path, title: str) -> bool:
    """Hypervolume and best makespan against wall time (evaluations where the history has no
    times); returns False (and writes nothing) when there is no history yet."""
    pts = report["history"]
    if not pts:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = all(p["wall_seconds"] is not None for p in pts)
    xs = [p["wall_seconds"] / 3600.0 if timed else p["evaluations"] for p in pts]
    end = report["wall_seconds"] / 3600.0 if timed else report["evaluations"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    ax.step(xs + [end], [p["hypervolume"] for p in pts] + [pts[-1]["hypervolume"]], where="post", color="C0")
    ax.set_xlabel("wall time (h)" if timed else "evaluations")
    ax.set_ylabel("hypervolume", color="C0")
    best = [(x, p["best_makespan"]) for x, p in zip(xs, pts) if p["best_makespan"] is not None]
    if best:
        ax2 = ax.twinx()
        ax2.step([x for x, _ in best] + [end], [b for _, b in best] + [best[-1][1]], where="post", color="C1")
        ax2.set_ylabel("best makespan (s)", color="C1")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def progress_lines(report: dict[str, Any]) -> list[str]:
    """The progress part of ``tapestry status`` as text lines."""
    lines = []
    rate = report["evals_per_s"]
    workers = report["workers"]
    per = ", ".join(f"{name} {w['evals_per_s']:.0f}/s" for name, w in workers.items()
                    if w["evals_per_s"] is not None)
    lines.append(f"throughput: {rate:.0f} evaluations/s" if rate is not None else "throughput: -")
    if per:
        lines[-1] += f" ({per})"
    lines.append(f"last improvement: {fmt_duration(report['seconds_since_improvement'])} ago; "
                 f"ETA: {fmt_duration(report['eta_seconds'])}")
    if report.get("driver_restarts") or report.get("worker_restarts"):
        lines.append(f"restarted on their lifetimes: the driver {report['driver_restarts']} times, "
                     f"workers {report['worker_restarts']} times")
    rows = report["archive_rows"] or {}
    size = report["archive_bytes"]
    lines.append(f"archive: {fmt_bytes(size) if size is not None else '-'}; "
                 f"{rows.get('candidates', 0)} candidates ({rows.get('candidates_full', 0)} full plans, "
                 f"{rows.get('candidates_delta', 0)} deltas, {rows.get('candidates_dropped', 0)} objectives only), "
                 f"{rows.get('evaluations', 0)} evaluation rows, {rows.get('evaluation_intervals', 0)} intervals")
    pts = report["history"]
    if pts:
        shown = pts if len(pts) <= 6 else [pts[int(i * (len(pts) - 1) / 5)] for i in range(6)]
        cells = []
        for p in shown:
            when = fmt_duration(p["wall_seconds"]) if p["wall_seconds"] is not None else f"{p['evaluations']:.0f} ev"
            best = f", {fmt_seconds(p['best_makespan'])}" if p["best_makespan"] is not None else ""
            cells.append(f"{when}: {p['hypervolume']:.4g}{best}")
        with_best = any(p["best_makespan"] is not None for p in shown)
        lines.append(("hypervolume and best makespan" if with_best else "hypervolume") + " over time: "
                     + "; ".join(cells))
    return lines
