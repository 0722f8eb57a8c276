"""Search quality: the native operators (layouts included) against the expert plans.

For each fixed case, two searches with equal wall budgets: *unseeded* (from the single-device
program only) and *seeded* (plus the expert baselines). Reported per case and run: best makespan
/ best expert, best / lower bound, seconds to within 5% of the final best, hypervolume of
(makespan, peak memory) over the feasible plans evaluated (reference: the worst expert's makespan
and the device memory, x1.1), evaluations. A table on stdout, JSON to ``--json``.

Training cases of language models search on a *proxy* (``--proxy``):

- ``broadcast`` (the default but for llama2-70b): the same model with 2 layers, simulated whole (layouts name
  regions, not layer counts); the best proxy plans are replayed on the full model, as they are and
  with the proxy's layer-1 moves made on every middle layer (``replay(..., broadcast=True)``);
- ``tied``: 6 layers (the first, four tied middle layers, the last: ``local_search(...,
  tie_layers=True)`` makes a move in one middle layer in the others too), each plan evaluated *as
  the full model* (``Evaluator(layers="repeat", model_layers=L)``, ``costmodel.repetition``),
  replayed with ``replay(..., tie_from=6)``. Measured worse than ``broadcast`` where a 2-layer
  proxy's memory says what the model's does (docs/benchmarks.md): fewer evaluations, and the line
  through two truncations can be gamed by irregular plans. llama2-70b on 512 GPUs searches it: 80
  layers' activations and gathered weights do not fit without recomputation, which a 2-layer proxy
  never needs, so only the model's memory makes the search recompute.

The replayed plans and the experts are evaluated on the full model: simulated whole, except
llama2-70b on 512 GPUs (``layers="repeat"``: a whole simulation of its 4.8 million shards takes
minutes). Programs use fused attention
(FlashAttention, as the experts do): the forward's attention sites are substituted before the
training step is built.

    .venv/bin/python scripts/bench_search.py --budget 300 --json out/bench_search.json
    .venv/bin/python scripts/bench_search.py --budget 20 --cases mlp-64,transformer-64   # quick
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodel.evaluate import Evaluator  # noqa: E402
from costmodel.presets import preset  # noqa: E402
from ir import workloads  # noqa: E402
from ir.autodiff import training_step  # noqa: E402
from ir.graph import Graph  # noqa: E402
from ir.layout_describe import describe, guess_mesh  # noqa: E402
from ir.rewrites import RewriteError  # noqa: E402
from ir.rewrites.pipeline import op_layers  # noqa: E402
from ir.rewrites.substitute_attention import attention_sites, fuse_attention  # noqa: E402
from optimizer.search.baselines import baselines  # noqa: E402
from optimizer.search.local import local_search, replay, time_to_within  # noqa: E402
from optimizer.search.pareto import hypervolume  # noqa: E402

MLP = dict(batch=8192, widths=[8192, 32768, 8192], dtype="bfloat16")
BLOCK = dict(batch=8, seq=2048, d_model=4096, heads=32, d_ff=16384, dtype="bfloat16")
# layers of a training case's search program: the first, four tied middle ones, the last (four, so a
# two-stage pipeline's stages are classes of two, told apart from a middle layer made different)
PROXY = 6


@dataclass(frozen=True)
class Case:
    name: str
    workload: str
    params: dict
    hardware: str
    train: bool = False
    proxy_layers: int | None = None  # search on this many layers, replay on the full model
    full: bool = True  # evaluate the experts and the replayed plans on the full model
    report_layers: str = "whole"  # how the full model is evaluated (Evaluator(layers=...))
    proxy: str = "broadcast"  # the search's proxy (module doc); ``--proxy`` overrides it


CASES = [
    Case("mlp-64", "mlp", MLP, "h100-sxm-64"),
    Case("transformer-64", "transformer", BLOCK, "h100-sxm-64"),
    Case("mlp-8", "mlp", MLP, "h100-sxm-8"),
    Case("transformer-8", "transformer", BLOCK, "h100-sxm-8"),
    Case("gpt2xl-train-8", "gpt", dict(preset="gpt2-xl", batch=8, seq=1024, dtype="bfloat16"), "h100-sxm-8",
         True, PROXY),
    Case("gpt2xl-train-64", "gpt", dict(preset="gpt2-xl", batch=64, seq=1024, dtype="bfloat16"), "h100-sxm-64",
         True, PROXY),
    Case("llama7b-train-8", "llama", dict(preset="llama2-7b", batch=8, seq=4096, dtype="bfloat16"),
         "h100-sxm-8", True, PROXY),
    Case("llama7b-train-64", "llama", dict(preset="llama2-7b", batch=64, seq=4096, dtype="bfloat16"),
         "h100-sxm-64", True, PROXY),
    Case("llama70b-train-512", "llama", dict(preset="llama2-70b", batch=512, seq=4096, dtype="bfloat16"),
         "h100-sxm-512", True, PROXY, report_layers="repeat", proxy="tied"),
    # a mixture of experts (balanced routing): expert parallelism's all-to-all against the dense recipes
    Case("mixtral-train-64", "llama", dict(preset="mixtral-8x7b", batch=32, seq=4096, dtype="bfloat16"),
         "h100-sxm-64", True, PROXY, report_layers="repeat"),
    # the same with each expert's buffer 1.25x its share (capacity factor: imbalance provisioned)
    Case("mixtral-cap-train-64", "llama", dict(preset="mixtral-8x7b", batch=32, seq=4096, dtype="bfloat16",
                                               capacity_factor=1.25), "h100-sxm-64", True, PROXY,
         report_layers="repeat"),
    # another fleet: A100s, a third of H100's tensor rate, half its links
    Case("llama7b-train-a100-64", "llama", dict(preset="llama2-7b", batch=64, seq=4096, dtype="bfloat16"),
         "a100-sxm-64", True, PROXY),
]


def build(case: Case, layers: int | None = None) -> Graph:
    params = dict(case.params)
    if layers is not None:
        params["layers"] = layers
    if not case.train:
        return workloads.build(case.workload, **params)
    fwd = workloads.build(case.workload, **params)
    for site in attention_sites(fwd):
        fwd = fuse_attention(fwd, site)
    return training_step(fwd, loss="cross_entropy", optimizer="adamw")


@dataclass
class RunResult:
    best: float
    feasible: bool
    time_to_5pct: float
    hypervolume: float
    evaluations: int
    lineage: list[str]
    structure: str = ""
    wins: dict = field(default_factory=dict)
    restarts: int = 0  # how many times the population started again (``local_search``)


def _hv(archive: list[tuple[float, float]], ref: np.ndarray) -> float:
    pts = np.array([a for a in archive if a[0] < ref[0] and a[1] < ref[1]])
    return float(hypervolume(pts, ref)) if len(pts) else 0.0


def run_case(case: Case, budget: float, seed: int, log, proxy: str | None = None) -> dict:
    """``proxy``: ``broadcast`` or ``tied`` (see the module doc); None: the case's own."""
    hw = preset(case.hardware)
    n, per = hw.n_devices, hw.devices_per_node
    t0 = time.perf_counter()
    proxy = proxy or case.proxy
    tied = proxy == "tied"
    if case.proxy_layers and not tied:
        case = replace(case, proxy_layers=2)
    search_prog = build(case, case.proxy_layers)
    full_prog = build(case) if case.full and case.proxy_layers else search_prog
    # the proxy's plans are evaluated as the whole model (costmodel.repetition: its tied middle layers
    # copied up to the model's layer count); the whole model as the case says
    ev = Evaluator(hw, layers=case.report_layers)
    big = case.report_layers == "repeat"  # a model too large for the caches of many plans at once

    def full_eval(g: Graph):
        """The full model's evaluation: with ``ev``, or for a model this large with a fresh
        evaluator of two recent lowerings (each holds hundreds of MB at 512 GPUs), freed after."""
        if not big:
            return ev(g)
        one = Evaluator(hw, layers=case.report_layers)
        one.lowerer._states = deque(maxlen=2)
        e = one(g)
        del one
        gc.collect()
        return e
    model_layers = op_layers(full_prog)[1] if case.proxy_layers else None
    search_ev = Evaluator(hw, layers="repeat", model_layers=model_layers) if model_layers and tied else Evaluator(hw)
    log(f"[{case.name}] built in {time.perf_counter() - t0:.0f} s: search program {len(search_prog.ops)} ops"
        + (f", full {len(full_prog.ops)} ops" if full_prog is not search_prog else ""))
    # experts on the program that is reported (full model where affordable, else the proxy)
    report_prog = full_prog if case.full else search_prog
    experts: dict[str, dict] = {}
    plans = baselines(report_prog, n, per)
    for name in list(plans):
        g = plans.pop(name)  # evaluated one by one and let go (a 70B plan on 512 GPUs: ~0.4 GB)
        if name == "single-device" and n > 1:
            continue
        e = full_eval(g)
        del g
        experts[name] = {"makespan": e.makespan, "feasible": bool(e.feasible), "peak_memory": e.peak_memory}
        log(f"  expert {name}: {e.makespan * 1e3:.3f} ms {'feasible' if e.feasible else 'INFEASIBLE'}"
            f" ({e.peak_memory / 1e9:.1f} GB)")
    feas = [v["makespan"] for v in experts.values() if v["feasible"]]
    best_expert = min(feas) if feas else float("nan")
    lb = full_eval(report_prog).lower_bound
    worst = max([v["makespan"] for v in experts.values()] + [best_expert if feas else 1.0])
    ref = np.array([worst * 1.1, hw.device.mem_capacity * 1.1])
    seeds = {k: g for k, g in baselines(search_prog, n, per).items() if k != "single-device"}
    out = {"case": case.name, "hardware": case.hardware, "devices": n, "lower_bound": lb,
           "best_expert": best_expert, "experts": experts, "proxy_layers": case.proxy_layers,
           "reported_on": "full" if (case.full or not case.proxy_layers) else f"proxy ({case.proxy_layers} layers)",
           "report_layers": case.report_layers, "proxy": proxy}
    full_seeds: dict[str, Graph] = {}

    def seed_on_full(name: str) -> Graph:
        if name not in full_seeds:
            full_seeds.clear()  # one seed kept at a time
            full_seeds[name] = baselines(report_prog, n, per)[name]
        return full_seeds[name]

    for mode in ("unseeded", "seeded"):
        run = local_search(search_prog, search_ev, budget, seeds if mode == "seeded" else None, seed=seed,
                           replayable=report_prog is not search_prog, tie_layers=tied and bool(case.proxy_layers))
        final, lineage, feasible = run.best.makespan, run.best.lineage, run.best.feasible
        plan = run.best.graph
        if report_prog is not search_prog:  # replay the best few on the full model
            final, feasible = float("inf"), False
            # the best three, their middle-layer moves made in every middle layer (as in the search)
            tries = [(p, False) for p in run.population[:3]]
            if not tied:  # and the best with its layer-1 moves on every layer
                tries.append((run.population[0], True))
            if mode == "seeded" and feas:  # the seeds themselves are candidates: refinements found on
                # the proxy may not pay on the full model
                best_name = min((k for k, v in experts.items() if v["feasible"]), key=lambda k: experts[k]["makespan"])
                tries.append((SimpleNamespace(lineage=(f"seed:{best_name}",)), False))
            for p, bcast in tries:
                try:
                    skipped: list[str] = []
                    if tied:
                        g = replay(report_prog, p.lineage, seed_on_full, tie_from=case.proxy_layers, strict=False,
                                   skipped=skipped)
                    else:
                        g = replay(report_prog, p.lineage, seed_on_full, broadcast=bcast)
                except (RewriteError, KeyError) as e:
                    log(f"  {mode}: replay failed ({e})")
                    continue
                e = full_eval(g)
                log(f"  {mode}: replayed ({len(skipped)} of {len(p.lineage)} moves did not apply): "
                    f"{e.makespan * 1e3:.3f} ms{'' if e.feasible else ' INFEASIBLE'}")
                if (not feasible and e.feasible) or (e.feasible == feasible and e.makespan < final):
                    final, feasible, lineage, plan = e.makespan, bool(e.feasible), p.lineage, g
        res = RunResult(final, feasible, time_to_within(run.trace, run.best.makespan), _hv(run.archive, ref),
                        run.evaluations, list(lineage), wins={k: [run.wins.get(k, 0), v] for k, v in run.tries.items()},
                        restarts=len(run.restarts))
        lines = describe(plan, guess_mesh(plan, per)).split("\n")
        # the mesh line, then the compute ops (the bf16 casts of the weights come first and say little)
        res.structure = "\n".join(lines[:1] + [x for x in lines[1:] if "= cast[" not in x][:40])
        out[mode] = res.__dict__ | {"vs_expert": final / best_expert if feas else float("nan"),
                                    "vs_lower_bound": final / lb}
        log(f"  {mode}: {final * 1e3:.3f} ms ({'feasible' if feasible else 'INFEASIBLE'}) = "
            f"{out[mode]['vs_expert']:.3f} x best expert, {final / lb:.2f} x bound, "
            f"{run.evaluations} evaluations, {len(run.restarts)} restarts, lineage {' ; '.join(lineage)[:200]}")
    return out


def table(results: list[dict]) -> str:
    head = ("| case | best expert (ms) | unseeded (ms) | unseeded / expert | unseeded / bound | t(5%) s | HV | "
            "seeded / expert | evals (u/s) |")
    rows = [head, "|" + "---|" * 9]
    for r in results:
        u, s = r["unseeded"], r["seeded"]
        bad = "" if u["feasible"] else " INFEASIBLE"
        rows.append(f"| {r['case']} | {r['best_expert'] * 1e3:.3f} | {u['best'] * 1e3:.3f}{bad} | {u['vs_expert']:.3f} | "
                    f"{u['vs_lower_bound']:.2f} | {u['time_to_5pct']:.0f} | {u['hypervolume']:.3g} | "
                    f"{s['vs_expert']:.3f} | {u['evaluations']}/{s['evaluations']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds per search run (default 300)")
    ap.add_argument("--cases", default="all", help="comma-separated case names (default all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--proxy", choices=("tied", "broadcast"), default=None,
                    help="training cases: a 2-layer proxy simulated whole, replayed with its layer-1 moves "
                         "broadcast, or a tied 6-layer proxy evaluated as the model (default: the case's "
                         "own: tied for llama70b-train-512, whose 80 layers' memory decides it)")
    args = ap.parse_args(argv)
    names = [c.name for c in CASES]
    chosen = CASES if args.cases == "all" else [c for c in CASES if c.name in args.cases.split(",")]
    if args.cases != "all" and len(chosen) != len(args.cases.split(",")):
        print(f"--cases: unknown case in {args.cases!r}; cases are {names}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, flush=True)

    results = []
    t0 = time.time()
    for c in chosen:
        try:
            results.append(run_case(c, args.budget, args.seed, log, args.proxy))
        except (MemoryError, RewriteError, ValueError) as e:  # one case's failure does not end the run
            log(f"[{c.name}] failed: {type(e).__name__}: {e}")
            continue
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"machine": platform.platform(), "budget_s": args.budget,
                                                   "results": results}, indent=1, default=str))
    print(table(results))
    ok = [r for r in results if math.isfinite(r["unseeded"]["vs_expert"])]
    def within(r: dict, x: float) -> bool:  # an infeasible best plan beats no expert
        return r["unseeded"]["feasible"] and r["unseeded"]["vs_expert"] <= x

    print(f"\n{len(ok)} cases; unseeded <= 1.0x expert on {sum(within(r, 1.0) for r in ok)}, "
          f"<= 0.95x on {sum(within(r, 0.95) for r in ok)}; {time.time() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
