"""Farm benchmark: evaluations/s with 1 and 2 local workers, and hypervolume against evaluations
for the native island strategy, Optuna NSGA-II and random search on one workload and budget.

    python scripts/bench_farm.py [--evaluations 8000] [--seconds 30] [--json out.json] [--plot docs/farm_hv.png]

Strategies start from the single-device program only (no baselines seeded) with one fixed
hypervolume reference point, so their curves are comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def campaign(name: str, db: str, strategy: str, workers: int, evaluations: int | None, seconds: float | None) -> dict:
    from optimizer.campaign.config import parse_config
    from optimizer.campaign.lifecycle import run_campaign
    from storage import Archive

    cfg = parse_config({
        "name": name, "hardware": "h100-sxm-8",
        "workload": {"name": "mlp", "params": {"batch": 256, "widths": [1024, 4096, 1024]}},
        "objectives": ["makespan", "peak_memory"],
        "search": {"strategy": strategy, "seed_baselines": False, "steps_per_task": 200, "seed": 0},
        "budget": {"evaluations": evaluations, "wall_time": seconds},
        "cluster": {"workers": workers}, "storage": {"url": db}})
    t0 = time.perf_counter()
    res = run_campaign(cfg, quiet=True)
    total = time.perf_counter() - t0
    with Archive.open(db, readonly=True) as a:
        c = a.get_campaign(name)["counters"]
    return {"name": name, "strategy": strategy, "workers": workers, "evaluations": res["evaluations"],
            "search_seconds": c["wall_seconds"], "total_seconds": total,
            "evals_per_s": res["evaluations"] / max(c["wall_seconds"], 1e-9), "hypervolume": res["hypervolume"],
            "hv_history": c.get("hv_history", [])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--evaluations", type=int, default=8000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_farm_")
    db = os.path.join(tmp, "bench.db")

    rows = [campaign(f"rate_w{w}", db, "native", w, None, args.seconds) for w in (1, 2)]
    curves = [campaign(f"hv_{s.replace('-', '_')}", db, s, 2, args.evaluations, None)
              for s in ("native", "optuna-nsga2", "random")]

    print(f"{'run':<18}{'workers':>8}{'evaluations':>13}{'search s':>10}{'evals/s':>10}{'hypervolume':>14}")
    for r in rows + curves:
        print(f"{r['name']:<18}{r['workers']:>8}{r['evaluations']:>13}{r['search_seconds']:>10.1f}"
              f"{r['evals_per_s']:>10.0f}{r['hypervolume']:>14.5g}")
    summary = {"throughput": [{k: r[k] for k in ("workers", "evaluations", "search_seconds", "evals_per_s")}
                              for r in rows],
               "hypervolume": {r["strategy"]: {"final": r["hypervolume"], "evaluations": r["evaluations"],
                                               "history": r["hv_history"]} for r in curves}}
    print(json.dumps({"throughput": summary["throughput"],
                      "final_hypervolume": {k: v["final"] for k, v in summary["hypervolume"].items()}}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
        for r in curves:
            h = r["hv_history"]
            if h:
                xs = [p[0] for p in h] + [r["evaluations"]]
                ys = [p[1] for p in h] + [h[-1][1]]
                ax.step(xs, ys, where="post", label=r["strategy"])
        ax.set_xlabel("evaluations")
        ax.set_ylabel("hypervolume (makespan × peak memory)")
        ax.set_title("mlp 256×[1024, 4096, 1024] on h100-sxm-8")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()
