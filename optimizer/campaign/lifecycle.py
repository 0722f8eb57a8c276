"""Campaign lifecycle: run, resume, status. (Export lives in ``optimizer.campaign.export``.)

``run`` creates the campaign row (config, its hash, the fixed hypervolume reference point),
evaluates the baselines as the first population, then hands over to the ``Farm``. ``resume``
continues from the archive: counters and front as committed, strategy state and RNG as
checkpointed; it refuses a changed workload, hardware or objectives and accepts a new budget.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from optimizer.campaign.config import CampaignConfig, ConfigError, parse_config
from optimizer.campaign.history import progress_report
from optimizer.campaign.plans import fetch_plan
from optimizer.campaign.retention import Compactor

log = logging.getLogger("tapestry.campaign")


def resolve_url(cfg_url: str, db: str | None) -> str:
    return db or os.environ.get("TAPESTRY_DB") or cfg_url


def base_program(cfg: CampaignConfig) -> tuple[Any, Any]:
    """(unsharded program, the user's plan or None)."""
    from ir import workloads
    from ir.rewrites import unshard
    from ir.serialize import load

    if cfg.workload.onnx is not None:  # symbolic dims bound by params; weights do not matter to the search
        from ir.importers.onnx import import_onnx

        return unshard(import_onnx(cfg.workload.onnx, cfg.workload.params)[0]), None
    if cfg.workload.name is not None:
        g = workloads.build(cfg.workload.name, **cfg.workload.params)
        return unshard(g), None
    plan = load(cfg.workload.file)
    return unshard(plan), plan


def make_strategy(cfg: CampaignConfig, ctx: Any) -> Any:
    from optimizer.search.strategies.islands import IslandStrategy, RandomSearch

    s = cfg.search.strategy
    if s == "native":
        return IslandStrategy(ctx)
    if s == "random":
        return RandomSearch(ctx)
    from optimizer.search.strategies.optuna_search import OptunaStrategy

    return OptunaStrategy(ctx, "tpe" if s == "optuna-tpe" else "nsga2")


def _context(cfg: CampaignConfig, hw: Any, base: Any, url: str) -> Any:
    from ir.serialize import dumps
    from optimizer.search.strategies.base import SearchContext
    from optimizer.search.worker import TaskConstraints

    return SearchContext(campaign=cfg.name, hardware=hw.to_dict(), objectives=tuple(cfg.objectives),
                         constraints=TaskConstraints(**cfg.constraints.model_dump()), search=cfg.search,
                         seed=cfg.search.seed, base_json=dumps(base, indent=None), base_digest=base.digest,
                         n_devices=hw.n_devices, storage_url=url)


def initial_records(cfg: CampaignConfig, hw: Any, base: Any, plan: Any) -> list[dict]:
    """Evaluated baselines (and the user's plan): the first population."""
    from costmodel.evaluate import Evaluator
    from optimizer.search.baselines import baselines
    from optimizer.search.worker import record

    ev = Evaluator(hw)
    graphs = dict(baselines(base, hw.n_devices)) if cfg.search.seed_baselines else {"single-device": base}
    if plan is not None:
        graphs["user-plan"] = plan
    out = []
    for name, g in graphs.items():
        r = record(g, ev(g), None, f"baseline:{name}", 0.0)
        out.append(r)
    return out


def _budget(cfg: CampaignConfig) -> Any:
    from optimizer.campaign.farm import Budget

    b = cfg.budget
    return Budget(b.evaluations, b.wall_time, b.stall_evaluations)


def run_campaign(cfg: CampaignConfig, db: str | None = None, scheduler: str | None = None,
                 workers: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Start a new campaign and run it to its budget (or a signal)."""
    from costmodel.hardware_io import load_hardware
    from optimizer.search.pareto import reference_point
    from storage import Archive

    url = resolve_url(cfg.storage.url, db)
    hw = load_hardware(cfg.hardware)
    base, plan = base_program(cfg)
    records = initial_records(cfg, hw, base, plan)
    F = np.array([[r["objectives"][n] for n in cfg.objectives] for r in records], dtype=float)
    ref = reference_point(F, margin=1.0)
    resolved = {"config": cfg.model_dump(mode="json"), "hardware": hw.to_dict(), "base_digest": base.digest,
                "identity": cfg.identity_hash()}
    with Archive.open(url) as archive:
        archive.create_campaign(cfg.name, resolved, cfg.config_hash(), list(cfg.objectives), ref.tolist())
        archive.set_status(cfg.name, "running")
        return _drive(cfg, archive, url, hw, base, records, ref, None, scheduler, workers, quiet)


def _drive(cfg: CampaignConfig, archive: Any, url: str, hw: Any, base: Any, seed_records: list[dict] | None,
           ref: np.ndarray, resume: dict | None, scheduler: str | None, workers: int | None,
           quiet: bool) -> dict[str, Any]:
    from optimizer.campaign.cluster import dask_client
    from optimizer.campaign.farm import Farm
    from optimizer.campaign.progress import Progress
    from optimizer.realrun.sampling import make_sampler

    ctx = _context(cfg, hw, base, url)
    strategy = make_strategy(cfg, ctx)
    rng = np.random.default_rng(np.random.SeedSequence([cfg.search.seed, 99]))
    status = "failed"
    with Progress(cfg.name, quiet) as progress:
        gpu = {"GPU": 1} if cfg.sampling.rate > 0 and cfg.sampling.backend == "cupy" else None
        with dask_client(scheduler or cfg.cluster.scheduler, workers or cfg.cluster.workers,
                         cfg.cluster.threads_per_worker, gpu) as client:
            sampler = make_sampler(cfg, archive, client, hw, base)
            farm = Farm(cfg.name, archive, client, strategy, list(cfg.objectives), ref, _budget(cfg),
                        cfg.search.epsilon, cfg.checkpoint_seconds, rng, progress, sampler)
            farm.counters["driver"] = driver_identity()
            farm.compactor = Compactor(cfg.retention)
            if resume is None:
                strategy.seed_population(seed_records)
                farm.merge(seed_records, len(seed_records), "driver")
            else:
                fetch = fetch_plan(archive, cfg.name)  # replays plans stored as deltas
                farm.restore(resume["counters"], archive.current_front(cfg.name), resume["checkpoint"], fetch)
            try:
                reason = farm.run()
                status = "paused" if reason.startswith("stopped by") else "finished"
            finally:
                archive.set_status(cfg.name, status)
            progress.update(farm, force=True)
    return {"campaign": cfg.name, "status": status, "reason": reason, "evaluations": farm.counters["evaluations"],
            "front": len(farm.front), "hypervolume": farm.hypervolume(), "best_gap": farm.best_gap}


def driver_identity() -> dict[str, Any]:
    import socket

    return {"host": socket.gethostname(), "pid": os.getpid()}


def check_not_running(row: dict) -> None:
    """Refuse to resume a campaign whose driver is still alive (two drivers would fight)."""
    import datetime as dt

    drv = row["counters"].get("driver") or {}
    if row["status"] != "running" or not drv:
        return
    me = driver_identity()
    if drv.get("host") == me["host"]:
        try:
            os.kill(int(drv["pid"]), 0)
        except (ProcessLookupError, ValueError, TypeError):
            return  # the driver died (crash, kill -9): safe to continue
        except PermissionError:
            pass
        raise ConfigError(f"campaign {row['name']!r} is running (driver process {drv['pid']} on this host); stop it "
                          f"with Ctrl-C or kill {drv['pid']}, then resume")
    age = (dt.datetime.now(dt.timezone.utc) - row["updated_at"]).total_seconds()
    if age < 120:
        raise ConfigError(f"campaign {row['name']!r} is running on {drv.get('host')} (updated {age:.0f} s ago); "
                          f"stop that driver first, or wait two minutes if it crashed")


def load_campaign_config(archive: Any, name: str) -> tuple[CampaignConfig, dict]:
    row = archive.get_campaign(name)
    resolved = row["config"]
    return parse_config(resolved["config"], f"campaign {name!r}"), resolved


def resume_campaign(name: str, db: str | None = None, config_path: str | None = None,
                    evaluations: int | None = None, wall_time: float | None = None,
                    scheduler: str | None = None, workers: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Continue a campaign where it stopped (crash, Ctrl-C, or a spent budget now enlarged)."""
    from costmodel.hardware_io import load_hardware
    from optimizer.campaign.config import load_config
    from storage import Archive

    url = resolve_url("tapestry.db", db)
    with Archive.open(url) as archive:
        cfg, resolved = load_campaign_config(archive, name)
        if config_path:
            new = load_config(config_path)
            if new.name != name:
                raise ConfigError(f"config {config_path} is for campaign {new.name!r}, not {name!r}")
            if new.identity_hash() != resolved["identity"]:
                raise ConfigError(f"config {config_path} changes the workload, hardware, objectives or constraints "
                                  f"of campaign {name!r}; a resumed campaign may only change its budget, cluster "
                                  f"and sampling (start a new campaign for a different problem)")
            cfg = new
        hw = load_hardware(cfg.hardware)
        if hw.to_dict() != resolved["hardware"]:
            raise ConfigError(f"the hardware {cfg.hardware!r} of campaign {name!r} has changed since it started; "
                              f"restore the hardware file or start a new campaign")
        base, _ = base_program(cfg)
        if base.digest != resolved["base_digest"]:
            raise ConfigError(f"the workload of campaign {name!r} has changed since it started (program digest "
                              f"differs); restore it or start a new campaign")
        b = cfg.budget.model_copy(update={k: v for k, v in (("evaluations", evaluations), ("wall_time", wall_time))
                                          if v is not None})
        cfg = cfg.model_copy(update={"budget": b})
        row = archive.get_campaign(name)
        check_not_running(row)
        resolved["config"] = cfg.model_dump(mode="json")
        ref = np.array(row["reference_point"], dtype=float)
        ckpt = archive.latest_checkpoint(name)
        archive.set_status(name, "running")
        return _drive(cfg, archive, url, hw, base, None, ref, {"counters": row["counters"], "checkpoint": ckpt},
                      scheduler, workers, quiet)


def campaign_status(db: str | None, name: str | None) -> dict[str, Any]:
    """Plain-data status: all campaigns, or one campaign's progress and front."""
    from optimizer.search.pareto import hypervolume
    from storage import Archive

    url = resolve_url("tapestry.db", db)
    with Archive.open(url, readonly=True) as archive:
        if name is None:
            return {"campaigns": archive.list_campaigns()}
        row = archive.get_campaign(name)
        front = archive.current_front(name)
        objectives = row["objectives"]
        F = np.array([[r["objectives"][n] for n in objectives] for r in front], dtype=float)
        hv = hypervolume(F, np.array(row["reference_point"])) if len(F) else 0.0
        gaps = [r["gap"] for r in front if r.get("gap") is not None]
        from optimizer.realrun.sampling import rank_correlation

        return {"campaign": row, "front": front, "hypervolume": hv, "best_gap": min(gaps) if gaps else None,
                "budget": row["config"]["config"]["budget"], "sampling": rank_correlation(archive.measurements(name)),
                "progress": progress_report(row, archive.storage_stats(name))}
