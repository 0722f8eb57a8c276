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
"""

from __future__ import annotations

import logging
import time
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
    records = measure_plan(g, Hardware.from_dict(spec.hardware), spec.backend, repeats=spec.repeats)
    worker = worker_name()
    for r in records:
        r["plan_digest"] = spec.digest  # the archive's key for the candidate
        if r["kind"] == "plan":
            r["details"]["worker"] = worker
    return records


class Sampler:
    def __init__(self, campaign: str, rate: float, backend: str, max_per_minute: float, repeats: int,
                 hw_dict: dict, archive: Any, client: Any, seed: int) -> None:
        self.campaign, self.rate, self.backend = campaign, rate, backend
        self.max_per_minute, self.repeats = max_per_minute, repeats
        self.hw_dict, self.archive, self.client = hw_dict, archive, client
        self.rng = np.random.default_rng([seed, 5])
        self.sent: list[float] = []
        self.futures: dict[Any, str] = {}

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
        if rows:
            self.archive.add_measurements(rows)

    def poll(self, farm: Any) -> None:
        self._store([f for f in self.futures if f.done()])

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


def make_sampler(cfg: Any, archive: Any, client: Any, hw: Any, base: Any) -> Sampler | None:
    s = cfg.sampling
    if s.rate <= 0:
        return None
    from costmodel.hardware_io import load_hardware

    hw_s = load_hardware(s.hardware or ("cpu" if s.backend == "numpy" else cfg.hardware))
    return Sampler(cfg.name, s.rate, s.backend, s.max_per_minute, s.repeats, hw_s.to_dict(), archive, client,
                   cfg.search.seed)


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
