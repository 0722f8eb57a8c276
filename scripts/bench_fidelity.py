"""Rank-fidelity benchmark: does the calibrated ``cpu`` model rank real NumPy executions of plans?

Random plans (``ir.rewrites.random_walk`` over 4 devices) of three workloads (an MLP, a
transformer block, a convnet) are run for real with NumPy, device-aware and verified
(``optimizer.realrun.measurement.measure_plan``: one buffer set per plan device, the lowering's
transfers as memory copies; per shard and transfer the median, or with ``--statistic min`` the
minimum, of ``--repeats`` timed runs after a warm-up; the plan's time is their sum plus the
executor's gap between them, which other processes' time slices do not inflate). Fused ops are
predicted stage by stage, as the executor runs them (``executed_hardware``). Each plan's
prediction is the serial time (``costmodel.evaluate.serial_prediction``: its shards one after
another on one device, which is how one machine runs it; the figure campaigns store), and the same
plus the modelled transfers.

Models compared, each as Spearman rank correlation and mean |log(predicted / measured)| over all
plans and per workload:

1. ``preset``: the ``cpu`` preset as shipped;
2. ``calibrated``: the ``cpu`` preset calibrated offline on the kernel spread of ``tapestry
   calibrate`` (``optimizer.realrun.calibration``) together with the shards of ``--cal-plans``
   held-out plans per workload (random walks from seed + 1000, ``calibrate_on_plans``), plus the
   executor's measured time between shards, *without* the campaign's online refit;
3. ``online``: the campaign's online refit (``optimizer.realrun.online.refit``, as a sampler runs
   it every ``--every`` plans), starting from the offline-calibrated hardware: each plan is
   predicted with the refit made *before* it was measured (held out; the first ``--every``
   plans use the offline calibration), so the figure is out of sample.

Goal (issue 13): Spearman >= 0.9 and mean |log| <= 0.2, with and without the online refit.

On this CPU the script pins BLAS to one thread (``OPENBLAS_NUM_THREADS=1`` etc., set before NumPy)
so that timings do not swing with other load. Prints tables and one JSON line; ``--json PATH``
writes the JSON too.

Usage: ``python scripts/bench_fidelity.py [--plans 50] [--repeats 5] [--every 5] [--seed 0]
[--cal-plans 3] [--statistic min|median] [--quick] [--json PATH]``
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

#: workloads and sizes: a few ms to tens of ms per plan on one CPU core, shards from launch-bound
#: to compute-bound
WORKLOADS = {
    "mlp": dict(batch=128, widths=(512, 2048, 512), activation="gelu"),
    "transformer": dict(batch=4, seq=128, d_model=256, heads=4, d_ff=1024),
    "convnet": dict(batch=4, channels=(3, 32, 32), size=32),
}
QUICK = {
    "mlp": dict(batch=16, widths=(64, 128, 64)),
    "transformer": dict(batch=2, seq=16, d_model=32, heads=2, d_ff=64),
    "convnet": dict(batch=2, channels=(3, 8, 8), size=8),
}


def random_plans(name: str, params: dict, n: int, seed: int, n_devices: int = 4) -> list:
    from ir import workloads
    from ir.rewrites import random_walk

    base = workloads.build(name, **params)
    rng = np.random.default_rng([seed, len(name)])
    plans, seen, tries = [base], {base.digest}, 0
    while len(plans) < n and tries < 50 * n:
        tries += 1
        g = random_walk(base, rng, n_devices, int(rng.integers(1, 30)))
        if g.digest not in seen:
            seen.add(g.digest)
            plans.append(g)
    return plans


def stats(pred, meas) -> dict:
    from optimizer.realrun.online import rank_stats

    return rank_stats(pred, meas)


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", type=int, default=50, help="plans in all, spread over the three workloads")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--every", type=int, default=5, help="online refit every N plans (the campaign's calibrate_every)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--statistic", choices=("median", "min"), default="min",
                    help="per shard and transfer over the repeats (min: the least disturbed run)")
    ap.add_argument("--cal-plans", type=int, default=3,
                    help="offline calibration plans per workload (seed + 1000: not the plans under test)")
    ap.add_argument("--quick", action="store_true", help="tiny workloads and the quick kernel spread (smoke test)")
    ap.add_argument("--json", help="also write the results as JSON to this path")
    a = ap.parse_args()

    from costmodel.evaluate import serial_prediction
    from costmodel.hardware_io import load_hardware
    from optimizer.realrun.calibration import run_calibration
    from optimizer.realrun.measurement import measure_plan
    from optimizer.realrun.online import plan_points, predict_plans, refit

    t0 = time.perf_counter()
    from optimizer.realrun.measurement import executed_hardware

    preset = executed_hardware(load_hardware("cpu"))
    print(f"# bench_fidelity: NumPy on {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, BLAS threads {os.environ.get('OPENBLAS_NUM_THREADS')}\n", flush=True)
    cal_res = run_calibration("numpy", preset, quick=a.quick, repeats=a.repeats, statistic=a.statistic)
    from optimizer.realrun.calibration import calibrate_on_plans

    # held-out calibration plans: the same workloads, random walks from another seed
    cal, dispatch, n_disp = calibrate_on_plans(cal_res, QUICK if a.quick else WORKLOADS, a.cal_plans, "numpy",
                                               a.repeats, seed=a.seed + 1000, statistic=a.statistic)
    print(f"offline calibration on {cal_res.before['n']} kernel points: mean |log(model/measured)| "
          f"{cal_res.before['mean_abs_log']:.3f} -> {cal_res.after['mean_abs_log']:.3f}; dispatch between shards "
          f"{dispatch * 1e6:.0f} us per shard; classes refitted with the shards of {n_disp} held-out plans\n", flush=True)

    sizes = QUICK if a.quick else WORKLOADS
    per = [a.plans // 3 + (1 if i < a.plans % 3 else 0) for i in range(3)]
    jobs = []
    for (name, params), n in zip(sizes.items(), per):
        jobs += [(name, g) for g in random_plans(name, params, n, a.seed)]
    # interleave the workloads, as a campaign's samples arrive in no particular order
    order = np.random.default_rng(a.seed).permutation(len(jobs))
    jobs = [jobs[i] for i in order]

    rows, records = [], []
    online_hw, fitted_digests = cal, []
    online_pred = []
    for i, (name, g) in enumerate(jobs):
        recs = measure_plan(g, cal, "numpy", repeats=a.repeats, warmup=1, statistic=a.statistic)
        plan = recs[-1]
        records += recs
        pts = plan_points(recs)
        online_pred.append(float(predict_plans(pts, online_hw)[0]))
        d = plan["details"]
        rows.append({"workload": name, "digest": g.digest[:12], "shards": g.n_shards, "transfers": d["transfers"],
                     "verified": plan["verified"], "measured_s": plan["measured_seconds"],
                     "preset_s": serial_prediction(g, preset), "calibrated_s": plan["predicted_seconds"],
                     "calibrated_transfers_s": d["serial_with_transfers"], "online_s": online_pred[-1]})
        print(f"  plan {i:2d} {name:11s} {g.n_shards:3d} shards {d['transfers']:3d} transfers: measured "
              f"{plan['measured_seconds'] * 1e3:8.2f} ms, calibrated {plan['predicted_seconds'] * 1e3:8.2f} ms, "
              f"online {online_pred[-1] * 1e3:8.2f} ms", file=sys.stderr, flush=True)
        if (i + 1) % a.every == 0:  # the campaign's refit, from the offline-calibrated hardware
            res = refit(records, cal)
            online_hw = res["hardware"]
    final = refit(records, cal)

    meas = [r["measured_s"] for r in rows]
    models = {"preset": "preset_s", "calibrated": "calibrated_s", "calibrated + transfers": "calibrated_transfers_s",
              "online refit (held out)": "online_s"}
    out = {"bench": "fidelity", "plans": len(rows), "repeats": a.repeats, "statistic": a.statistic,
           "every": a.every, "seed": a.seed,
           "quick": a.quick, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
           "offline_calibration": {"points": cal_res.before["n"], "before": cal_res.before["mean_abs_log"],
                                   "dispatch_s": dispatch, "dispatch_plans": n_disp,
                                   "after": cal_res.after["mean_abs_log"], "factors": cal_res.factors()},
           "verified": sum(r["verified"] for r in rows), "models": {}, "rows": rows}
    table = []
    for label, key in models.items():
        entry = {"all": stats([r[key] for r in rows], meas)}
        for w in sizes:
            sub = [r for r in rows if r["workload"] == w]
            entry[w] = stats([r[key] for r in sub], [r["measured_s"] for r in sub])
        out["models"][label] = entry
        table.append([label] + [f"{fmt(entry[k]['spearman'])} / {fmt(entry[k]['mean_abs_log'])}"
                                for k in ["all", *sizes]])
    out["models"]["online refit (in sample, final)"] = {"all": final["after"]}
    table.append(["online refit (in sample, final)", f"{fmt(final['after']['spearman'])} / "
                  f"{fmt(final['after']['mean_abs_log'])}"] + ["-"] * len(sizes))
    head = ["model", "all", *sizes]
    w = [max(len(str(r[i])) for r in table + [head]) for i in range(len(head))]
    print(f"\nSpearman rho / mean |log(pred/measured)| over {len(rows)} plans "
          f"({out['verified']} verified; measured {min(meas) * 1e3:.2f}-{max(meas) * 1e3:.2f} ms):\n")
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)))
    print("  ".join("-" * x for x in w))
    for r in table:
        print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))
    out["wall_s"] = time.perf_counter() - t0
    print(f"\n({out['wall_s']:.0f} s)")
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
