"""How many plans the search evaluates in a fixed budget: the rate a user's campaign gets.

``scripts/bench_costmodel.py`` times the cost model on a walk of shard moves; the search's own
step also mutates plans structurally (layouts over regions, fusion, recomputation, reduction
splits, pipelines), checks that children with recomputed copies still compute the program
(``optimizer.search.mutation.keeps_program``: an ``unshard`` and two digests), digests every
child, and lowers plans whose ops were re-created. This runs the unseeded ``local_search`` of
``scripts/bench_search.py``'s cases (the same program, proxy and evaluator; no experts, no
replay) for ``--budget`` seconds each and prints evaluations, evaluations a second and the best
makespan. The search is deterministic for a seed up to its budget, so two versions of the code
compared side by side walk the same plans; compare them alternating, on one core
(``--cpu``), on this shared machine.

    .venv/bin/python scripts/bench_search_rate.py --budget 60 --cases llama7b-train-64,gpt2xl-train-8 --cpu 0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_search import CASES, build  # noqa: E402
from machine_speed import describe_machine, reference_ms  # noqa: E402
from costmodel.evaluate import Evaluator  # noqa: E402
from costmodel.presets import preset  # noqa: E402
from ir.rewrites.pipeline import op_layers  # noqa: E402
from optimizer.search.local import local_search  # noqa: E402

DEFAULT_CASES = "llama7b-train-64,gpt2xl-train-8,transformer-64"


def run_case(name: str, budget: float, seed: int) -> dict:
    case = next(c for c in CASES if c.name == name)
    tied = case.proxy == "tied" and bool(case.proxy_layers)
    hw = preset(case.hardware)
    if tied:  # a tied proxy evaluated as the whole model (costmodel.repetition)
        ev = Evaluator(hw, layers="repeat", model_layers=op_layers(build(case))[1])
    else:
        ev = Evaluator(hw)
        if case.proxy_layers:  # bench_search's broadcast proxy: 2 layers, simulated whole
            case = replace(case, proxy_layers=2)
    program = build(case, case.proxy_layers)
    Evaluator(hw)(program)  # loads the compiled kernels from numba's cache outside the budget
    t0 = time.perf_counter()
    run = local_search(program, ev, budget, None, seed=seed, replayable=bool(case.proxy_layers),
                       tie_layers=tied)
    wall = time.perf_counter() - t0
    return {"case": name, "ops": len(program.ops), "evaluations": run.evaluations, "seconds": wall,
            "eval_per_s": run.evaluations / wall, "best_ms": run.best.makespan * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per case (default 60)")
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated bench_search cases ({DEFAULT_CASES})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", type=int, default=None, help="pin to this core (Linux)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    names = [c.name for c in CASES]
    chosen = args.cases.split(",")
    unknown = [c for c in chosen if c not in names]
    if unknown:
        print(f"--cases: unknown case(s) {unknown}; cases are {names}", file=sys.stderr)
        return 2
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    ref_ms = reference_ms()
    results = [run_case(c, args.budget, args.seed) for c in chosen]
    print(f"{'case':<22}{'ops':>6}{'evaluations':>13}{'eval/s':>9}{'best (ms)':>12}")
    for r in results:
        print(f"{r['case']:<22}{r['ops']:>6}{r['evaluations']:>13}{r['eval_per_s']:>9.1f}{r['best_ms']:>12.4f}")
    print(f"this core: the reference workload (scripts/machine_speed.py) takes {ref_ms:.0f} ms")
    doc = {"machine": describe_machine(), "reference_ms": round(ref_ms, 1), "budget_s": args.budget,
           "seed": args.seed, "results": results}
    print(json.dumps(doc))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
