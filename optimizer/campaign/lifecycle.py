"""Campaign lifecycle: run, resume, status. (Export lives in ``optimizer.campaign.export``.)

``run`` checks everything that can fail before it writes anything (config, program, baselines,
the Dask scheduler, the sampling backend), then creates the campaign row (config, its hash, the
fixed hypervolume reference point), evaluates the baselines as the first population and hands
over to the ``Farm``; a failure after that marks the campaign ``failed`` (``resume`` continues
it). ``resume`` continues from the archive: counters and front as committed, strategy state and
RNG as checkpointed; it refuses a changed workload, hardware or objectives and accepts a new
budget. Commands that read an archive refuse a SQLite file that does not exist rather than
create an empty one.

Liveness: a running driver records ``{host, pid, started}`` in the campaign's counters and
checkpoints every ``checkpoint_seconds`` (its heartbeat). ``driver_state`` tells whether the
driver of a ``running`` campaign is alive (same host: the process with that pid and start time
exists; other hosts: a heartbeat within ``HEARTBEAT_STALE_S``), so ``status`` shows a killed
driver's campaign as interrupted and ``resume`` refuses to run beside a live one.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.campaign.config import (BudgetConfig, CampaignConfig, ConfigError, budget_with, parse_config,
                                       spent_budget)
from optimizer.campaign.history import progress_report
from optimizer.campaign.plans import fetch_plan
from optimizer.campaign.retention import Compactor

log = logging.getLogger("tapestry.campaign")

#: a driver on another host whose last heartbeat is older than this is presumed gone
HEARTBEAT_STALE_S = 120.0
#: the archive commands use when neither --db nor $TAPESTRY_DB names one
DEFAULT_ARCHIVE = "tapestry.db"


def resolve_url(cfg_url: str, db: str | None) -> str:
    return db or os.environ.get("TAPESTRY_DB") or cfg_url


def existing_archive(db: str | None) -> str:
    """The archive URL for a command that reads an existing archive (``--db``, ``$TAPESTRY_DB``,
    else ``DEFAULT_ARCHIVE``); ``ConfigError`` when it names a SQLite file that does not exist,
    so that a mistyped or forgotten ``--db`` never creates an empty archive."""
    from storage.engine import normalize_url

    url = resolve_url(DEFAULT_ARCHIVE, db)
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        path = Path(parsed.database)
        if not path.is_file():
            how = "--db" if db else ("$TAPESTRY_DB" if os.environ.get("TAPESTRY_DB") else "the default (no --db)")
            hint = ("; 'make run' writes its campaign to out/quickstart.db: add --db out/quickstart.db"
                    if Path("out/quickstart.db").is_file() and not db else "")
            raise ConfigError(f"no archive at {str(path)!r} ({how}){hint}; pass --db with the archive a campaign "
                              f"was run with, or set TAPESTRY_DB")
    return url


def base_program(cfg: CampaignConfig) -> tuple[Any, Any]:
    """(unsharded program, the user's plan or None)."""
    from ir import workloads
    from ir.rewrites import unshard
    from ir.serialize import load

    if cfg.workload.onnx is not None:  # symbolic dims bound by params; weights do not matter to the search
        from ir.importers.onnx import import_onnx

        return unshard(import_onnx(cfg.workload.onnx, cfg.workload.params)[0]), None
    if cfg.workload.name is not None:
        try:
            g = workloads.build(cfg.workload.name, **cfg.workload.params)
        except (TypeError, ValueError, OverflowError, ArithmeticError, KeyError, IndexError) as e:
            raise ConfigError(f"workload {cfg.workload.name!r} cannot be built from params "
                              f"{cfg.workload.params}: {type(e).__name__}: {e}") from None
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
    from costmodel.repetition import layers_mode
    from ir.serialize import dumps
    from optimizer.search.strategies.base import SearchContext
    from optimizer.search.worker import TaskConstraints

    return SearchContext(campaign=cfg.name, hardware=hw.to_dict(), objectives=tuple(cfg.objectives),
                         constraints=TaskConstraints(**cfg.constraints.model_dump()), search=cfg.search,
                         seed=cfg.search.seed, base_json=dumps(base, indent=None), base_digest=base.digest,
                         n_devices=hw.n_devices, storage_url=url, layers=layers_mode(base, cfg.search.layers))


def initial_records(cfg: CampaignConfig, hw: Any, base: Any, plan: Any) -> list[dict]:
    """Evaluated baselines (and the user's plan): the first population."""
    from costmodel.evaluate import Evaluator
    from costmodel.repetition import layers_mode
    from optimizer.search.baselines import baselines
    from optimizer.search.worker import record

    ev = Evaluator(hw, layers=layers_mode(base, cfg.search.layers))
    graphs = (dict(baselines(base, hw.n_devices, hw.devices_per_node)) if cfg.search.seed_baselines
              else {"single-device": base})
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


def check_start(cfg: CampaignConfig, scheduler: str | None, workers: int | None) -> None:
    """What must hold before a campaign starts (so a start never fails half-way): a scheduler
    address with a port, a positive worker count, and, for CuPy sampling on a local cluster,
    a working CuPy with a GPU here."""
    from optimizer.campaign.config import check_scheduler_address

    if scheduler is not None:
        check_scheduler_address(scheduler)
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if cfg.sampling.rate > 0 and cfg.sampling.backend == "cupy" and not (scheduler or cfg.cluster.scheduler):
        from executor.backend import BackendError, get_backend

        try:
            get_backend("cupy")
        except BackendError as e:
            raise ConfigError(f"sampling.backend is cupy, but {e}; set sampling.backend: numpy (or sampling.rate: "
                              f"0), or give cluster.scheduler with GPU workers") from None
        except Exception as e:  # noqa: BLE001  (a broken CuPy install)
            raise ConfigError(f"sampling.backend is cupy, but CuPy cannot start here ({type(e).__name__}: {e}); "
                              f"set sampling.backend: numpy (or sampling.rate: 0)") from None


def _cluster(cfg: CampaignConfig, scheduler: str | None, workers: int | None) -> Any:
    from optimizer.campaign.cluster import dask_client

    gpu = {"GPU": 1} if cfg.sampling.rate > 0 and cfg.sampling.backend == "cupy" else None
    return dask_client(scheduler or cfg.cluster.scheduler, workers or cfg.cluster.workers,
                       cfg.cluster.threads_per_worker, gpu)


def run_campaign(cfg: CampaignConfig, db: str | None = None, scheduler: str | None = None,
                 workers: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Start a new campaign and run it to its budget (or a signal)."""
    from costmodel.hardware_io import load_hardware
    from optimizer.search.pareto import reference_point
    from storage import Archive, CampaignNotFound

    check_start(cfg, scheduler, workers)
    url = resolve_url(cfg.storage.url, db)
    hw = load_hardware(cfg.hardware)
    base, plan = base_program(cfg)
    records = initial_records(cfg, hw, base, plan)
    F = np.array([[r["objectives"][n] for n in cfg.objectives] for r in records], dtype=float)
    ref = reference_point(F, margin=1.0)
    resolved = {"config": cfg.model_dump(mode="json"), "hardware": hw.to_dict(), "base_digest": base.digest,
                "identity": cfg.identity_hash()}
    with Archive.open(url) as archive:
        try:
            archive.get_campaign(cfg.name)
        except CampaignNotFound:
            pass
        else:
            raise ConfigError(f"campaign {cfg.name!r} already exists in {archive.url}; resume it with 'tapestry "
                              f"resume {cfg.name} --db {url}', or change 'name' in the config to start a new one")
        with _cluster(cfg, scheduler, workers) as client:  # an unreachable scheduler fails here, before any write
            archive.create_campaign(cfg.name, resolved, cfg.config_hash(), list(cfg.objectives), ref.tolist())
            return _drive(cfg, archive, client, url, hw, base, records, ref, None, quiet)


def _drive(cfg: CampaignConfig, archive: Any, client: Any, url: str, hw: Any, base: Any,
           seed_records: list[dict] | None, ref: np.ndarray, resume: dict | None, quiet: bool) -> dict[str, Any]:
    """Run the farm on an open archive and client; the campaign is ``running`` while it does,
    ``failed`` if anything raises, else ``paused`` (a signal, or the driver's lifetime: then the
    result's ``restart`` is true and the command line resumes in a fresh process) or ``finished``."""
    from optimizer.campaign.farm import DRIVER_RESTART, Farm
    from optimizer.campaign.progress import Progress
    from optimizer.realrun.sampling import make_sampler

    status = "failed"
    archive.set_status(cfg.name, "running")
    archive.update_counters(cfg.name, {"driver": driver_identity()})  # liveness from the first moment
    try:
        ctx = _context(cfg, hw, base, url)
        strategy = make_strategy(cfg, ctx)
        rng = np.random.default_rng(np.random.SeedSequence([cfg.search.seed, 99]))
        with Progress(cfg.name, quiet, budget=_budget(cfg)) as progress:
            sampler = make_sampler(cfg, archive, client, hw, base)
            farm = Farm(cfg.name, archive, client, strategy, list(cfg.objectives), ref, _budget(cfg),
                        cfg.search.epsilon, cfg.checkpoint_seconds, rng, progress, sampler)
            farm.counters["driver"] = driver_identity()
            farm.compactor = Compactor(cfg.retention)
            if getattr(client, "cluster", None) is not None:  # our own local cluster: restart its workers
                farm.worker_lifetime = cfg.cluster.worker_lifetime
            farm.driver_lifetime = cfg.cluster.driver_lifetime
            farm.counters["budget"] = cfg.budget.model_dump(mode="json")
            if resume is None:
                strategy.seed_population(seed_records)
                farm.merge(seed_records, len(seed_records), "driver")
            else:
                fetch = fetch_plan(archive, cfg.name)  # replays plans stored as deltas
                farm.restore(resume["counters"], archive.current_front(cfg.name), resume["checkpoint"], fetch,
                             resume["seed_records"])
                farm.counters["budget"] = cfg.budget.model_dump(mode="json")  # the resumed run's, not the stored one
            reason = farm.run()
            status = ("paused" if reason.startswith("stopped by") or reason == DRIVER_RESTART else
                      "failed" if reason.startswith("failed") else "finished")
            progress.update(farm, force=True)
    except KeyboardInterrupt:  # Ctrl-C before the farm's own handler is in place: a pause, not a failure
        status = "paused"
        raise
    finally:
        archive.set_status(cfg.name, status)
    return {"campaign": cfg.name, "status": status, "reason": reason, "evaluations": farm.counters["evaluations"],
            "front": len(farm.front), "hypervolume": farm.hypervolume(), "best_gap": farm.best_gap,
            "restart": reason == DRIVER_RESTART, "url": url}  # (the CLI replaces the process on a restart)


def driver_identity() -> dict[str, Any]:
    """This process as a campaign's driver: host, pid and process start time (pids are reused)."""
    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time()}


def _heartbeat_age(row: dict, heartbeat: dt.datetime | None) -> float:
    times = [t for t in (row.get("updated_at"), heartbeat) if t is not None]
    last = max(t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc) for t in times)
    return (dt.datetime.now(dt.timezone.utc) - last).total_seconds()


def driver_state(row: dict, heartbeat: dt.datetime | None = None) -> tuple[bool | None, str]:
    """Whether the driver of a ``running`` campaign is alive: ``(True, note)`` alive, ``(False,
    note)`` gone (killed, crashed, or silent on another host for ``HEARTBEAT_STALE_S``), ``(None,
    "")`` for a campaign that is not running. ``heartbeat``: the latest checkpoint's time."""
    import psutil

    if row["status"] != "running":
        return None, ""
    drv = row["counters"].get("driver") or {}
    age = _heartbeat_age(row, heartbeat)
    if drv.get("host") == socket.gethostname() and drv.get("pid") is not None:
        try:
            proc = psutil.Process(int(drv["pid"]))
            same = drv.get("started") is None or abs(proc.create_time() - float(drv["started"])) < 1.0
            alive = same and proc.status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, ValueError, TypeError):
            alive = False
        except psutil.AccessDenied:
            alive = True
        if alive:
            return True, f"driver process {drv['pid']} on this host"
        return False, f"its driver (process {drv['pid']} on this host) is gone, last heard of {age:.0f} s ago"
    if age < HEARTBEAT_STALE_S:
        return True, f"driver on {drv.get('host', 'an unknown host')}, heard of {age:.0f} s ago"
    return False, (f"its driver on {drv.get('host', 'an unknown host')} has not been heard of for {age:.0f} s "
                   f"(presumed gone)")


def effective_status(row: dict, heartbeat: dt.datetime | None = None) -> str:
    """The campaign's status as users should read it: a ``running`` campaign whose driver is gone
    is ``interrupted`` (``resume`` continues it)."""
    alive, _ = driver_state(row, heartbeat)
    return "interrupted" if alive is False else row["status"]


def check_not_running(row: dict, heartbeat: dt.datetime | None = None) -> None:
    """Refuse to resume a campaign whose driver is still alive (two drivers would fight)."""
    alive, note = driver_state(row, heartbeat)
    if alive:
        drv = row["counters"].get("driver") or {}
        if drv.get("host") == socket.gethostname():
            raise ConfigError(f"campaign {row['name']!r} is running ({note}); stop it with Ctrl-C or kill "
                              f"{drv.get('pid')}, then resume")
        raise ConfigError(f"campaign {row['name']!r} is running ({note}); stop that driver first, or wait "
                          f"{HEARTBEAT_STALE_S:.0f} s if it crashed")


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

    url = existing_archive(db)
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
            old_doc, new_doc = cfg.model_dump(mode="json"), new.model_dump(mode="json")
            changed = [k for k in new_doc if k not in RESUMABLE and new_doc[k] != old_doc.get(k)]
            if changed:
                raise ConfigError(f"config {config_path} changes {', '.join(changed)} of campaign {name!r}; a resumed "
                                  f"campaign may only change its budget, cluster, sampling and storage (restore "
                                  f"{changed[0]} as it was, or start a new campaign)")
            cfg = new
        hw = load_hardware(cfg.hardware)
        if hw.to_dict() != resolved["hardware"]:
            raise ConfigError(f"the hardware {cfg.hardware!r} of campaign {name!r} has changed since it started; "
                              f"restore the hardware file or start a new campaign")
        base, _ = base_program(cfg)
        if base.digest != resolved["base_digest"]:
            raise ConfigError(f"the workload of campaign {name!r} has changed since it started (program digest "
                              f"differs); restore it or start a new campaign")
        row = archive.get_campaign(name)
        budget = BudgetConfig.model_validate(row["counters"].get("budget") or cfg.budget.model_dump())
        if config_path:
            budget = cfg.budget
        budget, notes = budget_with(budget, row["counters"], evaluations, wall_time, f"resume {name}")
        spent = spent_budget(budget, row["counters"])
        if spent:
            done = int(row["counters"].get("evaluations", 0) or 0)
            where = f"the budget of {config_path}" if config_path else "its budget"
            raise ConfigError(f"campaign {name!r} has spent {spent}, so a resume with {where} would stop at once; "
                              f"give it a new total, e.g. 'tapestry resume {name} --evaluations {done + 5000}' (or "
                              f"--wall-time, or --config with a larger budget)")
        cfg = cfg.model_copy(update={"budget": budget})
        check_start(cfg, scheduler, workers)
        ckpt = archive.latest_checkpoint(name)
        heartbeat = ckpt["created_at"] if ckpt else None
        check_not_running(row, heartbeat)
        ref = np.array(row["reference_point"], dtype=float)
        seeds = None
        if ckpt is None:  # stopped before its first checkpoint (or a failed start): search again from the baselines
            seeds = initial_records(cfg, hw, base, base_program(cfg)[1])
        with _cluster(cfg, scheduler, workers) as client:  # a cluster that cannot start changes nothing
            # checked again and marked running in one transaction: of two resumes started together
            # (both passed the check above, seconds before their clusters), the second stops here
            archive.claim(name, lambda now: check_not_running(now, heartbeat), {"driver": driver_identity()})
            res = _drive(cfg, archive, client, url, hw, base, None, ref,
                         {"counters": row["counters"], "checkpoint": ckpt, "seed_records": seeds}, quiet)
        return {**res, "notes": notes + res.get("notes", [])}


#: the parts of a campaign's config that ``resume --config`` may change
RESUMABLE = ("budget", "cluster", "sampling", "storage")


def program_from_archive(db: str | None, digest: str) -> Any:
    """The program with ``digest`` as stored in the archive (every campaign stores its program as
    the single-device baseline); ``ConfigError`` when no campaign there has that program."""
    from ir.serialize import loads
    from storage import Archive, StorageError

    with Archive.open(existing_archive(db), readonly=True) as archive:
        for row in archive.list_campaigns():
            if row["config"].get("base_digest") != digest:
                continue
            try:
                g = loads(archive.get_graph_json(row["name"], digest), f"program {digest[:12]} of {row['name']}")
            except StorageError:
                continue
            if g.digest == digest:
                return g
    raise ConfigError(f"no campaign in the archive has program {digest[:12]}; pass --reference PROGRAM.json, or the "
                      f"--db the plan's campaign ran with")


def campaign_status(db: str | None, name: str | None) -> dict[str, Any]:
    """Plain-data status: all campaigns, or one campaign's progress and front."""
    from optimizer.search.pareto import hypervolume
    from storage import Archive

    url = existing_archive(db)
    with Archive.open(url, readonly=True) as archive:
        if name is None:
            rows = archive.list_campaigns()
            for r in rows:
                ckpt = archive.latest_checkpoint(r["name"]) if r["status"] == "running" else None
                r["stored_status"], r["status"] = r["status"], effective_status(r, ckpt and ckpt["created_at"])
            return {"campaigns": rows}
        row = archive.get_campaign(name)
        ckpt = archive.latest_checkpoint(name) if row["status"] == "running" else None
        alive, note = driver_state(row, ckpt and ckpt["created_at"])
        row["stored_status"], row["status"] = row["status"], effective_status(row, ckpt and ckpt["created_at"])
        row["driver_note"] = note
        front = archive.current_front(name)
        objectives = row["objectives"]
        F = np.array([[r["objectives"][n] for n in objectives] for r in front], dtype=float)
        hv = hypervolume(F, np.array(row["reference_point"])) if len(F) else 0.0
        gaps = [r["gap"] for r in front if r.get("gap") is not None]
        from costmodel.hardware import Hardware
        from optimizer.campaign.fidelity import best_mfu, calibration_report
        from optimizer.realrun.sampling import rank_correlation

        hw = Hardware.from_dict(row["config"]["hardware"]) if row["config"].get("hardware") else None
        return {"campaign": row, "front": front, "hypervolume": hv, "best_gap": min(gaps) if gaps else None,
                "budget": row["counters"].get("budget") or row["config"]["config"]["budget"],
                "sampling": rank_correlation(archive.measurements(name)),
                "calibration": calibration_report(archive, name), "hardware_name": hw.name if hw else "",
                "best_mfu": best_mfu(archive, name, hw, front) if hw else [],
                "progress": progress_report(row, archive.storage_stats(name))}
