"""GPU benchmark: measured vs roofline shard times, calibrated efficiency factors, and how well the
cost model ranks the real times of plans.

Three parts, each printed as a table, then one JSON line with everything:

1. **Shards vs roofline.** Matmul and elementwise (add, relu, gelu) shards of several sizes, each a
   one-op graph timed by ``executor.measure.time_ops`` (CUDA events on GPU, median of
   ``--repeats`` after a warm-up). Next to each: the datasheet roofline of the ``--hardware``
   preset's device, ``max(FLOPs / peak, bytes / bandwidth)`` (no launch overhead, efficiency 1),
   the fraction of it reached (roofline / measured), and the achieved FLOP/s and bytes/s.
2. **Calibration.** The whole kernel spread of ``tapestry calibrate`` (matmul/linear, elementwise,
   softmax/layernorm, conv2d, reduce_sum at several sizes) fitted with ``costmodel.calibrate``:
   efficiency factors and launch overhead per kernel class, and the model's error before/after.
3. **Ranking plans.** ``--plans`` (default 30) plans of the quickstart workload
   (``configs/quickstart.yaml``: its workload and hardware), made by random rewrites over the
   hardware's devices. Each is run device-aware (``executor.device_run.run_on_devices``: all
   plan devices mapped onto this machine's GPU(s), transfers as the lowering says), checked
   against the unsharded program and timed (median of ``--repeats``). Predicted: the serial
   time on the *calibrated* hardware (every shard one after another, as one GPU runs them;
   ``costmodel.evaluate.serial_prediction``), also with the modelled transfers added. Reported:
   the Spearman rank correlation of predicted vs measured plan times.

Without a GPU (``--backend cupy`` where CuPy or ``cupy.cuda.is_available()`` is missing) the script
prints what it would measure and exits 0 with a note. ``--backend numpy`` runs the same
measurements on this CPU (against the ``cpu`` preset unless ``--hardware`` says otherwise), with
one BLAS thread (``OPENBLAS_NUM_THREADS=1`` etc. unless already set) so that the figures do not
swing with other load on a small shared machine.

Usage: ``python scripts/bench_gpu.py [--backend cupy|numpy] [--hardware PRESET] [--plans 30]
[--repeats 5] [--quick] [--seed 0] [--json PATH]``
"""

from __future__ import annotations

import os
import sys

if "numpy" in sys.argv:  # on CPU: one BLAS thread, so timings do not depend on what else runs (set before numpy)
    for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH

WHAT = """This benchmark would measure, on {backend}:
  1. measured vs roofline time of matmul shards (square 256..8192, skinny 8192x64x8192, 16384x16x4096) and
     elementwise shards (add/relu/gelu, 64K..64M elements), float32;
  2. the efficiency factors and launch overheads per kernel class fitted from the calibration spread
     (matmul/linear, elementwise, softmax/layernorm, conv2d, reduce_sum);
  3. the Spearman rank correlation between predicted (calibrated serial model) and measured plan times
     on {plans} random plans of the quickstart workload (configs/quickstart.yaml), run device-aware on the GPU."""


def si(x: float, unit: str) -> str:
    for f, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n")):
        if abs(x) >= f:
            return f"{x / f:.3g} {p}{unit}"
    return f"{x:.3g} {unit}"


def sig(x: float) -> float:
    return float(f"{x:.3g}")


def table(rows: list[list[str]], head: list[str]) -> str:
    w = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([line(head), "  ".join("-" * x for x in w)] + [line(r) for r in rows])


def backend_available(backend: str) -> tuple[bool, str]:
    from executor.backend import BackendError, get_backend

    try:
        get_backend(backend)
        return True, ""
    except BackendError as e:
        return False, str(e)


def device_label(backend: str) -> str:
    from executor.device_run import device_name

    return device_name(backend)


# ---------------------------------------------------------------------------------------------
# 1. shards vs roofline
# ---------------------------------------------------------------------------------------------


def part_roofline(backend: str, hw, repeats: int, quick: bool) -> list[dict]:
    from optimizer.realrun.calibration import kernel_spread, measure_spread

    cases = [c for c in kernel_spread(backend, quick) if c.kernel in ("matmul", "add", "relu", "gelu")]
    recs = measure_spread(cases, backend, repeats=repeats, warmup=2)
    out = []
    for r in recs:
        roof = max(r["flops"] / hw.peak_flops(r["dtype"]), r["bytes"] / hw.device.mem_bandwidth)
        model = float(hw.shard_time(r["flops"], r["bytes"], r["dtype"], r["kernel_class"]))
        out.append({"case": r["case"], "kernel_class": r["kernel_class"], "flops": r["flops"], "bytes": r["bytes"],
                    "measured_s": r["seconds"], "roofline_s": roof, "model_s": model,
                    "fraction_of_roofline": roof / r["seconds"], "flop_per_s": r["flops"] / r["seconds"],
                    "bytes_per_s": r["bytes"] / r["seconds"]})
    return out


# ---------------------------------------------------------------------------------------------
# 3. ranking plans of the quickstart workload
# ---------------------------------------------------------------------------------------------


def quickstart_plans(n: int, seed: int, n_devices: int):
    import yaml

    from ir import workloads
    from ir.rewrites import random_walk

    cfg = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    base = workloads.build(cfg["workload"]["name"], **cfg["workload"].get("params", {}))
    rng = np.random.default_rng(seed)
    plans, seen = [base], {base.digest}
    tries = 0
    while len(plans) < n and tries < 50 * n:
        tries += 1
        g = random_walk(base, rng, n_devices, int(rng.integers(1, 40)))
        if g.digest not in seen:
            seen.add(g.digest)
            plans.append(g)
    return cfg, plans


def part_plans(backend: str, hw_cal, n: int, repeats: int, seed: int) -> dict:
    from scipy.stats import spearmanr

    from costmodel.evaluate import serial_prediction
    from costmodel.hardware_io import load_hardware
    from costmodel.lowering import Lowerer
    from costmodel.transfers import transfer_plan
    from executor.device_run import run_on_devices
    from executor.run import execute, outputs, random_inputs
    from executor.verify import TOLERANCE, rel_error
    from ir.rewrites import unshard

    cfg_hw = _quickstart_hardware()
    cfg, plans = quickstart_plans(n, seed, load_hardware(cfg_hw).n_devices)
    ref_graph = unshard(plans[0])
    inputs = random_inputs(ref_graph, 0)
    ref = execute(ref_graph, inputs, "numpy")
    hw_plan = hw_cal.replace(n_nodes=1, devices_per_node=max(hw_cal.n_devices, 1 + max(
        max(g.devices) for g in plans)))
    rows = []
    for i, g in enumerate(plans):
        tp = transfer_plan(g, hw_plan)
        t0 = time.perf_counter()
        res = run_on_devices(g, tp.transfers, tp.residency, backend=backend, timing=True, repeats=repeats, warmup=1,
                             state_transfers=tp.state_transfers,
                             inputs=inputs)
        err = max(rel_error(res.outputs[o], np.asarray(ref[o])) for o in outputs(ref_graph))
        low = Lowerer(hw_plan).lower(g)
        nc = int(low.op_offsets[-1])
        serial = serial_prediction(g, hw_cal)
        rows.append({"plan": i, "digest": g.digest[:12], "ops": len(g.ops), "shards": g.n_shards,
                     "devices": len(g.devices), "transfers": len(tp.transfers), "transfer_bytes": tp.transfer_bytes,
                     "measured_s": res.plan_seconds, "predicted_serial_s": serial,
                     "predicted_serial_transfers_s": serial + float(low.elapsed[nc:].sum()),
                     "measured_shards_s": float(sum(s["seconds"] for s in res.shards)),
                     "max_rel_error": err, "verified": bool(err <= TOLERANCE["float32"]),
                     "wall_s": time.perf_counter() - t0})
        print(f"  plan {i:2d}: {g.n_shards:3d} shards, {len(tp.transfers):3d} transfers, measured "
              f"{si(res.plan_seconds, 's')}, predicted {si(serial, 's')}", file=sys.stderr, flush=True)
    meas = [r["measured_s"] for r in rows]
    rho = spearmanr([r["predicted_serial_s"] for r in rows], meas)
    rho_t = spearmanr([r["predicted_serial_transfers_s"] for r in rows], meas)
    rho_shards = spearmanr([r["predicted_serial_s"] for r in rows], [r["measured_shards_s"] for r in rows])
    return {"workload": cfg["workload"], "hardware": cfg_hw, "n": len(rows), "rows": rows,
            "spearman": float(rho[0]), "p_value": float(rho[1]), "spearman_with_transfers": float(rho_t[0]),
            "spearman_shards_only": float(rho_shards[0]), "verified": sum(r["verified"] for r in rows),
            "measured_range_s": [min(meas), max(meas)]}


def _quickstart_hardware() -> str:
    import yaml

    return yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())["hardware"]


# ---------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["cupy", "numpy"], default="cupy")
    ap.add_argument("--hardware", default=None,
                    help="preset or YAML the roofline and calibration start from (default: h100-sxm-8 on cupy, "
                         "cpu on numpy)")
    ap.add_argument("--plans", type=int, default=30, help="quickstart plans to rank (at least 30 for the report)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per shard/plan (median)")
    ap.add_argument("--quick", action="store_true", help="small kernel spread (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results as JSON to this path")
    a = ap.parse_args()

    ok, why = backend_available(a.backend)
    if not ok:
        print(WHAT.format(backend="the GPU (CuPy)" if a.backend == "cupy" else a.backend, plans=a.plans))
        print(f"\nnote: not run: {why}\nRun it on a machine with an NVIDIA GPU and CuPy "
              f"(pip install -e '.[gpu]'): python scripts/bench_gpu.py --json out/bench_gpu.json;\n"
              f"the CPU equivalent: python scripts/bench_gpu.py --backend numpy")
        doc = {"bench": "gpu", "backend": a.backend, "status": "not run", "reason": why}
        print(json.dumps(doc))
        if a.json:
            Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
        return 0

    from costmodel.hardware_io import load_hardware
    from optimizer.realrun.calibration import calibrate_records, kernel_spread, measure_spread

    hw_name = a.hardware or ("h100-sxm-8" if a.backend == "cupy" else "cpu")
    hw = load_hardware(hw_name)
    t_start = time.perf_counter()
    dev = device_label(a.backend)
    print(f"# bench_gpu: backend {a.backend} on {dev}; model hardware {hw.name} ({hw.device.name})\n")

    roof = part_roofline(a.backend, hw, a.repeats, a.quick)
    print("## 1. shards: measured vs roofline (datasheet peaks of the model's device)\n")
    print(table([[r["case"], si(r["flops"], "FLOP"), si(r["bytes"], "B"), si(r["measured_s"], "s"),
                  si(r["roofline_s"], "s"), f"{r['fraction_of_roofline']:.3f}", si(r["flop_per_s"], "FLOP/s"),
                  si(r["bytes_per_s"], "B/s")] for r in roof],
                ["case", "FLOPs", "bytes", "measured", "roofline", "fraction", "achieved", "bandwidth"]))

    recs = measure_spread(kernel_spread(a.backend, a.quick), a.backend, repeats=a.repeats, warmup=2)
    cal = calibrate_records(recs, hw)
    print("\n## 2. calibrated efficiency factors (costmodel.calibrate)\n")
    fac = cal.factors()
    print(table([[k, str(v["n"]), f"{v['compute']:.3g}" + ("" if v["compute_identified"] else " (kept)"),
                  f"{v['memory']:.3g}" + ("" if v["memory_identified"] else " (kept)"), si(v["launch"], "s"),
                  "-" if v["rms_rel_error"] is None else f"{v['rms_rel_error']:.2f}"] for k, v in fac.items()],
                ["class", "points", "compute eff", "memory eff", "launch", "rms rel err"]))
    print(f"\nmodel error over {cal.before['n']} points, mean |log(model/measured)|: "
          f"before {cal.before['mean_abs_log']:.3f}, after {cal.after['mean_abs_log']:.3f}")

    print(f"\n## 3. rank correlation on {a.plans} quickstart plans (predicted: serial model on the calibrated "
          f"hardware)\n", flush=True)
    plans = part_plans(a.backend, cal.hardware, a.plans, a.repeats, a.seed)
    print(table([[str(r["plan"]), str(r["shards"]), str(r["transfers"]), si(r["measured_s"], "s"),
                  si(r["predicted_serial_s"], "s"), si(r["predicted_serial_transfers_s"], "s"),
                  "yes" if r["verified"] else "NO"] for r in plans["rows"]],
                ["plan", "shards", "transfers", "measured", "predicted", "pred.+transfers", "verified"]))
    print(f"\nSpearman rho (predicted serial vs measured plan time): {plans['spearman']:.3f} "
          f"(p = {plans['p_value']:.2g}, n = {plans['n']}); with modelled transfers: "
          f"{plans['spearman_with_transfers']:.3f}; shards only: {plans['spearman_shards_only']:.3f}; "
          f"verified {plans['verified']}/{plans['n']}")

    doc = {"bench": "gpu", "backend": a.backend, "status": "ok", "device": dev, "hardware": hw.name,
           "python": platform.python_version(), "repeats": a.repeats, "quick": a.quick,
           "roofline": roof, "factors": fac, "error_before": cal.before, "error_after": cal.after,
           "plans": {k: v for k, v in plans.items() if k != "rows"}, "plan_rows": plans["rows"],
           "seconds": time.perf_counter() - t_start}
    line = {"bench": "gpu", "backend": a.backend, "device": dev, "hardware": hw.name,
            "fraction_of_roofline": {r["case"]: sig(r["fraction_of_roofline"]) for r in roof},
            "factors": {k: [sig(v["compute"]), sig(v["memory"]), sig(v["launch"])] for k, v in fac.items()},
            "model_error_mean_abs_log": [round(cal.before["mean_abs_log"], 3), round(cal.after["mean_abs_log"], 3)],
            "plans": plans["n"], "spearman": round(plans["spearman"], 3),
            "spearman_with_transfers": round(plans["spearman_with_transfers"], 3), "verified": plans["verified"],
            "seconds": round(doc["seconds"], 1)}
    print(json.dumps(line))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
