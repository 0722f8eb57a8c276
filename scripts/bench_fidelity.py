"""Rank-fidelity benchmark: does the calibrated model rank real executions of plans (NumPy on this
CPU against the ``cpu`` model, or CuPy on a GPU against its preset, ``--backend cupy``)?

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
   held-out plans per workload (random walks from seed + 1000, ``calibration_plans``,
   ``calibrate_with_plans``), plus the executor's measured time between shards, *without* the
   campaign's online refit;
3. ``online``: the campaign's online refit (``optimizer.realrun.online.refit``, as a sampler runs
   it every ``--every`` plans), starting from the offline-calibrated factors
   (``calibrate_shards``; the refit adds the time between shards itself): each plan is
   predicted with the refit made *before* it in the plan order (held out: no plan's own timings
   ever predict it; the first ``--every`` plans use the offline calibration). With interleaved
   passes the earlier plans' timings were taken in the same passes as the plan's own, i.e. under
   the same load, which a campaign's refit of earlier samples does not enjoy.

Goal (issue 13): Spearman >= 0.9 and mean |log| <= 0.2, with and without the online refit.

``--backend cupy``: the same on the local GPU (every plan device mapped onto it), against
``--hardware`` (default: ``h200-sxm-8`` on an H200, else ``h100-sxm-8``) and the GPU kernel spread;
the workloads are larger (``GPU_WORKLOADS``: a few ms per plan, shards from launch-bound to
compute-bound on an H100). The reference outputs are still computed with NumPy.

``--records PATH`` writes every measured record (kernel points, every plan's shards and
transfers); ``--replay PATH`` scores the models on such a file without measuring: a GPU's run,
say, re-scored here with later calibration or model code (the plans are rebuilt from the seed
and checked against the recorded digests; plans this code no longer draws are predicted from
their recorded shard work, without modelled transfers or residuals by kernel).

``--retest``: no models; the plans under test are measured twice, one complete measurement after
the other (each ``--rounds`` passes), and the two are compared (Spearman and mean |log| of one
against the other): the measurement's self-consistency, about the best any model can show.

Also printed: residuals of the calibrated model per kernel (median log(model / measured) of the
plans' shards), the data for choosing efficiency classes.

On the CPU the script pins BLAS to one thread (``OPENBLAS_NUM_THREADS=1`` etc., set before NumPy)
so that timings do not swing with other load. Prints tables and one JSON line; ``--json PATH``
writes the JSON too.

Usage: ``python scripts/bench_fidelity.py [--backend numpy|cupy] [--hardware PRESET] [--plans 50]
[--rounds 3] [--repeats 2] [--every 5] [--seed 0] [--cal-plans 3] [--statistic min|median] [--retest]
[--quick] [--json PATH] [--records PATH] [--replay PATH]``
"""

from __future__ import annotations

import os
import sys

if "cupy" not in sys.argv:  # on CPU: one BLAS thread (set before NumPy); on a GPU the NumPy references use all
    for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
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
#: on a GPU (``--backend cupy``): larger, so that shards range from launch-bound (a few us) to
#: compute-bound (ms) and a plan's NumPy reference stays well under a second on a 16-core host
GPU_WORKLOADS = {
    "mlp": dict(batch=4096, widths=(1024, 4096, 1024), activation="gelu"),
    "transformer": dict(batch=4, seq=512, d_model=1024, heads=8, d_ff=4096),
    "convnet": dict(batch=16, channels=(3, 64, 64), size=64),
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


def print_table(head: list[str], table: list[list]) -> None:
    w = [max(len(str(r[i])) for r in table + [head]) for i in range(len(head))]
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)))
    print("  ".join("-" * x for x in w))
    for r in table:
        print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))


def test_jobs(sizes: dict, n_plans: int, seed: int) -> list[tuple[str, object]]:
    """The plans under test, ``(workload, Graph)``, the workloads interleaved (a campaign's samples
    arrive in no particular order)."""
    per = [n_plans // 3 + (1 if i < n_plans % 3 else 0) for i in range(3)]
    jobs = []
    for (name, params), n in zip(sizes.items(), per):
        jobs += [(name, g) for g in random_plans(name, params, n, seed)]
    order = np.random.default_rng(seed).permutation(len(jobs))
    return [jobs[i] for i in order]


def kernel_residuals(jobs, merged: dict, hw) -> list[dict]:
    """Per kernel (a fused op: ``fused:<stages>``), over the test plans' shards: count, measured
    seconds in all, and the median and spread (quartiles) of log(model on ``hw`` / measured)."""
    from costmodel.lowering import kernel_class_of

    by: dict[str, list[tuple[float, float]]] = {}
    for i, (_, g) in enumerate(jobs):
        for m in merged[i]:
            if m["kind"] != "shard":
                continue
            o = g.ops[m["op"]]
            d = m["details"]
            name = ("fused:" + "+".join(st["kernel"] for st in o.params["stages"]) if o.kernel == "fused"
                    else o.kernel) + f" [{kernel_class_of(o)}]"
            pred = sum(float(hw.shard_time(fl, by_, d["dtype"], k))
                       for k, fl, by_ in (d.get("stages") or [(d["kernel_class"], d["flops"], d["bytes"])]))
            by.setdefault(name, []).append((pred, m["measured_seconds"]))
    out = []
    for name, v in sorted(by.items(), key=lambda kv: -sum(x[1] for x in kv[1])):
        lg = np.log(np.array([p for p, _ in v]) / np.array([x for _, x in v]))
        q1, med, q3 = np.percentile(lg, [25, 50, 75])
        out.append({"kernel": name, "shards": len(v), "measured_s": float(sum(x for _, x in v)),
                    "median_log": float(med), "q1_log": float(q1), "q3_log": float(q3)})
    return out


def retest(a, sizes: dict) -> dict:
    """Measure the plans under test twice, one complete measurement after the other; compare."""
    from costmodel.hardware_io import load_hardware
    from optimizer.realrun.measurement import executed_hardware
    from optimizer.realrun.rounds import measure_rounds

    hw = executed_hardware(load_hardware(a.hardware))
    jobs = test_jobs(sizes, a.plans, a.seed)
    passes, loads = [], [os.getloadavg()[0]]
    for k in range(2):
        t = time.perf_counter()
        _, merged = measure_rounds([], list(enumerate(g for _, g in jobs)), hw, a.backend, rounds=a.rounds,
                                   repeats=a.repeats, statistic=a.statistic, seed=a.seed + 17 * k,
                                   progress=lambda r, n: print(f"  pass {k + 1}: round {r}/{n}", file=sys.stderr,
                                                               flush=True))
        passes.append([next(r for r in merged[i] if r["kind"] == "plan")["measured_seconds"]
                       for i in range(len(jobs))])
        loads.append(os.getloadavg()[0])
        print(f"pass {k + 1}: {time.perf_counter() - t:.0f} s, load average {loads[-1]:.2f}", flush=True)
    out = {"bench": "fidelity-retest", "plans": len(jobs), "rounds": a.rounds, "repeats": a.repeats,
           "statistic": a.statistic, "seed": a.seed, "load_average": loads,
           "all": stats(passes[1], passes[0])}
    table = [["all", f"{fmt(out['all']['spearman'])} / {fmt(out['all']['mean_abs_log'])}"]]
    for w in sizes:
        idx = [i for i, (name, _) in enumerate(jobs) if name == w]
        out[w] = stats([passes[1][i] for i in idx], [passes[0][i] for i in idx])
        table.append([w, f"{fmt(out[w]['spearman'])} / {fmt(out[w]['mean_abs_log'])}"])
    print(f"\nself-consistency, second measurement against the first ({a.rounds} round(s) x {a.repeats} "
          f"repeats, {a.statistic}), Spearman / mean |log|:\n")
    print_table(["plans", "retest"], table)
    out["passes"] = passes
    return out


def write_records(a, sizes: dict, machine: str, kernel_recs: list, merged: dict, n_cal: int, jobs: list,
                  loads: tuple[float, float]) -> None:
    """Every measured record of the run, for ``--replay``: the kernel points, the calibration
    plans' and the test plans' records (with each test plan's workload and digest)."""
    doc = {"bench": "fidelity-records", "backend": a.backend, "hardware": a.hardware, "machine": machine,
           "quick": a.quick, "seed": a.seed, "plans": a.plans, "rounds": a.rounds, "repeats": a.repeats,
           "statistic": a.statistic, "sizes": sizes, "load_average": list(loads),
           "kernel": kernel_recs, "cal": [merged[("cal", i)] for i in range(n_cal)],
           "test": [{"workload": w, "digest": g.digest, "records": merged[("test", i)]}
                    for i, (w, g) in enumerate(jobs)]}
    Path(a.records).parent.mkdir(parents=True, exist_ok=True)
    Path(a.records).write_text(json.dumps(doc, default=float) + "\n")


def replay_records(doc: dict) -> tuple[list, dict, int, tuple[float, float]]:
    """``(kernel records, {("cal"|"test", i): records}, calibration plans, load averages)`` of a
    ``--records`` file."""
    merged = {("cal", i): recs for i, recs in enumerate(doc["cal"])}
    merged.update({("test", i): t["records"] for i, t in enumerate(doc["test"])})
    return doc["kernel"], merged, len(doc["cal"]), tuple(doc["load_average"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("numpy", "cupy"), default="numpy",
                    help="numpy: this CPU; cupy: the local GPU (every plan device mapped onto it)")
    ap.add_argument("--hardware", default=None,
                    help="the model's preset or YAML (default: cpu; with cupy h200-sxm-8 on an H200, else h100-sxm-8)")
    ap.add_argument("--plans", type=int, default=50, help="plans in all, spread over the three workloads")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved passes over all items (optimizer.realrun.rounds)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per item and pass")
    ap.add_argument("--every", type=int, default=5, help="online refit every N plans (the campaign's calibrate_every)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--statistic", choices=("median", "min"), default="min",
                    help="per shard and transfer over the timed runs (min: the least disturbed run)")
    ap.add_argument("--cal-plans", type=int, default=3,
                    help="offline calibration plans per workload (seed + 1000: not the plans under test)")
    ap.add_argument("--retest", action="store_true",
                    help="measure the plans under test twice and compare (self-consistency); no models")
    ap.add_argument("--quick", action="store_true", help="tiny workloads and the quick kernel spread (smoke test)")
    ap.add_argument("--json", help="also write the results as JSON to this path")
    ap.add_argument("--records", help="also write every measured record (kernel points, plans' shards and "
                                      "transfers) as JSON to this path, for --replay")
    ap.add_argument("--replay", help="no measurements: score the models on the records of an earlier run "
                                     "(--records), e.g. a GPU's, with this code's calibration and model")
    a = ap.parse_args()

    from costmodel.evaluate import serial_prediction
    from costmodel.hardware_io import load_hardware
    from optimizer.realrun.calibration import (calibrate_records, calibrate_shards, calibrate_with_plans,
                                               calibration_plans, kernel_spread)
    from optimizer.realrun.measurement import executed_hardware, plan_predictions
    from optimizer.realrun.online import plan_points, predict_plans, refit
    from optimizer.realrun.rounds import measure_rounds

    from costmodel.hardware import HardwareError
    from executor.backend import BackendError
    from executor.device_run import device_name

    t0 = time.perf_counter()
    replay = None
    if a.replay:
        try:
            replay = json.loads(Path(a.replay).read_text())
            a.backend, a.quick, a.seed, a.plans = replay["backend"], replay["quick"], replay["seed"], replay["plans"]
            a.hardware, machine = a.hardware or replay["hardware"], replay["machine"] + " (replayed)"
            a.rounds, a.repeats, a.statistic = replay["rounds"], replay["repeats"], replay["statistic"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"bench_fidelity: --replay {a.replay!r}: not the records of a run (--records): {e}", file=sys.stderr)
            return 2
    else:
        try:
            machine = device_name(a.backend)
        except BackendError as e:
            print(f"bench_fidelity: --backend {a.backend}: {e}", file=sys.stderr)
            return 2
    gpu = a.backend == "cupy"
    sizes = ({k: dict(v) for k, v in replay["sizes"].items()} if replay else
             QUICK if a.quick else GPU_WORKLOADS if gpu else WORKLOADS)
    if a.hardware is None:
        a.hardware = ("h200-sxm-8" if "H200" in machine else "h100-sxm-8") if gpu else "cpu"
    try:
        load_hardware(a.hardware)
    except (HardwareError, OSError, ValueError) as e:
        print(f"bench_fidelity: --hardware {a.hardware!r}: {e}", file=sys.stderr)
        return 2
    print(f"# bench_fidelity: {'CuPy' if gpu else 'NumPy'} on {machine}, model {a.hardware}; host "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, BLAS threads "
          f"{os.environ.get('OPENBLAS_NUM_THREADS')}, load average {os.getloadavg()[0]:.2f}\n", flush=True)
    if a.retest:
        out = retest(a, sizes)
    else:
        preset = executed_hardware(load_hardware(a.hardware))
        jobs = test_jobs(sizes, a.plans, a.seed)
        if replay is None:
            cases = kernel_spread(a.backend, a.quick)
            cal_jobs = calibration_plans(sizes, a.cal_plans, seed=a.seed + 1000)
            items = ([(("cal", i), g) for i, (_, g) in enumerate(cal_jobs)]
                     + [(("test", i), g) for i, (_, g) in enumerate(jobs)])
            load0 = os.getloadavg()[0]
            kernel_recs, merged = measure_rounds(
                cases, items, preset, a.backend, rounds=a.rounds, repeats=a.repeats, statistic=a.statistic,
                seed=a.seed, progress=lambda r, n: print(f"  round {r}/{n} ({time.perf_counter() - t0:.0f} s, load "
                                                         f"average {os.getloadavg()[0]:.2f})", file=sys.stderr,
                                                         flush=True))
            load1 = os.getloadavg()[0]
            if a.records:
                write_records(a, sizes, machine, kernel_recs, merged, len(cal_jobs), jobs, (load0, load1))
        else:
            kernel_recs, merged, n_cal, (load0, load1) = replay_records(replay)
            cal_jobs = [None] * n_cal
            if [w for w, _ in jobs] != [t["workload"] for t in replay["test"]] or any(
                    g.digest != t["digest"] for (_, g), t in zip(jobs, replay["test"])):
                print("bench_fidelity: this code's random plans differ from the recorded ones: plans are predicted "
                      "from their recorded shard work (no modelled transfers, no residuals by kernel)",
                      file=sys.stderr)
                jobs = [(t["workload"], None) for t in replay["test"]]
        # offline calibration: the kernel spread, then the shards of the held-out calibration plans
        cal_res = calibrate_records(kernel_recs, preset)
        cal_records = [r for i in range(len(cal_jobs)) for r in merged[("cal", i)]]
        cal, dispatch, n_disp = calibrate_with_plans(cal_res, cal_records)
        # the refit's base: the offline factors without the time between shards, which refit adds itself
        refit_base = calibrate_shards(cal_res, cal_records)
        print(f"offline calibration on {cal_res.before['n']} kernel points: mean |log(model/measured)| "
              f"{cal_res.before['mean_abs_log']:.3f} -> {cal_res.after['mean_abs_log']:.3f}; dispatch between shards "
              f"{dispatch * 1e6:.0f} us per shard; classes refitted with the shards of {n_disp} held-out plans\n",
              flush=True)

        rows, records = [], []
        online_hw = cal
        for i, (name, g) in enumerate(jobs):
            recs = merged[("test", i)]
            plan = recs[-1]
            records += recs
            # the refit made before this plan was measured (held out)
            pts = plan_points(recs)
            online = float(predict_plans(pts, online_hw)[0])
            if g is not None:
                serial, with_transfers = plan_predictions(g, cal)
                at_preset = serial_prediction(g, preset)
            else:  # replayed records of other plans: the serial model from the shards' recorded work
                serial, at_preset = float(predict_plans(pts, cal)[0]), float(predict_plans(pts, preset)[0])
                with_transfers = float("nan")
            n_shards = len(pts[0]["shards"])
            rows.append({"workload": name, "digest": plan["plan_digest"][:12], "shards": n_shards,
                         "transfers": plan["details"]["transfers"], "verified": plan["verified"],
                         "measured_s": plan["measured_seconds"], "preset_s": at_preset,
                         "calibrated_s": serial, "calibrated_transfers_s": with_transfers, "online_s": online})
            print(f"  plan {i:2d} {name:11s} {n_shards:3d} shards {rows[-1]['transfers']:3d} transfers: measured "
                  f"{plan['measured_seconds'] * 1e3:8.2f} ms, calibrated {serial * 1e3:8.2f} ms, "
                  f"online {online * 1e3:8.2f} ms", file=sys.stderr, flush=True)
            if (i + 1) % a.every == 0:  # the campaign's refit, from the offline-calibrated hardware
                online_hw = refit(records, refit_base)["hardware"]
        final = refit(records, refit_base)

        meas = [r["measured_s"] for r in rows]
        models = {"preset": "preset_s", "calibrated": "calibrated_s", "calibrated + transfers": "calibrated_transfers_s",
                  "online refit (held out)": "online_s"}
        if any(r["calibrated_transfers_s"] != r["calibrated_transfers_s"] for r in rows):  # NaN: not replayable
            del models["calibrated + transfers"]
        out = {"bench": "fidelity", "backend": a.backend, "hardware": a.hardware, "plans": len(rows),
               "replayed": a.replay,
               "rounds": a.rounds, "repeats": a.repeats,
               "statistic": a.statistic, "every": a.every, "seed": a.seed, "quick": a.quick,
               "machine": f"{machine}; host {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
               "load_average": [load0, load1],
               "offline_calibration": {"points": cal_res.before["n"], "before": cal_res.before["mean_abs_log"],
                                       "dispatch_s": dispatch, "dispatch_plans": n_disp,
                                       "after": cal_res.after["mean_abs_log"], "factors": cal_res.factors(),
                                       "efficiency": {k: list(v) for k, v in cal.efficiency.items()},
                                       "launch": dict(cal.launch_overhead_by_class)},
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
        print(f"\nSpearman rho / mean |log(pred/measured)| over {len(rows)} plans "
              f"({out['verified']} verified; measured {min(meas) * 1e3:.2f}-{max(meas) * 1e3:.2f} ms; "
              f"load average {load0:.2f} -> {load1:.2f}):\n")
        print_table(["model", "all", *sizes], table)
        res = kernel_residuals(jobs, [merged[("test", i)] for i in range(len(jobs))], cal) if all(
            g is not None for _, g in jobs) else []
        out["residuals"] = res
        print("\nresiduals of the calibrated model per kernel [class], the test plans' shards:\n")
        print_table(["kernel [class]", "shards", "measured", "median log(model/measured)", "quartiles"],
                    [[r["kernel"], r["shards"], f"{r['measured_s'] * 1e3:.1f} ms", f"{r['median_log']:+.2f}",
                      f"{r['q1_log']:+.2f} .. {r['q3_log']:+.2f}"] for r in res])
    out["wall_s"] = time.perf_counter() - t0
    print(f"\n({out['wall_s']:.0f} s)")
    print(json.dumps({k: v for k, v in out.items() if k not in ("rows", "passes", "residuals")}))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
