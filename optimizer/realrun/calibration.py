"""Calibration runs: time a spread of kernels and shard sizes, fit the cost model to them.

The spread (``kernel_spread``) covers every efficiency class the cost model distinguishes:
``matmul`` (matmul and linear, square and skinny), its subclasses ``matmul.attention``
(attention of a transformer's heads), ``matmul.norm`` (a layernorm fused into the linear or
per-head projection that reads it) and ``matmul.einsum`` (a transformer's per-head projections,
whose transposes the executor pays), ``elementwise`` (add, relu, gelu), ``rowwise`` (softmax,
layernorm), ``conv`` (conv2d 3x3) and ``reduction`` (reduce_sum), each at several sizes from
launch-bound to bandwidth- or compute-bound. Sizes depend on the backend (a
GPU needs far bigger shards to leave the launch-bound regime); ``quick`` keeps a few small ones
per class (tests, smoke runs).

Each point is a one-op graph (one shard) timed by ``executor.measure.time_ops`` (median of
``repeats`` after a warm-up; CUDA events on GPU). Its record is
``{kernel_class, flops, bytes, dtype, seconds}`` (plus ``case``, ``kernel``, ``shape``), with
FLOPs and bytes (read + written) from the kernel's signature, exactly what the lowering charges.
``costmodel.calibrate.calibrate`` fits the efficiency factors and launch overheads per class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class Case:
    name: str          # e.g. "matmul 256x256x256"
    kernel: str
    build: Callable[[], Any]  # -> one-op Graph


def _one_op(kernel: str, dtype: str, inputs: dict[str, tuple[int, ...]], roles: dict[str, str] | None = None,
            **params: Any) -> Callable[[], Any]:
    def build() -> Any:
        from ir.builder import GraphBuilder

        b = GraphBuilder(dtype)
        ins = {}
        for port, shape in inputs.items():
            role = (roles or {}).get(port, "input")
            ins[port] = b.parameter(port, shape) if role == "parameter" else b.input(port, shape)
        b.op(kernel, "k", ins, **params)
        return b.build()

    return build


def _norm_matmul(dtype: str, rows: int, d: int, out: int, heads: int = 0, shards: int = 1) -> Callable[[], Any]:
    """A layernorm over ``d`` read by a linear ``d -> out`` (``heads == 0``) or by a per-head
    projection ``bsd,dhe->bhse`` (``heads`` heads of ``out // heads``), fused into one
    ``norm_matmul`` op (``ir.rewrites.fuse_norm``), as the transformer's plans run it; split into
    ``shards`` equal shards along the output columns (or heads). Each such shard normalises its
    rows whole while its FLOPs count only its share of the norm (``ir.kernels.prenorm``), which
    is how a plan's column shards of a norm_matmul run: one-op points without the split ran like
    plain GEMMs, while the plans' shards ran ~0.5 log units slower."""
    def build() -> Any:
        from ir.builder import GraphBuilder
        from ir.rewrites import fuse_norm, split

        b = GraphBuilder(dtype)
        x = b.input("x", (1, rows, d))
        n = b.op("layernorm", "ln", {"x": x, "gamma": b.parameter("gamma", (d,)), "beta": b.parameter("beta", (d,))},
                 eps=1e-5)
        if heads:
            b.op("einsum", "k", {"a": n, "b": b.parameter("W", (d, heads, out // heads))}, equation="bsd,dhe->bhse")
        else:
            b.op("linear", "k", {"x": n, "W": b.parameter("W", (d, out)), "b": b.parameter("bias", (out,))})
        g = fuse_norm(b.build(), "ln")
        (name,) = g.topo_order
        return split(g, name, 1 if heads else 2, shards) if shards > 1 else g

    return build


def kernel_spread(backend: str = "numpy", quick: bool = False, dtypes: tuple[str, ...] = ("float32",)) -> list[Case]:
    """The calibration points (see the module docstring)."""
    gpu = backend == "cupy"
    cases: list[Case] = []

    def add(name: str, kernel: str, build: Callable[[], Any]) -> None:
        cases.append(Case(name, kernel, build))

    for dt in dtypes:
        tag = "" if dt == "float32" else f" {dt}"
        # matmul: square (compute-bound when large) and skinny (memory-bound)
        if quick:
            mm = [(32, 32, 32), (96, 96, 96), (192, 192, 192), (256, 32, 256)]
        elif gpu:
            mm = [(256, 256, 256), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
                  (8192, 64, 8192), (16384, 16, 4096)]
        else:
            mm = [(64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024),
                  (1024, 16, 1024), (2048, 8, 2048)]
        for m, k, n in mm:
            add(f"matmul {m}x{k}x{n}{tag}", "matmul", _one_op("matmul", dt, {"a": (m, k), "b": (k, n)},
                                                                 {"b": "parameter"}))
        lin = [(64, 128, 128)] if quick else ([(4096, 4096, 4096), (512, 1024, 4096), (1024, 1024, 1024),
                                                (256, 1024, 1024), (64, 1024, 4096)] if gpu else
                                               [(256, 512, 512), (64, 256, 1024)])
        for nb, f, o in lin:
            add(f"linear {nb}x{f}->{o}{tag}", "linear",
                _one_op("linear", dt, {"x": (nb, f), "W": (f, o), "b": (o,)}, {"W": "parameter", "b": "parameter"}))
        # the GEMM subclasses: attention (batch x heads, seq, head dim 64) and norm_matmul (narrow outputs
        # too: a plan's column shards each normalise their rows whole, so the norm weighs more)
        att = [(2, 16, 16), (4, 32, 16), (2, 64, 32)] if quick else (
            [(8, 2048, 128), (32, 1024, 128), (4, 4096, 128), (8, 512, 128), (4, 256, 64)] if gpu else
            [(4, 64, 64), (16, 128, 64), (8, 256, 64), (4, 512, 64), (4, 128, 64), (2, 128, 64)])
        for bh, sq, e in att:
            add(f"attention {bh}x{sq}x{e}{tag}", "attention",
                _one_op("attention", dt, {"q": (bh, sq, e), "k": (bh, sq, e), "v": (bh, sq, e)}, scale=e ** -0.5))
        # down to launch-bound sizes: a plan's norm_matmul shards are small, and points of one size
        # band left the fit free to trade the launch for the rate (on the 2-vCPU Xeon the
        # calibrated shards' median log(model/measured) swung from -1.07 to +0.39 between runs)
        nm = [(32, 64, 64, 0), (32, 64, 64, 2), (64, 128, 64, 0)] if quick else (
            [(8192, 4096, 4096, 0), (8192, 4096, 4096, 32), (2048, 1024, 4096, 0), (512, 1024, 1024, 0),
             (256, 1024, 256, 0)] if gpu else
            [(128, 256, 1024, 0), (512, 256, 256, 4), (256, 256, 1024, 0), (128, 1024, 256, 0), (512, 256, 1024, 0),
             (32, 256, 256, 0), (64, 256, 64, 0)])
        nm = [(*c, 1) for c in nm] + ([(64, 64, 64, 0, 2)] if quick else [(512, 1024, 1024, 0, 8)] if gpu else
                                      [(512, 256, 1024, 0, 4), (512, 256, 1024, 0, 8), (128, 256, 1024, 0, 4),
                                       (512, 256, 256, 4, 4), (256, 256, 256, 4, 2), (64, 256, 1024, 0, 8)])
        for r, d_in, o, h, k in nm:
            what = f"{' heads ' + str(h) if h else ''}{f' in {k} shards' if k > 1 else ''}"
            add(f"norm_matmul {r}x{d_in}->{o}{what}{tag}", "norm_matmul", _norm_matmul(dt, r, d_in, o, h, k))
        # matmul.einsum: a transformer's per-head projections in and out (b, s, d, heads, head dim)
        ein = [(1, 16, 32, 2, 16), (2, 16, 32, 2, 16), (2, 32, 64, 2, 16)] if quick else (
            [(8, 1024, 1024, 16, 64), (4, 512, 1024, 8, 128), (2, 256, 1024, 8, 64), (1, 64, 1024, 4, 64)] if gpu else
            [(4, 128, 256, 4, 64), (1, 128, 256, 4, 64), (2, 64, 256, 2, 64), (1, 32, 256, 1, 64)])
        for bb, sq, d, h, e in ein:
            add(f"einsum in {bb}x{sq}x{d}->{h}x{e}{tag}", "einsum",
                _one_op("einsum", dt, {"a": (bb, sq, d), "b": (d, h, e)}, {"b": "parameter"}, equation="bsd,dhe->bhse"))
            add(f"einsum out {bb}x{h}x{sq}x{e}->{d}{tag}", "einsum",
                _one_op("einsum", dt, {"a": (bb, h, sq, e), "b": (h, e, d)}, {"b": "parameter"},
                        equation="bhse,hed->bsd"))
        # elementwise: one size ladder for add, a shorter one for relu and gelu
        ladder = [1 << 12, 1 << 15, 1 << 17] if quick else (
            [1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26] if gpu else [1 << 12, 1 << 16, 1 << 19, 1 << 21, 1 << 22])
        for i, n in enumerate(ladder):
            shape = (n // 256, 256)
            add(f"add {shape[0]}x{shape[1]}{tag}", "add", _one_op("add", dt, {"a": shape, "b": shape}))
            if quick or i % 2 == 0:
                for kern in ("relu", "gelu"):
                    add(f"{kern} {shape[0]}x{shape[1]}{tag}", kern, _one_op(kern, dt, {"x": shape}))
        # row-wise
        rows = [(64, 64), (256, 256), (512, 512)] if quick else (
            [(1024, 1024), (8192, 1024), (16384, 4096), (65536, 1024)] if gpu else
            [(128, 128), (512, 512), (2048, 512), (1024, 2048)])
        for r, c in rows:
            add(f"softmax {r}x{c}{tag}", "softmax", _one_op("softmax", dt, {"x": (r, c)}))
            add(f"layernorm {r}x{c}{tag}", "layernorm",
                _one_op("layernorm", dt, {"x": (r, c), "gamma": (c,), "beta": (c,)},
                        {"gamma": "parameter", "beta": "parameter"}, eps=1e-5))
        # conv2d 3x3, padding 1
        conv = [(1, 4, 8, 8), (2, 8, 8, 16), (2, 16, 16, 16)] if quick else (
            [(8, 64, 64, 56), (16, 128, 128, 28), (32, 64, 128, 56), (8, 256, 256, 14)] if gpu else
            [(2, 8, 16, 16), (4, 16, 32, 16), (4, 32, 32, 32), (8, 32, 64, 16)])
        for nb, ci, co, hw in conv:
            add(f"conv2d n{nb} {ci}->{co} {hw}x{hw}{tag}", "conv2d",
                _one_op("conv2d", dt, {"x": (nb, ci, hw, hw), "w": (co, ci, 3, 3)}, {"w": "parameter"}, padding=1))
        # reductions over the last dim
        red = [(64, 64), (256, 256), (512, 512)] if quick else (
            [(1024, 1024), (8192, 4096), (32768, 4096)] if gpu else [(256, 256), (1024, 1024), (2048, 2048)])
        for r, c in red:
            add(f"reduce_sum {r}x{c}{tag}", "reduce_sum", _one_op("reduce_sum", dt, {"x": (r, c)}, dim=-1))
    return cases


def record_of(g: Any, seconds: float) -> dict[str, Any]:
    """``{kernel_class, flops, bytes, dtype, seconds}`` of one shard of a one-op graph timed as a
    whole (``seconds``: all its shards, one after another): with ``k`` equal shards, one shard's
    work and ``seconds / k`` (``shards``: ``k``)."""
    from ir.kernels import get_kernel

    (name,) = g.topo_order
    o = g.ops[name]
    sig = g.signature(o)
    sh = o.shards
    k = len(sh)
    flops = float(sig.flops(sh.lo, sh.hi).sum()) / k
    read, written = sig.io_bytes(sh.lo, sh.hi)
    return {"kernel_class": get_kernel(o.kernel).kernel_class, "flops": flops,
            "bytes": float((read + written).sum()) / k, "dtype": g.tensors[o.output].dtype,
            "seconds": float(seconds) / k, "kernel": o.kernel,
            "shape": list(g.tensors[o.output].shape), "shards": k}


def measure_spread(cases: list[Case], backend: str = "numpy", repeats: int = 3, warmup: int = 1,
                   progress: Callable[[str], None] | None = None, statistic: str = "median") -> list[dict[str, Any]]:
    """Time every case (median, or ``statistic``, of ``repeats``) and return one record per case."""
    from executor.measure import time_ops

    out = []
    for c in cases:
        g = c.build()
        (name,) = g.topo_order
        seconds = time_ops(g, backend, repeats=repeats, warmup=warmup, statistic=statistic)[name]
        rec = record_of(g, seconds)
        rec["case"] = c.name
        out.append(rec)
        if progress is not None:
            progress(c.name)
    return out


def model_seconds(records: list[dict[str, Any]], hw: Any) -> np.ndarray:
    return np.array([float(hw.shard_time(r["flops"], r["bytes"], r["dtype"], r["kernel_class"])) for r in records])


def errors(records: list[dict[str, Any]], hw: Any) -> dict[str, float]:
    """How far the model on ``hw`` is from the measured points: mean and median of
    ``|log(model / measured)|`` (a factor of 2 off either way is 0.69), and the RMS relative error."""
    m = np.array([r["seconds"] for r in records])
    p = model_seconds(records, hw)
    lg = np.abs(np.log(p / m))
    return {"mean_abs_log": float(lg.mean()), "median_abs_log": float(np.median(lg)),
            "rms_rel": float(np.sqrt(np.mean(((p - m) / m) ** 2))), "n": len(records)}


@dataclass
class CalibrationResult:
    hardware: Any            # the calibrated Hardware
    base: Any                # the Hardware it started from
    fits: dict[str, Any]     # kernel class -> costmodel.calibrate.ClassFit
    records: list[dict[str, Any]]
    before: dict[str, float]
    after: dict[str, float]

    def rows(self) -> list[dict[str, Any]]:
        """Per point: case, class, FLOPs, bytes, measured, model before and after."""
        pb, pa = model_seconds(self.records, self.base), model_seconds(self.records, self.hardware)
        return [{"case": r.get("case", r.get("kernel", "")), "kernel_class": r["kernel_class"], "flops": r["flops"],
                 "bytes": r["bytes"], "measured": r["seconds"], "model_before": float(b), "model_after": float(a)}
                for r, b, a in zip(self.records, pb, pa)]

    def factors(self) -> dict[str, dict[str, Any]]:
        out = {}
        for k, f in self.fits.items():
            out[k] = {"compute": f.compute_eff, "memory": f.memory_eff, "launch": f.launch, "n": f.n,
                      "compute_identified": f.compute_identified, "memory_identified": f.memory_identified,
                      "launch_identified": f.launch_identified,
                      "rms_rel_error": None if math.isnan(f.rms_rel_error) else f.rms_rel_error}
        return out


def calibrate_records(records: list[dict[str, Any]], hw: Any) -> CalibrationResult:
    from costmodel.calibrate import calibrate
    from costmodel.hardware_io import load_hardware

    base = load_hardware(hw)
    out = calibrate(records, base, report=True)
    cal, fits = out if isinstance(out, tuple) else (out, {})
    return CalibrationResult(cal, base, fits, records, errors(records, base), errors(records, cal))


def fit_dispatch(hw: Any, backend: str = "numpy", repeats: int = 3, quick: bool = False,
                 seed: int = 0) -> tuple[Any, float, int]:
    """Time a few plans of a small MLP (the unsharded program and random rewrites of it over 4
    devices, 3 to 40 shards) and fit the executor's time between shards
    (``optimizer.realrun.online._fit_dispatch``) on top of ``hw``. Returns ``(hardware with the
    dispatch added to its launch overheads, dispatch seconds per shard, plans timed)``."""
    from ir import workloads
    from ir.rewrites import random_walk
    from optimizer.realrun.measurement import measure_plan
    from optimizer.realrun.online import _fit_dispatch, plan_points

    base = workloads.build("mlp", batch=32 if quick else 64, widths=(64, 128, 64) if quick else (256, 1024, 256))
    rng = np.random.default_rng(seed)
    plans, seen = [base], {base.digest}
    for steps in (3, 6, 10, 14, 18, 24, 30, 36):
        g = random_walk(base, rng, 4, steps)
        if g.digest not in seen:
            seen.add(g.digest)
            plans.append(g)
    records = []
    for g in plans[: 4 if quick else len(plans)]:
        records += measure_plan(g, hw, backend, repeats=repeats)
    points = plan_points(records)
    cal, d = _fit_dispatch(points, hw, np.array([p["measured"] for p in points]))
    return cal, d, len(points)


def calibration_plans(workloads: dict[str, dict[str, Any]], plans_each: int = 3,
                      seed: int = 1000) -> list[tuple[str, Any]]:
    """``(workload name, Graph)`` of the plans ``calibrate_on_plans`` times: per workload
    (``ir.workloads.build(name, **params)``) the unsharded program and ``plans_each - 1`` random
    rewrites of it over 4 devices (``ir.rewrites.random_walk``, seeded with ``seed``: use a seed the
    plans under test do not use)."""
    from ir import workloads as W
    from ir.rewrites import random_walk

    out = []
    for j, (name, params) in enumerate(workloads.items()):
        base = W.build(name, **params)
        rng = np.random.default_rng([seed, j])
        plans, seen = [base], {base.digest}
        for _ in range(20 * plans_each):
            if len(plans) >= plans_each:
                break
            g = random_walk(base, rng, 4, int(rng.integers(3, 30)))
            if g.digest not in seen:
                seen.add(g.digest)
                plans.append(g)
        out += [(name, g) for g in plans]
    return out


def calibrate_shards(result: CalibrationResult, records: list[dict[str, Any]]) -> Any:
    """``result`` (a one-op spread calibration) refitted with the unfused shards of measured plans
    (``measure_plan`` records of several plans), from ``result.base``; as the executor runs plans
    (``executed_hardware``), without the executor's time between shards. This is the hardware to
    hand to ``optimizer.realrun.online.refit`` as its base, which adds that time itself."""
    from costmodel.calibrate import calibrate
    from optimizer.realrun.measurement import executed_hardware
    from optimizer.realrun.online import calibration_records, plan_points

    return executed_hardware(calibrate(list(result.records) + calibration_records(plan_points(records)), result.base))


def calibrate_with_plans(result: CalibrationResult, records: list[dict[str, Any]]) -> tuple[Any, float, int]:
    """:func:`calibrate_shards`, then the executor's time between shards on those plans
    (``optimizer.realrun.online._fit_dispatch``) added; see :func:`calibrate_on_plans`."""
    from optimizer.realrun.online import _fit_dispatch, plan_points

    points = plan_points(records)
    cal, d = _fit_dispatch(points, calibrate_shards(result, records), np.array([p["measured"] for p in points]))
    return cal, d, len(points)


def calibrate_on_plans(result: CalibrationResult, workloads: dict[str, dict[str, Any]], plans_each: int = 3,
                       backend: str = "numpy", repeats: int = 3, seed: int = 1000,
                       statistic: str = "median") -> tuple[Any, float, int]:
    """Refit ``result`` (a one-op spread calibration) with the shards of real plans, then fit the
    executor's time between shards on those plans (``optimizer.realrun.online._fit_dispatch``).

    The plans (:func:`calibration_plans`) run device-aware (``measure_plan``); their unfused
    shards join the spread's points and every class is fitted again from ``result.base``
    (:func:`calibrate_with_plans`). Why: one-op points are square GEMMs and fresh graphs, while
    plans run ``linear`` with bias, attention, layernorm-matmul and slices of them; on this VM the
    spread alone over-predicted the plans' ``linear`` shards by ~1.6x and their gelu by ~2x.
    Returns ``(calibrated hardware with the dispatch in its launch overheads, dispatch seconds per
    shard, plans timed)``."""
    from optimizer.realrun.measurement import executed_hardware, measure_plan

    records = []
    for _, g in calibration_plans(workloads, plans_each, seed):
        records += measure_plan(g, executed_hardware(result.hardware), backend, repeats=repeats,
                                statistic=statistic)
    return calibrate_with_plans(result, records)


def run_calibration(backend: str, hardware: Any, quick: bool = False, repeats: int = 3, warmup: int = 1,
                    statistic: str = "median",
                    dtypes: tuple[str, ...] | None = None,
                    progress: Callable[[str], None] | None = None) -> CalibrationResult:
    """Time the spread on ``backend`` and fit ``hardware``'s factors to it."""
    from executor.backend import get_backend

    get_backend(backend)  # fail early, with a clear message, when CuPy or a GPU is missing
    if dtypes is None:
        dtypes = ("float32",)
    records = measure_spread(kernel_spread(backend, quick, tuple(dtypes)), backend, repeats, warmup, progress,
                             statistic)
    return calibrate_records(records, hardware)
