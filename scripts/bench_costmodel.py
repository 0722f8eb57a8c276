"""Cost-model throughput: full evaluations per second on one core, each after one random rewrite.

This is what the search does: take a plan, apply ``ir.rewrites.random_rewrite``, evaluate the
child with a long-lived ``costmodel.Evaluator`` (lowering, simulation, energy, lower bound). Cases:

- ``mlp@8``: ``mlp(batch=1024, widths=[1024, 4096, 4096, 1024])`` on ``h100-sxm-8``;
- ``transformer@8``: ``transformer(batch=8, seq=512, d_model=1024, heads=16, d_ff=4096)`` on
  ``h100-sxm-8``, at most 32 shards per op;
- ``transformer@64``: the same block on ``h100-sxm-64``, every op first retiled 8-64 ways over the
  64 devices, at most 64 shards per op;
- ``gpt2-small-train@8``: one training step of GPT-2 small (``gpt``, preset ``gpt2-small``: 12
  layers, d_model 768, vocabulary 50257, seq 1024; batch 8, bfloat16 with fp32 master weights,
  AdamW; about 1,000 ops) on ``h100-sxm-8``, started from the ZeRO-3 layout (every op split 8
  ways over the batch, ``ir.rewrites.layout``), at most 32 shards per op;
- ``llama2-7b-train@64``: one training step of Llama-2 7B (32 layers, batch 8, seq 4096, bfloat16,
  AdamW; about 3,300 ops) on ``h100-sxm-64``, started from Megatron TP8 inside nodes x DP8 across
  (233,000 shards; its first, fresh lowering takes about a minute), at most 64 shards per op.
  Not in the default ``--cases``;
- ``llama2-70b-train@512``: Llama-2 70B (80 layers, batch 512, seq 4096) on ``h100-sxm-512``,
  TP8 inside the 64 nodes x DP64 across them. Only with ``:repeat``.

A case with the suffix ``:repeat`` (``llama2-7b-train@64:repeat``) evaluates with
``Evaluator(layers="repeat")`` (``costmodel.repetition``: two truncations of the model, the
objectives extended along the layers) and ties each move to its layer's class
(``ir.rewrites.tie``: a move in one layer is made in every layer like it, as a whole-model search
that keeps one layout per repeated layer does); the rewrite time includes the tie. Its ``nodes``
are the larger truncation's; it skips the cache runs, and its split (200 more steps, 100 for the
70B; wall time) is the rewrite with its tie, then the evaluation's phases: ``truncate`` (cutting
the two truncations), ``lower``, ``lookahead`` (the control edges), ``simulate`` and ``other``.

Each start plan is pre-sharded with 20-25 random rewrites (tens of shards at 8 devices, hundreds
at 64). The walk then accepts a child as the next parent with probability 1/2 and restarts from
the start plan every ``--restart`` steps, so plan sizes stay stable over the run.

Reported per case: mean plan size, ``eval/s`` = evaluations per CPU-second of this process counting
only the evaluation, ``step/s`` = counting the rewrite too, median of ``--repeats`` rounds, and
the mean microseconds per step in the rewrite, the lowering and the simulation. CPU time
(``time.process_time``) rather than wall time, because the machine may be shared; the process is
pinned to one core with single-threaded BLAS and numba.

After the timed rounds, 300 more steps run with counting caches (so the counting costs no
timed step) and each case reports every cache of the evaluation path: entries, cap and hit rate
(hits / (hits + stores)): the lowerer's pieces, recent plans (``states``: exact or incremental
vs fresh lowerings), structures, ``ir.kernels.cached_signature`` and the rewrites' structure
cache. Every cache is capped, so a worker's memory stays flat over a multi-day campaign.

Usage: ``python scripts/bench_costmodel.py [--seconds 3] [--repeats 3] [--json PATH] [--cases ...]``
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import OrderedDict  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ir.rewrites.random as rewrite_random  # noqa: E402
from machine_speed import describe_machine, reference_ms  # noqa: E402
from ir import workloads  # noqa: E402
from ir.kernels import cached_signature  # noqa: E402
from ir.layers import truncate  # noqa: E402
from ir.rewrites import RewriteError, random_rewrite, retile  # noqa: E402
from ir.rewrites.tie import tie  # noqa: E402

# CPU time of this process: the machine may be shared, and "per core" means per CPU-second.
CLOCK = time.process_time
TRANSFORMER = dict(batch=8, seq=512, d_model=1024, heads=16, d_ff=4096)
CAP = {"mlp@8": 32, "transformer@8": 32, "transformer@64": 64,  # max shards per op in random rewrites
       "gpt2-small-train@8": 32, "llama2-7b-train@64": 64, "llama2-70b-train@512": 64}
REPEAT = ":repeat"  # case suffix: Evaluator(layers="repeat") and tied moves (see the module doc)


def start_plan(case: str, seed: int):
    """(graph, hardware preset, n_devices) of a case, pre-sharded deterministically."""
    rng = np.random.default_rng(seed)
    case = case.removesuffix(REPEAT)
    if case == "mlp@8":
        g, hw, n, warm = workloads.build("mlp", batch=1024, widths=[1024, 4096, 4096, 1024]), "h100-sxm-8", 8, 20
    elif case == "transformer@8":
        g, hw, n, warm = workloads.build("transformer", **TRANSFORMER), "h100-sxm-8", 8, 25
    elif case in ("gpt2-small-train@8", "llama2-7b-train@64", "llama2-70b-train@512"):
        from ir.mesh import Mesh
        from ir.rewrites.layout import layout

        if case == "gpt2-small-train@8":
            g = workloads.build("gpt", preset="gpt2-small", batch=8, mode="train", dtype="bfloat16")
            g, hw, n, warm = layout(g, "all", Mesh((8,), 8), ("b",)), "h100-sxm-8", 8, 0
        elif case == "llama2-7b-train@64":
            g = workloads.build("llama", preset="llama2-7b", batch=8, mode="train", dtype="bfloat16")
            g, hw, n, warm = layout(g, "all", Mesh((8, 8), 8), ("b", "t")), "h100-sxm-64", 64, 0
        else:  # TP8 inside the 64 nodes x DP64 across them
            g = workloads.build("llama", preset="llama2-70b", batch=512, mode="train", dtype="bfloat16")
            g, hw, n, warm = layout(g, "all", Mesh((64, 8), 8), ("b", "t")), "h100-sxm-512", 512, 0
    elif case == "transformer@64":
        g, hw, n, warm = workloads.build("transformer", **TRANSFORMER), "h100-sxm-64", 64, 20
        for name in list(g.topo_order):  # every op 8-64 ways over the 64 devices
            sig = g.signature(name)
            ways = int(rng.choice([8, 16, 32, 64]))
            parts = [1] * len(sig.extents)
            for d, e in enumerate(sig.extents):  # spread the ways over the leading dims
                f = 1
                while ways > 1 and f * 2 <= e and ways % 2 == 0:
                    f *= 2
                    ways //= 2
                parts[d] = f
            start = int(rng.integers(n))
            g = retile(g, name, parts, [(start + i) % n for i in range(int(np.prod(parts)))])
    else:
        raise SystemExit(f"unknown case {case!r}")
    for _ in range(warm):
        g, _m = random_rewrite(g, rng, n, max_shards_per_op=CAP[case])
    return g, hw, n


def run_case(case: str, seconds: float, repeats: int, restart: int, seed: int) -> dict:
    from costmodel import Evaluator
    from costmodel.simulate import warmup

    warmup()
    g0, hw, n = start_plan(case, seed)
    repeat = case.endswith(REPEAT)
    cap = CAP[case.removesuffix(REPEAT)]
    ev = Evaluator(hw, layers="repeat" if repeat else "whole")
    ev(g0)
    rng = np.random.default_rng(seed + 1)
    rates, step_rates, wall_rates, shards = [], [], [], []
    for r in range(repeats + 1):  # round 0 warms caches and numba (not reported)
        g, steps, t_eval, t_all, w_eval = g0, 0, 0.0, 0.0, 0.0
        budget = seconds if r else min(1.0, seconds)
        while t_all < budget:
            t0 = CLOCK()
            try:
                child, _m = random_rewrite(g, rng, n, max_shards_per_op=cap)
            except RewriteError:
                g = g0
                continue
            if repeat:
                child = tie(g, child)
            t1 = CLOCK()
            w1 = time.perf_counter()
            ev(child)
            w2 = time.perf_counter()
            t2 = CLOCK()
            t_eval += t2 - t1
            t_all += t2 - t0
            w_eval += w2 - w1
            steps += 1
            if r and steps % 50 == 0:
                shards.append(child.n_shards)
            g = child if rng.random() < 0.5 else g
            if steps % restart == 0:
                g = g0
        if r:
            rates.append(steps / t_eval)
            step_rates.append(steps / t_all)
            wall_rates.append(steps / w_eval)
    if repeat:  # the whole model is never lowered: the larger truncation's nodes
        rep = ev(g0).repetition
        low = ev.lowerer.lower(truncate(g0, rep.big)) if rep is not None else ev(g0, keep=True).lowered
        split, caches = profile_phases(ev, g0, rng, n, cap, restart, 100 if "70b" in case else 200), {}
    else:
        low = ev(g0, keep=True).lowered
        extra = 20 if case == "llama2-7b-train@64" else 300  # steps of the split and cache runs (~1 s each there)
        split = profile_split(ev, g0, rng, n, cap, restart, extra)
        caches = cache_hit_rates(ev, g0, rng, n, cap, restart, extra)
    nodes = len(low.kind)
    return {"caches": caches, "case": case, "hardware": hw, "ops": len(g0.ops), "start_shards": g0.n_shards,
            "mean_shards": float(np.mean(shards)) if shards else float(g0.n_shards), "start_nodes": nodes,
            "start_transfers": int((low.kind == 1).sum()),
            "eval_per_s": statistics.median(rates), "step_per_s": statistics.median(step_rates),
            "eval_per_s_wall": statistics.median(wall_rates),
            "eval_per_s_all": rates, "split_us": split}


class _Counting(OrderedDict):
    """A cache dict that counts ``get`` hits and stores (each miss is stored once)."""

    hits = 0
    stores = 0

    def get(self, key, default=None):
        value = super().get(key, default)
        if value is not None:
            self.hits += 1
        return value

    def __setitem__(self, key, value) -> None:
        self.stores += 1
        super().__setitem__(key, value)


def cache_hit_rates(ev, g0, rng, n, cap: int, restart: int, steps: int = 300) -> dict:
    """Entries, cap and hit rate of every cache on the evaluation path, over ``steps`` more
    steps of the same walk (warm caches), with counting dicts swapped in for the run."""
    low = ev.lowerer
    low._cache, low._structures = _Counting(low._cache), _Counting(low._structures)
    saved_structures = rewrite_random._STRUCTURES
    rewrite_random._STRUCTURES = _Counting(saved_structures)
    states0, sig0 = dict(low.stats), cached_signature.cache_info()
    g = g0
    for i in range(steps):
        try:
            child, _m = random_rewrite(g, rng, n, max_shards_per_op=cap)
        except RewriteError:
            g = g0
            continue
        ev(child)
        g = child if rng.random() < 0.5 else g
        if (i + 1) % restart == 0:
            g = g0
    sig = cached_signature.cache_info()
    states = {k: low.stats[k] - states0[k] for k in low.stats}

    def rate(hits: int, misses: int) -> float:
        return hits / (hits + misses) if hits + misses else float("nan")

    out = {
        "pieces": {"entries": len(low._cache), "cap": low.cache_size,
                   "hit_rate": rate(low._cache.hits, low._cache.stores)},
        "states": {"entries": len(low._states), "cap": low._states.maxlen,
                   "hit_rate": rate(states["exact"] + states["incremental"], states["fresh"])},
        "structures": {"entries": len(low._structures), "cap": 512,
                       "hit_rate": rate(low._structures.hits, low._structures.stores)},
        "signatures": {"entries": sig.currsize, "cap": sig.maxsize,
                       "hit_rate": rate(sig.hits - sig0.hits, sig.misses - sig0.misses)},
        "rewrite_structures": {"entries": len(rewrite_random._STRUCTURES), "cap": 257,
                               "hit_rate": rate(rewrite_random._STRUCTURES.hits,
                                                rewrite_random._STRUCTURES.stores)},
    }
    rewrite_random._STRUCTURES = saved_structures
    return out


def profile_split(ev, g0, rng, n, cap: int, restart: int, steps: int = 300) -> dict:
    """Mean microseconds per step in: the rewrite, lowering the child, simulating it."""
    t_rw = t_low = t_sim = 0.0
    perf = CLOCK
    g = g0
    for i in range(steps):
        t0 = perf()
        child, _m = random_rewrite(g, rng, n, max_shards_per_op=cap)
        t1 = perf()
        low = ev.lowerer.lower(child)
        t2 = perf()
        low.simulate()
        t3 = perf()
        t_rw += t1 - t0
        t_low += t2 - t1
        t_sim += t3 - t2
        g = child if rng.random() < 0.5 else g
        if i % restart == restart - 1:
            g = g0
    us = lambda x: round(x / steps * 1e6, 1)  # noqa: E731
    return {"rewrite": us(t_rw), "lower": us(t_low), "simulate": us(t_sim)}


def profile_phases(ev, g0, rng, n, cap: int, restart: int, steps: int) -> dict:
    """Mean microseconds per step of a ``:repeat`` walk (wall time, not timed in the rounds): the
    rewrite with its tie, and the evaluation's phases (``Evaluator.phase_seconds``): cutting the
    two truncations, lowering, the lookahead's control edges, simulation, and the rest (program
    facts, extension along the layers)."""
    t_rw = t_ev = 0.0
    ev.phase_seconds = {}
    g = g0
    done = 0
    while done < steps:
        t0 = time.perf_counter()
        try:
            child, _m = random_rewrite(g, rng, n, max_shards_per_op=cap)
        except RewriteError:
            g = g0
            continue
        child = tie(g, child)
        t1 = time.perf_counter()
        ev(child)
        t_rw += t1 - t0
        t_ev += time.perf_counter() - t1
        done += 1
        g = child if rng.random() < 0.5 else g
        if done % restart == 0:
            g = g0
    phases, ev.phase_seconds = ev.phase_seconds, None
    us = lambda x: round(x / steps * 1e6, 1)  # noqa: E731
    out = {"rewrite": us(t_rw), **{k: us(v) for k, v in phases.items()}}
    out["other"] = us(t_ev - sum(phases.values()))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per round")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per case (median reported)")
    ap.add_argument("--restart", type=int, default=50, help="restart the walk from the start plan every N steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", nargs="*", default=["mlp@8", "transformer@8", "transformer@64", "gpt2-small-train@8"])
    ap.add_argument("--json", help="also write the results as JSON to this path")
    ap.add_argument("--cpu", type=int, default=None, help="core to pin to (default: the first allowed)")
    a = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {a.cpu if a.cpu is not None else cpus[0]})
    ref_ms = reference_ms()
    results = [run_case(c, a.seconds, a.repeats, a.restart, a.seed) for c in a.cases]
    goals = {"transformer@8": 5000.0, "transformer@64": 500.0, "gpt2-small-train@8": 200.0,
             "llama2-7b-train@64" + REPEAT: 50.0, "llama2-70b-train@512" + REPEAT: 5.0}
    print(f"{'case':<28}{'ops':>5}{'shards':>8}{'nodes':>7}{'eval/s':>10}{'step/s':>10}{'goal':>8}   "
          "us per step: rewrite / lower / simulate")
    for r in results:
        s = r["split_us"] or {"rewrite": float("nan"), "lower": float("nan"), "simulate": float("nan")}
        more = ", ".join(f"{k} {s[k]:.0f}" for k in ("truncate", "lookahead", "other") if k in s)
        print(f"{r['case']:<28}{r['ops']:>5}{r['mean_shards']:>8.0f}{r['start_nodes']:>7}{r['eval_per_s']:>10.0f}"
              f"{r['step_per_s']:>10.0f}{goals.get(r['case'], float('nan')):>8.0f}   "
              f"{s['rewrite']:.0f} / {s['lower']:.0f} / {s['simulate']:.0f}" + (f" ({more})" if more else ""))
    print("cache hit rates (entries/cap): " + "; ".join(
        f"{r['case']}: " + ", ".join(f"{k} {v['hit_rate']:.0%} ({v['entries']}/{v['cap']})"
                                     for k, v in r["caches"].items()) for r in results))
    print(f"this core: the reference workload (scripts/machine_speed.py) takes {ref_ms:.0f} ms")
    doc = {"machine": describe_machine(), "reference_ms": round(ref_ms, 1),
           "one_core": True, "seconds": a.seconds, "repeats": a.repeats, "results": results}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
