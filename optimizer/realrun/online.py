"""Calibration inside a campaign: refit the sampling hardware from the campaign's own executions.

Every ``sampling.calibrate_every`` sampled plans, :func:`refit` takes all shard measurements the
campaign has stored (``optimizer.realrun.measurement``: each shard's kernel class, dtype, FLOPs,
bytes and measured seconds) and fits the efficiency factors and launch overheads per kernel class
(``costmodel.calibrate.calibrate``) of the *sampling* hardware, always starting from its
uncalibrated form (so a fit never compounds an earlier one). A term the samples cannot identify
keeps the uncalibrated hardware's value (``calibrate``: a factor whose term binds at fewer than
two shards; a launch overhead when the class's shards span less than 4x in work, as a small
campaign's shards often do: they are too alike to separate a fixed cost per shard from a rate);
the report's factors say which (``*_identified``), and ``summary.md`` says it in one sentence
(``optimizer.campaign.fidelity.kept_sentence``). It then predicts every sampled plan
again the way its stored prediction was made, the serial time (``costmodel.evaluate.
serial_prediction``: every shard one after another on one device, which is how one machine runs
it) = the sum of the shards' roofline times, plus a per-shard dispatch overhead (:func:`_fit_dispatch`: what the executor spends between
shards, measured where the plans record it, else fitted on the plan times), and reports, before (the
uncalibrated hardware) and after (the refit):

- ``spearman``: the Spearman rank correlation of predicted vs measured plan times (1: the model
  orders the sampled plans exactly as the real runs do; 0: no relation);
- ``mean_abs_log``: the mean of ``|log(predicted / measured)|`` (0.2 ≈ predictions within ~22 %).

The "after" figures are in-sample (fitted on the same executions); ``held_out`` gives the
figures of the plans measured since the previous refit, predicted with that previous refit
(out of sample), once there is one.

When the samples ran on the campaign's own device kind (``same_kind``), the refit factors also
apply to the campaign's hardware (:func:`target_hardware`), and :func:`rescore` evaluates front
plans on it.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import numpy as np

__all__ = ["plan_points", "predict_plans", "rank_stats", "refit", "rescore", "same_kind", "target_hardware"]


def _shards_by_plan(measurements: Iterable[Mapping[str, Any]]) -> dict[str, dict[tuple[str, int], dict]]:
    """Shard records that carry their work (kernel class, dtype, FLOPs, bytes), per plan digest;
    a plan measured twice keeps the first record of each shard."""
    out: dict[str, dict[tuple[str, int], dict]] = {}
    for m in measurements:
        d = m.get("details") or {}
        if m.get("kind") != "shard" or "kernel_class" not in d or d.get("bytes") is None:
            continue
        out.setdefault(m["plan_digest"], {}).setdefault((str(m.get("op")), int(m.get("shard") or 0)), m)
    return out


def plan_points(measurements: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One point per sampled plan with shard work: ``digest``, ``measured`` (the plan's measured
    seconds; the median when it was measured more than once), ``predicted`` (as stored), and
    ``shards`` (its shard records), oldest first."""
    ms = list(measurements)
    shards = _shards_by_plan(ms)
    pts: dict[str, dict[str, Any]] = {}
    for m in ms:
        if m.get("kind") != "plan" or m["plan_digest"] not in shards:
            continue
        p = pts.setdefault(m["plan_digest"], {"digest": m["plan_digest"], "times": [], "gaps": [],
                                              "predicted": m.get("predicted_seconds"),
                                              "shards": list(shards[m["plan_digest"]].values())})
        p["times"].append(float(m["measured_seconds"]))
        gap = (m.get("details") or {}).get("gap_seconds")
        if gap is not None:
            p["gaps"].append(float(gap))
    for p in pts.values():
        p["measured"] = float(np.median(p.pop("times")))
        gaps = p.pop("gaps")
        if gaps:
            p["gap"] = max(float(np.median(gaps)), 0.0)
    return list(pts.values())


def calibration_records(points: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The shard records of ``points`` in ``costmodel.calibrate``'s form; fused shards (whose
    time is the sum of stages of several kernel classes) are left out of the per-class fit."""
    recs = []
    for p in points:
        for m in p["shards"]:
            d = m["details"]
            if d.get("stages"):
                continue
            recs.append({"kernel_class": d["kernel_class"], "dtype": d["dtype"], "flops": float(d["flops"]),
                         "bytes": float(d["bytes"]), "seconds": float(m["measured_seconds"])})
    return recs


def predict_plans(points: Iterable[Mapping[str, Any]], hw: Any) -> np.ndarray:
    """Serial prediction of each plan on ``hw``: the sum of its shards' roofline times (what
    ``serial_prediction`` computes from the plan, here from the stored shard work); a fused
    shard is the sum of its stages (``details["stages"]``), as the executor runs it."""
    out = []
    for p in points:
        t = 0.0
        for m in p["shards"]:
            d = m["details"]
            for kclass, flops, nbytes in d.get("stages") or [(d["kernel_class"], d["flops"], d["bytes"])]:
                t += float(hw.shard_time(float(flops), float(nbytes), d["dtype"], kclass))
        out.append(t)
    return np.array(out, dtype=np.float64)


def rank_stats(predicted: Iterable[float], measured: Iterable[float]) -> dict[str, Any]:
    """``n``, ``spearman`` (None below 3 points or when one side is constant) and
    ``mean_abs_log`` (None without points) of predicted vs measured times."""
    p = np.asarray(list(predicted), dtype=np.float64)
    m = np.asarray(list(measured), dtype=np.float64)
    ok = (p > 0) & (m > 0) & np.isfinite(p) & np.isfinite(m)
    p, m = p[ok], m[ok]
    rho = None
    if len(p) >= 3 and np.ptp(p) > 0 and np.ptp(m) > 0:
        from scipy.stats import spearmanr

        r = float(spearmanr(p, m)[0])
        rho = None if math.isnan(r) else r
    return {"n": int(len(p)), "spearman": rho,
            "mean_abs_log": float(np.mean(np.abs(np.log(p / m)))) if len(p) else None}


def refit(measurements: Iterable[Mapping[str, Any]], base: Any, previous: Any = None,
          previous_digests: Iterable[str] = ()) -> dict[str, Any] | None:
    """Refit ``base`` (the uncalibrated sampling Hardware) to the campaign's shard measurements.

    Returns None without sampled plans, else ``{"hardware": calibrated Hardware, "plans": n,
    "shards": n, "factors": {class: {compute, memory, launch, n, ...}}, "before": rank_stats,
    "after": rank_stats, "held_out": rank_stats or None, "points": [{digest, measured,
    before, after}]}``. ``previous``: the hardware of the last refit (for ``held_out``, over the
    plans not in ``previous_digests``)."""
    from costmodel.calibrate import calibrate

    points = plan_points(measurements)
    if not points:
        return None
    recs = calibration_records(points)
    cal, fits = calibrate(recs, base, report=True)
    cal = cal.replace(staged_fusion=True)  # the executor's hardware (measurement.executed_hardware)
    measured = np.array([p["measured"] for p in points])
    cal, dispatch = _fit_dispatch(points, cal, measured)
    before = predict_plans(points, base)
    after = predict_plans(points, cal)
    seen = set(previous_digests)
    held = None
    if previous is not None:
        new = [p for p in points if p["digest"] not in seen]
        if new:
            held = rank_stats(predict_plans(new, previous), [p["measured"] for p in new])
    factors = {k: {"compute": f.compute_eff, "memory": f.memory_eff, "launch": f.launch, "n": f.n,
                   "compute_identified": f.compute_identified, "memory_identified": f.memory_identified,
                   "launch_identified": f.launch_identified,
                   "fitted": f.method != "defaults"} for k, f in fits.items()}
    return {"hardware": cal, "plans": len(points), "shards": len(recs), "factors": factors, "dispatch": dispatch,
            "before": rank_stats(before, measured), "after": rank_stats(after, measured), "held_out": held,
            "points": [{"digest": p["digest"], "measured": float(m), "before": float(b), "after": float(a)}
                       for p, m, b, a in zip(points, measured, before, after)]}


def _fit_dispatch(points: list[dict[str, Any]], cal: Any, measured: np.ndarray) -> tuple[Any, float]:
    """The executor's time per shard *between* shards (buffer set-up, slicing, Python dispatch):
    a plan's measured time exceeds the sum of its shards' own timings by roughly a constant per
    shard, which the shard fit cannot see. ``D`` minimises the relative error of
    ``Σ shard model + D · shards`` over the plans (least squares through the origin, ``D >= 0``)
    and is added to every kernel class's launch overhead. When every plan carries its measured gap
    (``details["gap_seconds"]``, ``optimizer.realrun.measurement``), ``D`` is that time per shard
    instead of a fit. Returns the hardware and ``D``."""
    import dataclasses

    n = np.array([len(p["shards"]) for p in points], dtype=np.float64)
    if points and all("gap" in p for p in points):
        # measured directly (DeviceRunResult.gap_seconds): a fit would also soak up the shard
        # fit's misses (on this VM it fitted 260 us per shard where the executor spends ~10-30)
        d = float(sum(p["gap"] for p in points) / max(float(n.sum()), 1.0))
    else:
        pred = predict_plans(points, cal)
        x, r = n / measured, 1.0 - pred / measured
        den = float(np.sum(x * x))
        d = max(float(np.sum(x * r)) / den, 0.0) if den > 0 else 0.0
    if d <= 0.0:
        return cal, 0.0
    classes = set(cal.efficiency) | set(cal.launch_overhead_by_class)
    classes |= {m["details"]["kernel_class"] for p in points for m in p["shards"]}
    launch = {k: cal.launch_overhead_for(k) + d for k in classes}
    dev = dataclasses.replace(cal.device, launch_overhead=cal.device.launch_overhead + d)
    return cal.replace(device=dev).with_efficiency(launch_overhead_by_class=launch), d


def same_kind(sampling_hw: Any, target_hw: Any) -> bool:
    """Whether the samples ran on the campaign's own device kind (same device name)."""
    return sampling_hw.device.name == target_hw.device.name


def target_hardware(target: Any, calibrated: Any) -> Any:
    """``target`` with the efficiency factors and launch overheads of ``calibrated`` (a refit of
    the same device kind)."""
    return target.with_efficiency(dict(calibrated.efficiency),
                                  launch_overhead_by_class=dict(calibrated.launch_overhead_by_class))


def rescore(graphs: Mapping[str, Any], hw: Any) -> dict[str, dict[str, float]]:
    """Objectives of plans (digest -> Graph) evaluated on ``hw``: ``makespan``, ``mfu``,
    ``feasible``; a plan that fails to evaluate is left out."""
    from costmodel.evaluate import Evaluator

    ev = Evaluator(hw)
    out = {}
    for digest, g in graphs.items():
        try:
            e = ev(g)
        except Exception:  # noqa: BLE001  (a courtesy figure; the stored objectives stand)
            continue
        out[digest] = {"makespan": float(e.makespan), "mfu": float(e.mfu), "feasible": bool(e.feasible)}
    return out
