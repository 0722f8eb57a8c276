"""Benchmark: the cost of one rewrite must not grow with the size of the rest of the plan.

Builds one transformer block twice, retiled to about 100 and about 10,000 shards in total, and
times single rewrites (split / place / move on one op, median of many; optionally followed by
the child's digest, as the search does), then ``random_rewrite`` throughput on both graphs.
Copy-on-write (DESIGN.md §3) means the 10k-shard graph should be nowhere near 100x slower.

    python scripts/bench_ir.py [--json PATH] [--repeats 300] [--draws 2000]

Prints a table and one JSON line; ``--json`` also writes the JSON to a file. Exits 1 when a
single-op rewrite (split, place, move) on the large graph is more than ``--max-ratio`` (default
10) times slower. The ``+digest`` rows are informational: the identity hash covers the whole plan.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ir import workloads  # noqa: E402
from ir.graph import Graph  # noqa: E402
from ir.rewrites import RewriteError, move, place, random_rewrite, retile, split  # noqa: E402
from ir.validate import validate  # noqa: E402

N_DEVICES = 8
OP = "ff1"  # the op every single-op rewrite touches


def tile_parts(extents: tuple[int, ...], target: float) -> list[int]:
    """Per-dim tile counts whose product is close to ``target`` (largest dims cut first)."""
    parts = [1] * len(extents)
    order = sorted(range(len(extents)), key=lambda k: -extents[k])
    have = 1.0
    for i, k in enumerate(order):
        left = len(order) - i
        want = (target / have) ** (1.0 / left)
        parts[k] = max(1, min(extents[k], round(want)))
        have *= parts[k]
    return parts


def build(total_shards: int) -> Graph:
    """The transformer block with every op retiled so that the plan has about ``total_shards``."""
    base = workloads.transformer(batch=8, seq=128, d_model=256, heads=8, d_ff=1024)
    per_op = total_shards / len(base.ops)
    for _ in range(4):  # small dims cap some ops' tile counts: rescale the per-op target a few times
        plan = {n: tile_parts(base.signature(n).extents, per_op) for n in base.ops}
        got = sum(math.prod(p) for p in plan.values())
        per_op *= total_shards / got
    g = base
    for name, parts in plan.items():
        g = retile(g, name, parts, devices=range(N_DEVICES))
    return g


def median_us(fn, repeats: int) -> float:
    fn()  # warm caches (signatures are memoised per process)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def single_rewrites(g: Graph, repeats: int) -> dict[str, float]:
    sh = g.ops[OP].shards
    ext = sh.hi - sh.lo
    d = int(np.argmax(ext.min(axis=0)))  # a dim along which every shard can be halved
    rotated = [(int(x) + 1) % N_DEVICES for x in sh.device[:N_DEVICES]]
    other = (int(sh.device[0]) + 1) % N_DEVICES
    return {
        "split": median_us(lambda: split(g, OP, d, 2), repeats),
        "place": median_us(lambda: place(g, OP, rotated), repeats),
        "move": median_us(lambda: move(g, OP, 0, other), repeats),
        "split+digest": median_us(lambda: split(g, OP, d, 2).digest, repeats),
        "move+digest": median_us(lambda: move(g, OP, 0, other).digest, repeats),
    }


def draw_rate(g: Graph, steps: int, seed: int = 0, digest: bool = False) -> float:
    """``random_rewrite`` calls per second, each drawn from ``g`` itself (so the size stays fixed).

    The shard cap is raised to 4096 so that splits stay legal on the large graph as well; with the
    default cap (32 for 8 devices) its ops could only be merged or placed, a cheaper mix.
    """
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    done = 0
    for _ in range(steps):
        try:
            h, _ = random_rewrite(g, rng, N_DEVICES, max_shards_per_op=4096)
        except RewriteError:  # a stuck draw is part of the cost
            continue
        if digest:
            h.digest  # noqa: B018
        done += 1
    return done / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the JSON result to this file")
    ap.add_argument("--repeats", type=int, default=300, help="timings per single rewrite (median)")
    ap.add_argument("--draws", type=int, default=2000, help="random_rewrite calls per graph")
    ap.add_argument("--max-ratio", type=float, default=10.0,
                    help="fail when split/place/move on the large graph is this many times slower")
    args = ap.parse_args(argv)

    graphs = {"small": build(100), "large": build(10_000)}
    for g in graphs.values():  # warm up: signature caches, NumPy code paths
        draw_rate(g, 300, seed=1, digest=True)
    result: dict = {"bench": "ir", "python": platform.python_version(), "numpy": np.__version__,
                    "op": OP, "graphs": {}}
    for key, g in graphs.items():
        t0 = time.perf_counter()
        issues = validate(g)
        t_validate = time.perf_counter() - t0
        assert not issues, issues
        fresh = Graph(g.tensors, {n: o.replace() for n, o in g.ops.items()})  # new Op objects: no cached text
        t0 = time.perf_counter()
        fresh.digest  # noqa: B018  (full canonical JSON of every op + SHA-256)
        t_digest = time.perf_counter() - t0
        result["graphs"][key] = {
            "shards": g.n_shards, "op_shards": len(g.ops[OP].shards), "ops": len(g.ops),
            "validate_ms": round(t_validate * 1e3, 2), "full_digest_ms": round(t_digest * 1e3, 2),
            "rewrite_us": {k: round(v, 1) for k, v in single_rewrites(g, args.repeats).items()},
            "random_rewrite_per_s": round(draw_rate(g, args.draws), 1),
            "random_rewrite_digest_per_s": round(draw_rate(g, args.draws, digest=True), 1),
        }
    small, large = result["graphs"]["small"], result["graphs"]["large"]
    ratios = {k: round(large["rewrite_us"][k] / small["rewrite_us"][k], 2) for k in small["rewrite_us"]}
    ratios["random_rewrite"] = round(small["random_rewrite_per_s"] / large["random_rewrite_per_s"], 2)
    ratios["random_rewrite+digest"] = round(small["random_rewrite_digest_per_s"]
                                            / large["random_rewrite_digest_per_s"], 2)
    shard_ratio = large["shards"] / small["shards"]
    single = {k: ratios[k] for k in ("split", "place", "move")}
    ok = max(single.values()) <= args.max_ratio
    result.update(ratios=ratios, shard_ratio=round(shard_ratio, 1), max_ratio=args.max_ratio, ok=ok)

    print(f"transformer block, {small['ops']} ops, {N_DEVICES} devices; single rewrites on op {OP!r}")
    print(f"{'':24}{'~100 shards':>14}{'~10k shards':>14}{'ratio':>9}")
    print(f"{'total shards':24}{small['shards']:>14}{large['shards']:>14}{shard_ratio:>9.1f}")
    print(f"{'shards of ' + OP:24}{small['op_shards']:>14}{large['op_shards']:>14}"
          f"{large['op_shards'] / small['op_shards']:>9.1f}")
    for k in small["rewrite_us"]:
        print(f"{k + ' [us]':24}{small['rewrite_us'][k]:>14.1f}{large['rewrite_us'][k]:>14.1f}{ratios[k]:>9.2f}")
    for k, label in (("random_rewrite_per_s", "random_rewrite [1/s]"),
                     ("random_rewrite_digest_per_s", "  + digest [1/s]")):
        r = small[k] / large[k]
        print(f"{label:24}{small[k]:>14.1f}{large[k]:>14.1f}{r:>9.2f}")
    for k, label in (("validate_ms", "validate [ms]"), ("full_digest_ms", "cold digest [ms]")):
        print(f"{label:24}{small[k]:>14.2f}{large[k]:>14.2f}{large[k] / max(small[k], 1e-9):>9.1f}")
    verdict = "OK" if ok else "TOO SLOW"
    print(f"{verdict}: worst single-rewrite ratio {max(single.values()):.2f} (limit {args.max_ratio:g}; "
          f"a copy-everything design would be ~{shard_ratio:.0f}x)")
    line = json.dumps(result, sort_keys=True)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
