"""Run a ``tapestry`` command under ``tracemalloc`` and report which allocation sites grow.

    python scripts/trace_driver.py --every 120 --out DIR [--start-after 180] [--frames 20] [--top 25] \
        -- run soak.yaml --quiet
    python scripts/trace_driver.py --report DIR [--from 1] [--top 25]     # re-read the snapshots

Why: a soak's driver grew by tens of MB per hour with no growing cache visible from inside
(issue 16). The driver is where the archive (SQLAlchemy), the Dask client and, for a local
cluster, the Dask *scheduler* live, so the growth has to be looked for in that process while
it runs a real campaign. Tracing starts ``--start-after`` seconds into the run (past the
baselines, which the driver evaluates itself and which tracing slows several times; growth is
what is allocated later and stays); then every ``--every`` seconds a background thread takes a snapshot
(tracebacks of ``--frames`` frames), writes it to ``DIR/snap-K.tm`` with the process's RSS and
traced total in ``DIR/log.jsonl``, and writes ``DIR/growth-K.txt``: the sites whose live
bytes grew most since snapshot 1 (the first is taken after one interval, past the start-up).
A site that grows in every interval, not only from the first to the last, is the lead.

Only Python's allocators are traced (objects, and NumPy arrays through NumPy's tracemalloc
domain); C libraries' own ``malloc`` (SQLite's page cache, libpq) and heap fragmentation show
as RSS growth without traced growth. Workers are separate processes and are *not* traced (the
variable ``PYTHONTRACEMALLOC`` is not set for them): tracing slows a Python process several
times, which would change the campaign being measured.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import runpy
import sys
import threading
import time
import tracemalloc

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def growth_report(old: tracemalloc.Snapshot, new: tracemalloc.Snapshot, top: int, frames: int = 8) -> str:
    """The ``top`` allocation sites (grouped by traceback) whose live bytes grew most from ``old``
    to ``new``, innermost frame last as in a Python traceback, ``frames`` frames each."""
    filters = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen *>")]
    stats = new.filter_traces(filters).compare_to(old.filter_traces(filters), "traceback")
    stats.sort(key=lambda s: s.size_diff, reverse=True)
    total = sum(s.size_diff for s in stats)
    lines = [f"total traced growth {total / 1e6:+.2f} MB over {len(stats)} sites"]
    for s in stats[:top]:
        lines.append(f"\n{s.size_diff / 1e6:+8.3f} MB {s.count_diff:+7d} blocks (now {s.size / 1e6:.3f} MB, {s.count} blocks)")
        lines.extend("    " + line for line in s.traceback.format(limit=frames, most_recent_first=False))
    return "\n".join(lines)


def memory_breakdown() -> dict[str, float]:
    """Resident MB of this process by kind of mapping (``/proc/self/smaps``): ``heap`` (glibc's
    main arena), ``anon_1m`` (1 MiB anonymous maps: pymalloc arenas), ``anon_64m`` (up to 64 MiB:
    glibc thread arenas and large blocks), ``anon_big`` (larger), ``files`` (libraries, mapped
    files); and glibc's ``mallinfo2`` in-use and free bytes where available."""
    out = {"heap": 0.0, "anon_1m": 0.0, "anon_64m": 0.0, "anon_big": 0.0, "files": 0.0}
    kind = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and len(head) >= 5:  # a mapping's first line
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    size, name = hi - lo, head[5] if len(head) > 5 else ""
                    kind = ("heap" if name == "[heap]" else "files" if name.startswith("/") else
                            None if name.startswith("[") else "anon_1m" if size == 1 << 20 else
                            "anon_64m" if size <= 64 << 20 else "anon_big")
                elif head[0] == "Rss:" and kind is not None:
                    out[kind] += int(head[1]) / 1e3
    except OSError:
        return {}
    try:
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                        "fsmblks", "uordblks", "fordblks", "keepcost")]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        mi = libc.mallinfo2()
        out.update(malloc_in_use=mi.uordblks / 1e6, malloc_free=mi.fordblks / 1e6, malloc_mmapped=mi.hblkhd / 1e6)
    except (OSError, AttributeError):
        pass
    out["allocated_blocks"] = float(sys.getallocatedblocks())
    return {k: round(v, 3) for k, v in out.items()}


def _sampler(out: str, every: float, top: int, start_after: float, frames: int) -> None:
    time.sleep(start_after)
    if frames <= 0:  # no tracing: the memory breakdown alone, at the campaign's own speed
        while True:
            with open(os.path.join(out, "log.jsonl"), "a") as f:
                f.write(json.dumps({"t": time.time(), "rss_mb": psutil.Process().memory_info().rss / 1e6,
                                    **memory_breakdown()}) + "\n")
            time.sleep(every)
    tracemalloc.start(frames)
    proc = psutil.Process()
    first: tracemalloc.Snapshot | None = None
    k = 0
    while True:
        time.sleep(every)
        snap = tracemalloc.take_snapshot()
        snap.dump(os.path.join(out, f"snap-{k}.tm"))
        current, peak = tracemalloc.get_traced_memory()
        with open(os.path.join(out, "log.jsonl"), "a") as f:
            f.write(json.dumps({"k": k, "t": time.time(), "rss_mb": proc.memory_info().rss / 1e6,
                                "traced_mb": current / 1e6, "tracemalloc_overhead_mb":
                                tracemalloc.get_tracemalloc_memory() / 1e6, **memory_breakdown()}) + "\n")
        if k == 1:
            first = snap
        elif first is not None:
            with open(os.path.join(out, f"growth-{k}.txt"), "w") as f:
                f.write(growth_report(first, snap, top))
        k += 1


def report(out: str, start: int, top: int) -> None:
    """Print the growth between snapshot ``start`` and each later one, then the log."""
    paths = sorted(glob.glob(os.path.join(out, "snap-*.tm")), key=lambda p: int(p.rsplit("-", 1)[1][:-3]))
    base = tracemalloc.Snapshot.load(paths[start])
    for p in paths[start + 1:]:
        print(f"\n===== {os.path.basename(paths[start])} -> {os.path.basename(p)}")
        print(growth_report(base, tracemalloc.Snapshot.load(p), top))
    with open(os.path.join(out, "log.jsonl")) as f:
        print("\n" + f.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=float, default=120.0, help="seconds between snapshots")
    ap.add_argument("--out", help="folder for the snapshots and reports")
    ap.add_argument("--start-after", type=float, default=0.0, help="seconds before tracing starts")
    ap.add_argument("--frames", type=int, default=20,
                    help="frames kept per traceback; 0: no tracing, only the memory breakdown every --every s")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--report", metavar="DIR", help="compare the snapshots of an earlier run")
    ap.add_argument("--from", dest="start", type=int, default=1, help="with --report: the baseline snapshot")
    ap.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the tapestry command line")
    args = ap.parse_args()
    if args.report:
        report(args.report, args.start, args.top)
        return
    if not args.out:
        ap.error("--out is required to trace a command")
    os.makedirs(args.out, exist_ok=True)
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    threading.Thread(target=_sampler, args=(args.out, args.every, args.top, args.start_after, args.frames), daemon=True,
                     name="trace_driver").start()
    sys.path.insert(0, ROOT)  # this checkout's packages, as ``python -m optimizer.cli`` run from ROOT
    sys.argv = ["tapestry", *argv]
    runpy.run_module("optimizer.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
