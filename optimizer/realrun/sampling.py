"""Sampled real executions during a campaign, and how well the model ranks them.

A fraction ``sampling.rate`` of plans entering the front (at most ``max_per_minute``) is sent to
a Dask task that runs the plan device-aware on the sampling backend, verifies it against the
unsharded program and times its shards, transfers and the whole plan (records as in
``optimizer.realrun.measurement``; the rank correlation uses the plan records). CuPy tasks ask for
``resources={"GPU": 1}`` (workers started with ``--resources GPU=1``); NumPy tasks run anywhere,
so sampling works without GPUs through the same path.

The prediction a measurement is compared with is the model's time for the plan *as the
executor runs it*: its shards one after another on one device of the sampling hardware
(``sampling.hardware``; default ``cpu`` for NumPy, the campaign's device for CuPy).

Every ``sampling.calibrate_every`` sampled plans (and once more when the campaign stops, if new
ones came), :meth:`Sampler.calibrate` refits that hardware from the shard timings of the
campaign's last ``Sampler.WINDOW`` sampled plans (kept in memory; read once on resume)
and stores it in the archive with the rank correlation before and after
(``optimizer.realrun.online``). The stored ``predicted_seconds`` stay those of the uncalibrated
hardware; the calibrated predictions are in the calibration's report.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("tapestry.sampling")


@dataclass(frozen=True)
class MeasureTaskSpec:
    """One sampled execution: the plan (its archive digest and JSON), the backend, timed runs per
    shard, and the hardware the predictions use (all set from the campaign's ``sampling``)."""

    digest: str
    graph_json: str
    backend: str
    repeats: int
    hardware: dict[str, Any]


def measure_task(spec: MeasureTaskSpec) -> list[dict]:
    """Run one plan device-aware on this worker (``optimizer.realrun.measurement.measure_plan``: one
    buffer set per plan device, only the lowering's transfer boxes moved), check it against the
    unsharded program and time it; plain records out: one per shard, per transfer and one for the plan."""
    from costmodel.hardware import Hardware
    from optimizer.realrun.measurement import measure_plan
    from optimizer.search.worker import plan_from_archive, worker_name

    g = plan_from_archive(spec.graph_json, spec.digest)
    # min of the repeats per shard: the farm's own search shares the machine (docs/benchmarks.md,
    # "Model fidelity on this CPU": test-retest mean |log| 0.19 with minima, 0.33 with medians)
    records = measure_plan(g, Hardware.from_dict(spec.hardware), spec.backend, repeats=spec.repeats,
                           statistic="min")
    worker = worker_name()
    for r in records:
        r["plan_digest"] = spec.digest  # the archive's key for the candidate
        if r["kind"] == "plan":
            r["details"]["worker"] = worker
    return records


class Sampler:
    """Sends sampled plans to the workers, stores their measurements, and every
    ``calibrate_every`` new sampled plans refits the sampling hardware (``optimizer.realrun.online``)
    and stores the calibrated hardware in the archive (``Archive.add_calibration``); with
    ``target_hw`` of the same device kind, also the campaign's hardware with the refit factors
    and the front re-scored on it."""

    def __init__(self, campaign: str, rate: float, backend: str, max_per_minute: float, repeats: int,
                 hw_dict: dict, archive: Any, client: Any, seed: int, calibrate_every: int = 0,
                 target_hw: Any = None) -> None:
        self.campaign, self.rate, self.backend = campaign, rate, backend
        self.max_per_minute, self.repeats = max_per_minute, repeats
        self.hw_dict, self.archive, self.client = hw_dict, archive, client
        self.rng = np.random.default_rng([seed, 5])
        self.sent: list[float] = []
        self.futures: dict[Any, str] = {}
        self.calibrate_every, self.target_hw = calibrate_every, target_hw
        self.new_plans = 0  # sampled plans stored since the last refit
        self.last_cal: Any = None  # Hardware of the last refit (for held-out figures)
        self.last_digests: set[str] = set()
        # the refit's data: the records of the last WINDOW sampled plans, kept here so that a long
        # campaign's driver never re-reads its whole measurement table
        self.window: deque[list[dict]] = deque(maxlen=self.WINDOW)
        if calibrate_every > 0:
            self._resume_calibration()

    #: sampled plans a refit uses, the most recent first (older ones age out: the machine may drift)
    WINDOW = 200

    def _resume_calibration(self) -> None:
        """After ``tapestry resume``: the last refit of this campaign, and the plans sampled since."""
        from costmodel.hardware import Hardware

        try:
            cals = self.archive.calibrations(self.campaign, "sampling")
            stored = self.archive.measurements(self.campaign)
        except Exception:  # noqa: BLE001  (an archive without the campaign yet: nothing to resume)
            return
        by_plan: dict[str, list[dict]] = {}
        for m in stored:
            by_plan.setdefault(m["plan_digest"], []).append(m)
        self.window.extend(by_plan.values())  # insertion order: oldest first
        if not cals:
            self.new_plans = len(by_plan)
            return
        last = cals[-1]
        self.last_cal = Hardware.from_dict(last["hardware"])
        self.last_digests = {p["digest"] for p in last["report"].get("points", [])}
        self.new_plans = len(set(by_plan) - self.last_digests)

    def calibrate(self, farm: Any = None) -> dict[str, Any] | None:
        """Refit now (see the class docstring); returns the stored report, or None."""
        from costmodel.hardware import Hardware
        from ir.serialize import loads
        from optimizer.realrun.online import refit, rescore, same_kind, target_hardware

        base = Hardware.from_dict(self.hw_dict)
        res = refit([m for recs in self.window for m in recs], base, self.last_cal, self.last_digests)
        if res is None:
            return None
        cal = res.pop("hardware")
        report = {**res, "sampling_hardware": base.name, "backend": self.backend}
        self.archive.add_calibration(self.campaign, "sampling", res["plans"], cal.to_dict(), report)
        if self.target_hw is not None and same_kind(base, self.target_hw):
            tgt = target_hardware(self.target_hw, cal)
            graphs = {}
            for m in (farm.front_members() if farm is not None else []):
                if m.get("graph_json"):
                    graphs[m["digest"]] = loads(m["graph_json"], f"front plan {m['digest'][:12]}")
            old, new = rescore(graphs, self.target_hw), rescore(graphs, tgt)
            front = [{"digest": d, "makespan": old[d]["makespan"], "calibrated_makespan": new[d]["makespan"],
                      "mfu": old[d]["mfu"], "calibrated_mfu": new[d]["mfu"]} for d in graphs if d in old and d in new]
            self.archive.add_calibration(self.campaign, "target", res["plans"], tgt.to_dict(),
                                         {"factors": res["factors"], "front": front})
        self.last_cal, self.last_digests = cal, {p["digest"] for p in res["points"]}
        self.new_plans = 0
        b, a = res["before"], res["after"]
        log.info("refit %s on %d sampled plans: Spearman %s -> %s, mean |log(pred/measured)| %s -> %s",
                 base.name, res["plans"], b["spearman"], a["spearman"], b["mean_abs_log"], a["mean_abs_log"])
        return report

    def _maybe_calibrate(self, farm: Any, final: bool = False) -> None:
        due = self.new_plans >= self.calibrate_every or (final and self.new_plans > 0)
        if self.calibrate_every <= 0 or not due:
            return
        try:
            self.calibrate(farm)
        except Exception as e:  # noqa: BLE001  (calibration is a report; the search goes on without it)
            log.warning("refitting the sampling hardware failed: %s: %s", type(e).__name__, e)
            self.new_plans = 0

    def offer(self, records: list[dict]) -> None:
        now = time.monotonic()
        self.sent = [t for t in self.sent if now - t < 60]
        for r in records:
            if len(self.sent) >= self.max_per_minute or self.rng.random() >= self.rate:
                continue
            spec = MeasureTaskSpec(r["digest"], r["graph_json"], self.backend, self.repeats, self.hw_dict)
            kw = {"resources": {"GPU": 1}} if self.backend == "cupy" else {}
            self.futures[self.client.submit(measure_task, spec, pure=False, **kw)] = r["digest"]
            self.sent.append(now)

    def _store(self, done: list) -> None:
        rows = []
        for fut in done:
            digest = self.futures.pop(fut)
            try:
                records = fut.result()
            except Exception as e:  # noqa: BLE001
                log.warning("sampled execution of %s failed: %s: %s", digest[:12], type(e).__name__, e)
                continue
            finally:
                fut.release()
            rows.extend({**m, "campaign": self.campaign} for m in records)
            self.new_plans += sum(1 for m in records if m.get("kind") == "plan")
            if self.calibrate_every > 0:
                self.window.append(records)
        if rows:
            self.archive.add_measurements(rows)

    def poll(self, farm: Any) -> None:
        self._store([f for f in self.futures if f.done()])
        self._maybe_calibrate(farm)

    def drain(self, farm: Any, timeout: float = 120.0) -> None:
        from distributed import wait

        if self.futures:
            try:
                wait(list(self.futures), timeout=timeout)
            except TimeoutError:
                log.warning("sampled executions still running after %.0f s were dropped", timeout)
            self._store([f for f in self.futures if f.done()])
            for f in self.futures:
                f.cancel()
            self.futures.clear()
        self._maybe_calibrate(farm, final=True)


def make_sampler(cfg: Any, archive: Any, client: Any, hw: Any, base: Any) -> Sampler | None:
    s = cfg.sampling
    if s.rate <= 0:
        return None
    from costmodel.hardware_io import load_hardware
    from optimizer.realrun.measurement import executed_hardware

    # as the executor runs plans there: fused ops stage by stage (the target hardware stays fused)
    hw_s = executed_hardware(load_hardware(s.hardware or ("cpu" if s.backend == "numpy" else cfg.hardware)))
    return Sampler(cfg.name, s.rate, s.backend, s.max_per_minute, s.repeats, hw_s.to_dict(), archive, client,
                   cfg.search.seed, calibrate_every=s.calibrate_every, target_hw=hw)


def rank_correlation(measurements: list[dict]) -> dict[str, Any] | None:
    """Spearman rank correlation of predicted vs measured plan times (None below 3 plans)."""
    pts = [(m["predicted_seconds"], m["measured_seconds"]) for m in measurements
           if m.get("kind") == "plan" and m.get("predicted_seconds") is not None]
    if len(pts) < 3:
        return {"n": len(pts), "spearman": None} if pts else None
    from scipy.stats import spearmanr

    p, m = zip(*pts)
    rho, pval = spearmanr(p, m)
    verified = sum(1 for x in measurements if x.get("kind") == "plan" and x.get("verified"))
    return {"n": len(pts), "spearman": float(rho), "p_value": float(pval), "verified": verified}
