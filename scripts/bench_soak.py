"""Soak benchmark: what a long campaign does to the machine.

    python scripts/bench_soak.py [--minutes 30] [--db URL] [--workers 2] [--sample-seconds 30]
                                 [--warmup-minutes 5] [--no-retention] [--json out.json]
                                 [--plot docs/soak.png] [--trace-every SECONDS --trace-out DIR [--trace-frames 0]]

Runs ``tapestry run`` (a transformer block, batch 4 x seq 256, d_model 512, on ``h100-sxm-8``;
local workers; NumPy sampling at rate 0.01: the issue-16 setting with a block small enough that
sampled CPU executions do not starve a 2-core machine) as a child process for the given time and samples, every
``--sample-seconds``: the driver's and each worker's resident memory (psutil: RSS, and its
anonymous part, the heap without file-backed pages the kernel may drop and fault back), the archive's
size and rows, evaluations/s and the hypervolume (from the campaign's committed counters).
At the end it prints the slopes after the warm-up (least squares) and their extrapolation to
three days (for worker and driver RSS also the *floor*: the smallest of each sample and its
neighbours, which drops the sub-minute spikes of sampled executions but keeps lasting growth),
the archive's growth per day and the machine's load average, and writes JSON and a four-panel
plot. ``--db`` takes a SQLite path or a
PostgreSQL URL (``scripts/start_postgres.sh`` starts a local server); default: a temporary
SQLite file. ``--trace-every`` runs the driver under ``tracemalloc``
(``scripts/trace_driver.py``: a snapshot and a report of the growing allocation sites every so
many seconds from minute 3, in ``--trace-out``; it slows the driver, so its RSS slope is not the campaign's; ``--trace-frames 0``
logs only the driver's memory by kind, untraced).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import psutil
import yaml

from storage import Archive, StorageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREE_DAYS_H = 72.0


def campaign_config(name: str, db: str, minutes: float, workers: int, retention: bool,
                    worker_lifetime: float | None = 21600.0,
                    driver_lifetime: float | None = 21600.0) -> dict[str, Any]:
    return {
        "name": name,
        "workload": {"name": "transformer",
                     "params": {"batch": 4, "seq": 256, "d_model": 512, "heads": 8, "d_ff": 2048}},
        "hardware": "h100-sxm-8",
        "objectives": ["makespan", "peak_memory", "energy"],
        "search": {"strategy": "native", "seed": 0},
        "budget": {"evaluations": None, "wall_time": minutes * 60.0},
        "cluster": {"workers": workers, "worker_lifetime": worker_lifetime, "driver_lifetime": driver_lifetime},
        "storage": {"url": db},
        "sampling": {"rate": 0.01, "backend": "numpy"},
        "checkpoint_seconds": 10,
        **({} if retention else {"retention": {"enabled": False}}),  # default: on
    }


def process_rss(driver: psutil.Process) -> tuple[dict[str, float], dict[str, float]]:
    """MB resident, and MB of it anonymous (RSS less file-backed and shared pages: the heap,
    what a leak grows; the kernel drops file-backed pages under memory pressure and faults them
    back later, which moves RSS without any allocation): the driver, and each descendant above
    50 MB (Dask workers; the small resource tracker and shell helpers are left out)."""
    m = driver.memory_info()
    rss, anon = {"driver": m.rss / 1e6}, {"driver": (m.rss - m.shared) / 1e6}
    for child in driver.children(recursive=True):
        try:
            m = child.memory_info()
        except psutil.Error:
            continue
        if m.rss > 50e6:
            rss[f"pid{child.pid}"] = m.rss / 1e6
            anon[f"pid{child.pid}"] = (m.rss - m.shared) / 1e6
    return rss, anon


def read_archive(db: str, name: str) -> dict[str, Any] | None:
    try:
        with Archive.open(db, readonly=True) as a:
            c = a.get_campaign(name)["counters"]
            stats = a.storage_stats(name)
    except StorageError:
        return None  # not created yet (the driver is still evaluating its baselines)
    return {"evaluations": int(c.get("evaluations", 0)), "hypervolume": float(c.get("hv_best", 0.0)),
            "bytes": stats["bytes"], "rows": stats["rows"]}


def slope_per_hour(t: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope of ``y`` against ``t`` (seconds), per hour."""
    if len(t) < 2 or np.ptp(t) == 0:
        return float("nan")
    return float(np.polyfit(t, y, 1)[0] * 3600.0)


def rolling_min(y: np.ndarray, width: int) -> np.ndarray:
    """The smallest value in a centred window of ``width`` samples (shorter at the ends)."""
    h = width // 2
    return np.array([y[max(0, i - h):i + h + 1].min() for i in range(len(y))]) if len(y) else y


def analyse(samples: list[dict[str, Any]], warmup_s: float, window_s: float = 300.0) -> dict[str, Any]:
    """Slopes after ``warmup_s`` (counted from the first sample: the campaign's start, after the
    baselines), their 3-day extrapolation, and evaluations/s over the first and last windows."""
    t = np.array([s["t"] for s in samples], dtype=float)
    t = t - t[0]
    after = t >= warmup_s
    if after.sum() < 2:
        after = t >= t[len(t) // 2]
    ta = t[after]
    series = {
        "driver_rss_mb": np.array([s["rss"]["driver"] for s in samples]),
        "worker_rss_mb_max": np.array([max([v for k, v in s["rss"].items() if k != "driver"], default=0.0)
                                       for s in samples]),
        "worker_rss_mb_sum": np.array([sum(v for k, v in s["rss"].items() if k != "driver") for s in samples]),
        "archive_mb": np.array([(s["bytes"] or 0) / 1e6 for s in samples]),
        "candidate_rows": np.array([s["rows"].get("candidates", 0) for s in samples], dtype=float),
        "evaluation_rows": np.array([s["rows"].get("evaluations", 0) for s in samples], dtype=float),
    }
    if all("anon" in s for s in samples):  # (runs saved before it was sampled lack it)
        series["driver_anon_mb"] = np.array([s["anon"]["driver"] for s in samples])
        series["worker_anon_mb_max"] = np.array([max([v for k, v in s["anon"].items() if k != "driver"],
                                                     default=0.0) for s in samples])
    # A sampled NumPy execution takes a worker's RSS up by hundreds of MB for under a minute;
    # the floor (the smallest of each sample and its two neighbours) drops such spikes and keeps
    # any lasting growth, which is what a multi-day campaign cares about.
    series["worker_rss_mb_floor"] = rolling_min(series["worker_rss_mb_max"], 3)
    series["driver_rss_mb_floor"] = rolling_min(series["driver_rss_mb"], 3)
    slopes = {k: slope_per_hour(ta, v[after]) for k, v in series.items()}
    rates = np.array([s["evals_per_s"] for s in samples], dtype=float)
    first = (t > 0) & (t <= t[0] + window_s) & np.isfinite(rates)
    last = (t >= t[-1] - window_s) & np.isfinite(rates)
    return {
        "warmup_s": warmup_s,
        "slopes_per_hour": slopes,
        "three_day_growth": {k: v * THREE_DAYS_H for k, v in slopes.items()},
        "evals_per_s_first_window": float(np.nanmean(rates[first])) if first.any() else float("nan"),
        "evals_per_s_last_window": float(np.nanmean(rates[last])) if last.any() else float("nan"),
        "final": {k: float(v[-1]) for k, v in series.items()},
        # with lifetimes the processes restart: what bounds them is the peak, not the slope
        "max_after_warmup": {k: float(v[after].max()) for k, v in series.items()},
        "archive_mb_per_day": slopes["archive_mb"] * 24.0,
        "load1_mean": float(np.mean([s.get("load1", np.nan) for s in samples])),
        "evaluations": int(samples[-1]["evaluations"]),
    }


def plot(samples: list[dict[str, Any]], summary: dict[str, Any], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = (np.array([s["t"] for s in samples]) - samples[0]["t"]) / 60.0
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4), dpi=110)
    ax = axes[0, 0]
    ax.plot(t, [s["rss"]["driver"] for s in samples], label="driver")
    workers = sorted({k for s in samples for k in s["rss"] if k != "driver"})
    for k in workers:
        ax.plot(t, [s["rss"].get(k, np.nan) for s in samples], label=k, lw=0.8)
    ax.set_ylabel("RSS (MB)")
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    ax.plot(t, [(s["bytes"] or 0) / 1e6 for s in samples], label="archive MB")
    ax2 = ax.twinx()
    ax2.plot(t, [s["rows"].get("evaluations", 0) for s in samples], "C1", lw=0.8, label="evaluation rows")
    ax.set_ylabel("archive (MB)")
    ax2.set_ylabel("evaluation rows", color="C1")
    ax = axes[1, 0]
    ax.plot(t, [s["evals_per_s"] for s in samples])
    ax.set_ylabel("evaluations/s")
    ax.set_xlabel("minutes since the campaign started")
    ax = axes[1, 1]
    ax.plot(t, [s["hypervolume"] for s in samples])
    ax.set_ylabel("hypervolume")
    ax.set_xlabel("minutes since the campaign started")
    for a in axes.flat:
        a.axvline(summary["warmup_s"] / 60.0, color="grey", ls=":", lw=0.8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def _title(result: dict[str, Any]) -> str:
    life = ", ".join(f"{who} lifetime {result[k]:g} s" for who, k in (("driver", "driver_lifetime"),
                                                                      ("worker", "worker_lifetime"))
                     if result.get(k) and result[k] < result["minutes"] * 60.0)
    return (f"soak: {result['minutes']:g} min, {result['backend']}, {result['workers']} workers, retention "
            f"{'on' if result['retention'] else 'off'}" + (f", {life}" if life else ""))


def report(result: dict[str, Any], warmup_minutes: float) -> None:
    summary = result["summary"]
    sl, g3 = summary["slopes_per_hour"], summary["three_day_growth"]
    print(f"\nafter {warmup_minutes:g} min warm-up ({result['backend']}, retention "
          f"{'on' if result['retention'] else 'off'}):")
    for key, unit in (("driver_rss_mb", "MB"), ("driver_rss_mb_floor", "MB"), ("driver_anon_mb", "MB"),
                      ("worker_rss_mb_max", "MB"), ("worker_rss_mb_floor", "MB"), ("worker_anon_mb_max", "MB"),
                      ("worker_rss_mb_sum", "MB"),
                      ("archive_mb", "MB"), ("candidate_rows", "rows"), ("evaluation_rows", "rows")):
        if key in sl:
            print(f"  {key:<20} {sl[key]:+12.1f} {unit}/h   3 days: {g3[key]:+14.0f} {unit}")
    if "max_after_warmup" in summary:
        mx = summary["max_after_warmup"]
        print("  largest after warm-up: " + ", ".join(f"{k} {mx[k]:.0f} MB" for k in (
            "driver_rss_mb", "driver_anon_mb", "worker_rss_mb_max", "worker_rss_mb_floor") if k in mx))
    print(f"  archive growth: {summary.get('archive_mb_per_day', float('nan')):+.0f} MB/day")
    print(f"  evaluations/s: first 5 min {summary['evals_per_s_first_window']:.0f}, "
          f"last 5 min {summary['evals_per_s_last_window']:.0f}; {summary.get('evaluations', 0):,} evaluations; "
          f"mean load average {summary.get('load1_mean', float('nan')):.1f} on {os.cpu_count()} cores")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--db", default=None, help="SQLite path or PostgreSQL URL (default: a temporary SQLite file)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sample-seconds", type=float, default=30.0)
    ap.add_argument("--warmup-minutes", type=float, default=5.0)
    ap.add_argument("--no-retention", action="store_true", help="retention.enabled: false (the 'before' setting)")
    ap.add_argument("--worker-lifetime", type=float, default=21600.0,
                    help="cluster.worker_lifetime in seconds (default 6 h, the campaigns' default); 0: never")
    ap.add_argument("--driver-lifetime", type=float, default=21600.0,
                    help="cluster.driver_lifetime in seconds (default 6 h); 0: never")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--from-json", default=None, help="re-analyse and re-plot a run saved with --json")
    ap.add_argument("--trace-every", type=float, default=None,
                    help="seconds between tracemalloc snapshots of the driver (scripts/trace_driver.py)")
    ap.add_argument("--trace-out", default=None, help="folder for --trace-every's snapshots and reports")
    ap.add_argument("--trace-frames", type=int, default=20,
                    help="frames per traceback; 0: no tracemalloc, only the driver's memory breakdown")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        saved["summary"] = analyse(saved["samples"], args.warmup_minutes * 60.0)
        report(saved, args.warmup_minutes)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(saved, f, indent=1, default=str)
        if args.plot:
            plot(saved["samples"], saved["summary"], args.plot, _title(saved))
        return
    tmp = tempfile.mkdtemp(prefix="bench_soak_")
    db = args.db or os.path.join(tmp, "soak.db")
    name = f"soak-{int(time.time())}"
    cfg_path = os.path.join(tmp, "soak.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(campaign_config(name, db, args.minutes, args.workers, not args.no_retention,
                                       args.worker_lifetime or None, args.driver_lifetime or None), f)
    log_path = os.path.join(tmp, "driver.log")
    cmd = [sys.executable, "-m", "optimizer.cli"]
    if args.trace_every:
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "trace_driver.py"), "--every", str(args.trace_every),
               "--start-after", "180", "--frames", str(args.trace_frames),
               "--out", args.trace_out or os.path.join(tmp, "trace"), "--"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*cmd, "run", cfg_path, "--db", db, "--quiet"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    driver = psutil.Process(proc.pid)
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    prev: tuple[float, int] | None = None
    print(f"soak: campaign {name} for {args.minutes:g} min on {db} (log {log_path})", flush=True)
    try:
        while proc.poll() is None:
            time.sleep(min(args.sample_seconds, 5.0) if not samples else args.sample_seconds)
            if proc.poll() is not None:
                break
            state = read_archive(db, name)
            if state is None:
                continue
            now = time.monotonic() - t0
            rate = float("nan") if prev is None else (state["evaluations"] - prev[1]) / max(now - prev[0], 1e-9)
            prev = (now, state["evaluations"])
            try:
                rss, anon = process_rss(driver)
            except psutil.Error:
                break
            samples.append({"t": now, "rss": rss, "anon": anon, "evals_per_s": rate, "load1": os.getloadavg()[0],
                            **state})
            s = samples[-1]
            workers = [v for k, v in rss.items() if k != "driver"]
            print(f"{now / 60:6.1f} min  driver {rss['driver']:6.0f} MB  workers "
                  f"{', '.join(f'{w:.0f}' for w in workers)} MB  archive {(s['bytes'] or 0) / 1e6:7.1f} MB  "
                  f"rows {s['rows'].get('candidates', 0)}/{s['rows'].get('evaluations', 0)}  "
                  f"{rate:7.0f} evals/s  hv {s['hypervolume']:.4g}", flush=True)
    except KeyboardInterrupt:
        proc.terminate()
    rc = proc.wait()
    if rc != 0 or len(samples) < 3:
        sys.exit(f"soak: the campaign exited with status {rc} after {len(samples)} samples; see {log_path}")
    summary = analyse(samples, args.warmup_minutes * 60.0)
    backend = "postgresql" if db.startswith("postgresql") else "sqlite"
    result = {"campaign": name, "backend": backend, "minutes": args.minutes, "workers": args.workers,
              "retention": not args.no_retention, "worker_lifetime": args.worker_lifetime or None,
              "driver_lifetime": args.driver_lifetime or None,
              "summary": summary, "samples": samples}
    report(result, args.warmup_minutes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.plot:
        plot(samples, summary, args.plot, _title(result))


if __name__ == "__main__":
    main()
