"""Calibration: fit efficiency factors and launch overheads per kernel class from measured shards.

A measurement is a plain dict ``{"kernel_class", "flops", "bytes", "dtype", "seconds"}`` (extra
keys such as ``op``, ``shard``, ``device`` are ignored); ``measurements_for(g)`` gives the records
of a plan's shards without ``seconds``, for the executor to time. The model of one shard is the
cost model's roofline::

    seconds ≈ max(flops / (peak[dtype] · ce), bytes / (bw · me)) + launch

With ``x_f = flops / peak[dtype]`` and ``x_b = bytes / bw`` this is ``max(a·x_f, b·x_b) + launch``
with ``a = 1/ce``, ``b = 1/me``: linear in ``(a, b, launch)`` once it is known which term binds at
each point. The fit, per class, minimises *relative* residuals (shard times span orders of
magnitude):

1. starting points: the hardware's current factors, and a non-negative least-squares (NNLS) fit of
   the linear relaxation ``a·x_f + b·x_b + launch`` (a sum instead of a max: exact when one term
   dominates each point, a usable start otherwise);
2. from each start, alternate: assign every point to the term that binds under the current
   parameters, then solve the assigned model, which is linear, by NNLS (so ``a, b, launch >= 0``
   holds without clipping); stop when the assignment no longer changes. On noise-free data this
   recovers the generating factors exactly once the assignment is right;
3. polish the best with ``scipy.optimize.least_squares`` (robust ``soft_l1`` loss, so a few
   outlier timings do not drag the fit) on ``(log a, log b, launch)``, bounds ``launch >= 0``;
   keep it if its robust cost is lower.

Why not plain nonlinear least squares alone: the max makes the objective piecewise linear with
flat directions (a factor that never binds has zero gradient), so a local method from one start
can stall; the NNLS steps are exact and cheap, and the final least-squares pass only refines.

A factor is *identified* only if its term binds at ``min_binding`` points or more; otherwise the
hardware's current factor is kept (e.g. elementwise kernels are always memory-bound: their
compute efficiency cannot be measured). The launch overhead is identified only if the class's
points span at least ``min_spread`` times in work (their binding term, ``max(a·x_f, b·x_b)``);
otherwise it is kept and only the efficiencies are fitted. And a term moves from the hardware's
current value only if the fitted value differs from it by at least two standard errors (least
squares on the relative residuals, linearised at the binding assignment; an efficiency, a factor,
compared in logs): calibration starting
from an already calibrated hardware (a campaign's refit of offline-calibrated factors) changes
only what its data shows to be different. Shards that are all alike (a campaign
sampling plans of one small program: its GEMM shards of 0.27 and 0.54 GFLOP only) cannot tell
a fixed cost per shard from a rate, and a free fit traded one for the other at random (a launch
overhead of 4.9 ms and a compute efficiency 4x too high on one quickstart run). Classes with fewer
than ``min_points`` measurements keep all their defaults. Efficiencies are clipped to
``(0, 1.5]`` and launch overheads to ``>= 0``.

Subclasses (``matmul.attention``: ``costmodel.hardware.class_chain``) are fitted after the
classes above them, starting from their parent's fitted factors: a term the subclass's points
cannot identify keeps the parent's fitted value, and a subclass without enough points gets no
entry at all, so it keeps using its parent's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from costmodel.hardware import Hardware, HardwareError
from costmodel.hardware_io import load_hardware
from ir.graph import Graph

__all__ = ["CalibrationError", "ClassFit", "calibrate", "fit_classes", "measurements_for"]

MAX_EFFICIENCY = 1.5
REQUIRED = ("kernel_class", "flops", "bytes", "dtype", "seconds")


class CalibrationError(ValueError):
    """Malformed measurements (missing or non-numeric fields, non-positive times)."""


@dataclass
class ClassFit:
    """Result for one kernel class."""

    kernel_class: str
    n: int
    compute_eff: float
    memory_eff: float
    launch: float
    compute_identified: bool
    memory_identified: bool
    rms_rel_error: float  # of the fitted model over this class's points
    method: str = ""
    notes: list[str] = field(default_factory=list)
    launch_identified: bool = False

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def measurements_for(g: Graph, hw: Hardware | str | None = None) -> list[dict[str, Any]]:
    """One record per shard of ``g``: ``op``, ``shard``, ``device``, ``kernel_class``,
    ``flops``, ``bytes`` (read + written), ``dtype``; with ``hw``, also ``model_seconds``."""
    from costmodel.lowering import compute_dtype, kernel_class_of

    hw = load_hardware(hw) if hw is not None else None
    out = []
    for name in g.topo_order:
        o = g.ops[name]
        sig = g.signature(o)
        sh = o.shards
        flops = sig.flops(sh.lo, sh.hi)
        read, written = sig.io_bytes(sh.lo, sh.hi)
        nbytes = read + written
        kclass = kernel_class_of(o)
        dtype = compute_dtype(g, o)
        model = hw.shard_time(flops, nbytes, dtype, kclass) if hw is not None else None
        for i in range(len(sh)):
            rec = {"op": name, "shard": i, "device": int(sh.device[i]), "kernel_class": kclass,
                   "flops": float(flops[i]), "bytes": float(nbytes[i]), "dtype": dtype}
            if model is not None:
                rec["model_seconds"] = float(model[i])
            out.append(rec)
    return out


def _check(measurements: Iterable[Mapping[str, Any]], hw: Hardware) -> dict[str, tuple[np.ndarray, ...]]:
    by_class: dict[str, list[tuple[float, float, float]]] = {}
    for i, m in enumerate(measurements):
        if not isinstance(m, Mapping):
            raise CalibrationError(f"measurement {i} is a {type(m).__name__}, expected a dict with {list(REQUIRED)}")
        missing = [k for k in REQUIRED if k not in m]
        if missing:
            raise CalibrationError(f"measurement {i} lacks {missing}; each needs {list(REQUIRED)}")
        try:
            f, b, s = float(m["flops"]), float(m["bytes"]), float(m["seconds"])
        except (TypeError, ValueError):
            raise CalibrationError(f"measurement {i}: flops, bytes and seconds must be numbers") from None
        if not (math.isfinite(f) and math.isfinite(b) and math.isfinite(s)) or f < 0 or b < 0 or s <= 0:
            raise CalibrationError(f"measurement {i}: needs flops >= 0, bytes >= 0 and seconds > 0, "
                                   f"got {f}, {b}, {s}")
        try:
            peak = hw.peak_flops(str(m["dtype"]))
        except HardwareError as e:
            raise CalibrationError(f"measurement {i}: {e}") from None
        by_class.setdefault(str(m["kernel_class"]), []).append((f / peak, b / hw.device.mem_bandwidth, s))
    return {k: tuple(np.array(c) for c in zip(*v)) for k, v in by_class.items()}


def _model(p: np.ndarray, xf: np.ndarray, xb: np.ndarray) -> np.ndarray:
    return np.maximum(p[0] * xf, p[1] * xb) + p[2]


Fixed = tuple[float | None, float | None, float | None]  # pinned (a, b, launch); None: free


def _nnls_assigned(xf, xb, y, comp: np.ndarray, fixed: Fixed) -> np.ndarray:
    """NNLS of ``y ≈ a·xf·[comp] + b·xb·[~comp] + L`` in relative terms; ``fixed`` pins a, b or L."""
    from scipy.optimize import nnls

    w = 1.0 / y
    cols, names = [], []
    rhs = np.ones_like(y)  # y / y
    for j, x in enumerate((xf * comp, xb * ~comp, np.ones_like(y))):
        if fixed[j] is not None:
            rhs = rhs - fixed[j] * x * w
        else:
            cols.append(x * w)
            names.append(j)
    p = np.array([fixed[0] or 0.0, fixed[1] or 0.0, fixed[2] or 0.0])
    if cols:
        sol, _ = nnls(np.stack(cols, axis=1), rhs)
        for k, j in enumerate(names):
            p[j] = sol[k]
    return p


def _alternate(p0: np.ndarray, xf, xb, y, fixed, iters: int = 50) -> np.ndarray:
    p = p0.copy()
    comp = p[0] * xf >= p[1] * xb
    for _ in range(iters):
        p = _nnls_assigned(xf, xb, y, comp, fixed)
        # an unconstrained factor that no point uses stays where the start put it
        if fixed[0] is None and not comp.any():
            p[0] = p0[0]
        if fixed[1] is None and comp.all():
            p[1] = p0[1]
        new = p[0] * xf >= p[1] * xb
        if np.array_equal(new, comp):
            break
        comp = new
    return p


def _robust_cost(p, xf, xb, y, scale: float) -> float:
    r = (_model(p, xf, xb) - y) / y / scale
    return float(np.sum(2.0 * (np.sqrt(1.0 + r * r) - 1.0)))


def _fit_one(kclass: str, xf, xb, y, hw: Hardware, min_points: int, min_binding: int,
             scale: float, min_spread: float = 4.0) -> ClassFit:
    ce0, me0 = hw.efficiency_for(kclass)
    L0 = float(hw.launch_overhead_for(kclass))
    n = len(y)
    if n < min_points:
        return ClassFit(kclass, n, ce0, me0, L0, False, False, float("nan"), "defaults",
                        [f"{n} point(s), fewer than {min_points}: defaults kept"])
    default = np.array([1.0 / ce0, 1.0 / me0, L0])
    fixed: Fixed = (None, None, None)
    notes: list[str] = []
    for _round in range(6):  # refit with unidentified terms pinned to their defaults
        from scipy.optimize import nnls

        relax, _ = nnls(np.stack([xf / y, xb / y, 1.0 / y], axis=1), np.ones(n))  # a·x_f + b·x_b + L
        starts = [default.copy(), np.where(relax > 0, relax, default)]
        cands = []
        for s in starts:
            s = s.copy()
            for j in (0, 1, 2):
                if fixed[j] is not None:
                    s[j] = fixed[j]
            p = _alternate(s, xf, xb, y, fixed)
            cands.append((_robust_cost(p, xf, xb, y, scale), "nnls", p))
        cost, method, best = min(cands, key=lambda c: c[0])
        polished = _polish(best, xf, xb, y, fixed, scale)
        if polished is not None:
            c2 = _robust_cost(polished, xf, xb, y, scale)
            if c2 < cost:
                cost, method, best = c2, "nnls+least_squares", polished
        comp = best[0] * xf >= best[1] * xb
        work = np.maximum(best[0] * xf, best[1] * xb)
        spread = float(work.max() / work.min()) if work.min() > 0 else float("inf")
        ident = [fixed[0] is not None or int(comp.sum()) >= min_binding,
                 fixed[1] is not None or int((~comp).sum()) >= min_binding, True]
        se = np.zeros(3)
        near = [False, False, False]  # a free term within two standard errors of its default
        if ident[0] and ident[1]:
            # which terms bind is settled: does the data tell each free term from its default?
            se = _standard_errors(best, xf, xb, y, comp, fixed)
            # an efficiency is a factor: compare logs (se of log a = se of a / a); a launch overhead
            # may be 0: compare seconds
            near = [fixed[j] is None and (abs(math.log(best[j] / default[j])) < 2.0 * se[j] / best[j] if best[j] > 0
                                          else True) for j in (0, 1)]
            near.append(fixed[2] is None and abs(best[2] - default[2]) < 2.0 * se[2])
            ident = [ident[0] and not near[0], ident[1] and not near[1],
                     fixed[2] is not None or (spread >= min_spread and not near[2])]
        new_fixed = tuple(default[j] if not ident[j] else fixed[j] for j in range(3))
        if new_fixed == fixed:
            break
        for j, what in ((0, "compute"), (1, "memory")):
            if new_fixed[j] is not None and fixed[j] is None:
                notes.append(f"the fitted {what} efficiency {1.0 / best[j]:.3g} is within 2 standard errors of the "
                             f"default {1.0 / default[j]:.3g}: default kept" if near[j] else
                             f"{what} term binds at fewer than {min_binding} points: default {what} efficiency kept")
        if new_fixed[2] is not None and fixed[2] is None:
            notes.append(f"the points span {spread:.3g}x in work, less than {min_spread:g}x: too alike to tell a "
                         f"launch overhead from a rate, default launch overhead kept" if spread < min_spread else
                         f"the fitted launch overhead {best[2]:.3g} s is within 2 standard errors ({se[2]:.2g} s) of "
                         f"the default {L0:.3g} s: default launch overhead kept")
        fixed = new_fixed  # type: ignore[assignment]
    a, b, L = best
    ce = min(MAX_EFFICIENCY, 1.0 / a) if a > 0 else MAX_EFFICIENCY
    me = min(MAX_EFFICIENCY, 1.0 / b) if b > 0 else MAX_EFFICIENCY
    final = np.array([1.0 / ce, 1.0 / me, max(L, 0.0)])
    rms = float(np.sqrt(np.mean(((_model(final, xf, xb) - y) / y) ** 2)))
    return ClassFit(kclass, n, float(ce), float(me), float(max(L, 0.0)), fixed[0] is None, fixed[1] is None, rms,
                    method, notes, launch_identified=fixed[2] is None)


def _standard_errors(p: np.ndarray, xf, xb, y, comp: np.ndarray, fixed: Fixed) -> np.ndarray:
    """Standard errors of the free terms ``(a, b, launch)`` of fit ``p`` (0 for a pinned term):
    least squares on relative residuals, linearised at the binding assignment ``comp``; ``inf``
    without a spare degree of freedom."""
    free = [j for j in range(3) if fixed[j] is None]
    out = np.zeros(3)
    if not free:
        return out
    cols = {0: xf * comp / y, 1: xb * ~comp / y, 2: 1.0 / y}
    J = np.stack([cols[j] for j in free], axis=1)
    dof = len(y) - J.shape[1]
    if dof <= 0:
        out[free] = np.inf
        return out
    r = (_model(p, xf, xb) - y) / y
    cov = float(r @ r) / dof * np.linalg.pinv(J.T @ J)
    out[free] = np.sqrt(np.maximum(np.diag(cov), 0.0))
    return out


def _polish(p0, xf, xb, y, fixed, scale):
    try:
        from scipy.optimize import least_squares
    except ImportError:  # pragma: no cover - scipy is a dependency
        return None
    free = [j for j in (0, 1) if fixed[j] is None]
    free_launch = fixed[2] is None
    if not free and not free_launch:
        return None

    def unpack(theta):
        p = np.array([fixed[0] or 0.0, fixed[1] or 0.0, theta[-1] if free_launch else fixed[2]])
        for k, j in enumerate(free):
            p[j] = math.exp(theta[k])
        return p

    # theta = log(1/efficiency), kept to efficiencies in [1e-12, MAX_EFFICIENCY]: unbounded
    # trust-region steps on launch-bound points overflowed exp()
    t_lo, t_hi = math.log(1.0 / MAX_EFFICIENCY), math.log(1e12)
    x0 = [min(max(math.log(max(p0[j], 1e-300)), t_lo), t_hi) for j in free] + ([max(p0[2], 0.0)] if free_launch else [])
    lo = [t_lo] * len(free) + ([0.0] if free_launch else [])
    hi = [t_hi] * len(free) + ([np.inf] if free_launch else [])
    try:
        r = least_squares(lambda th: (_model(unpack(th), xf, xb) - y) / y, x0, bounds=(lo, hi),
                          loss="soft_l1", f_scale=scale, method="trf", x_scale="jac")
    except (ValueError, FloatingPointError, OverflowError):
        return None
    return unpack(r.x) if r.success else None


def fit_classes(measurements: Iterable[Mapping[str, Any]], hw: Hardware | str, min_points: int = 3,
                min_binding: int = 2, scale: float = 0.1, min_spread: float = 4.0) -> dict[str, ClassFit]:
    """Per-class fits (see the module docstring); ``scale`` is the relative error beyond which
    a residual counts as an outlier (soft-L1 loss). Top-level classes start from ``hw``'s
    factors; a subclass from ``hw`` with the classes above it fitted."""
    hw = load_hardware(hw)
    data = _check(measurements, hw)
    fits: dict[str, ClassFit] = {}
    fitted = hw  # hw with the fits so far, the defaults of subclasses
    for k in sorted(data, key=lambda c: (c.count("."), c)):
        xf, xb, y = data[k]
        f = fits[k] = _fit_one(k, xf, xb, y, fitted if "." in k else hw, min_points, min_binding, scale, min_spread)
        if f.method != "defaults":
            fitted = fitted.with_efficiency({k: (f.compute_eff, f.memory_eff)}, launch_overhead_by_class={k: f.launch})
    return dict(sorted(fits.items()))


def calibrate(measurements: Iterable[Mapping[str, Any]], hw: Hardware | str, min_points: int = 3,
              min_binding: int = 2, scale: float = 0.1, report: bool = False, min_spread: float = 4.0):
    """``hw`` with efficiency factors and launch overheads fitted per kernel class.

    Returns the calibrated ``Hardware`` (``hw.with_efficiency(...)``), or ``(hardware, fits)``
    with ``report=True``. Save it with ``costmodel.hardware_io.save_hardware(cal, path, base=preset)``.
    """
    hw = load_hardware(hw)
    fits = fit_classes(measurements, hw, min_points, min_binding, scale, min_spread)
    eff, launch = {}, {}
    for k, f in fits.items():
        if f.method == "defaults":
            continue
        eff[k] = (f.compute_eff, f.memory_eff)
        launch[k] = f.launch
    cal = hw.with_efficiency(eff, launch_overhead_by_class=launch) if eff else hw
    return (cal, fits) if report else cal
