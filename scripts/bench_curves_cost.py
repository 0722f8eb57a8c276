"""What the default efficiency curves cost in evaluation speed: the same random walk of
``scripts/bench_costmodel.py`` (its start plans and ``random_rewrite`` steps), every child
evaluated by two long-lived evaluators, flat roofline (``curves=None``) and default curves, in
alternating order, CPU time of this process each. Prints a table and one JSON line.

Usage: ``python scripts/bench_curves_cost.py [--steps 2000] [--cases mlp@8 transformer@8 ...]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--cases", nargs="*", default=["mlp@8", "transformer@8", "gpt2-small-train@8"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from bench_costmodel import CAP, start_plan

    from costmodel import Evaluator
    from ir.rewrites import RewriteError, random_rewrite

    out = []
    for case in a.cases:
        g0, hw, n = start_plan(case, a.seed)
        evs = {"flat": Evaluator(hw, curves=None), "curves": Evaluator(hw)}
        for ev in evs.values():
            ev(g0)
        rng = np.random.default_rng(a.seed + 1)
        t = {k: 0.0 for k in evs}
        g, steps, diff = g0, 0, 0
        while steps < a.steps:
            try:
                child, _ = random_rewrite(g, rng, n, max_shards_per_op=CAP[case])
            except RewriteError:
                g = g0
                continue
            order = ("flat", "curves") if steps % 2 else ("curves", "flat")
            ms = {}
            for k in order:
                t0 = time.process_time()
                ms[k] = evs[k](child).makespan
                t[k] += time.process_time() - t0
            diff += ms["flat"] != ms["curves"]
            steps += 1
            g = child if rng.random() < 0.5 else g
            if steps % 50 == 0:
                g = g0
        row = {"case": case, "steps": steps, "flat_eval_per_s": steps / t["flat"],
               "curves_eval_per_s": steps / t["curves"], "ratio_curves_over_flat_time": t["curves"] / t["flat"],
               "makespans_differ": diff}
        out.append(row)
        print(f"{case:22s} flat {row['flat_eval_per_s']:8.0f} eval/s   curves {row['curves_eval_per_s']:8.0f} eval/s"
              f"   time ratio curves/flat {row['ratio_curves_over_flat_time']:.3f}", flush=True)
    print(json.dumps({"bench": "curves_cost", "rows": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
