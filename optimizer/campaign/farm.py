"""The farm driver: owns the archive, submits search tasks to Dask, merges, checkpoints.

Loop (Dask "futures" pattern: bounded in-flight, refill as results land, plain data only):

1. keep ``2 × workers`` tasks in flight (``client.submit``; each task is hundreds of steps);
2. ``distributed.wait(..., FIRST_COMPLETED, timeout)`` so signals and the wall-time budget are
   checked at least twice a second; results become plain dicts at once and futures are
   released (futures held after completion are recomputed when a worker dies);
3. a failed task (``KilledWorker``, a worker lost mid-task, ...) is logged and resubmitted
   with the same spec up to three times; when ``MAX_FAILED_IN_A_ROW`` tasks in a row fail for
   good the campaign stops as failed (a broken setup, not bad luck);
4. results are merged into the strategy's populations and the global ε-box front, and written
   in one short transaction (results, front changes, counters);
5. every ``checkpoint_seconds`` and on Ctrl-C/SIGTERM: a checkpoint of the strategy state,
   the driver's RNG state, counters and the specs of tasks in flight, so ``resume`` continues
   with the same random streams;
6. every ``retention.every_seconds`` (when the lifecycle sets a ``compactor``): a checkpoint,
   then the retention policy (``optimizer.campaign.retention``), so the archive stays bounded;
7. every ``TRIM_SECONDS``: free heap pages go back to the operating system in the driver and
   the workers (``optimizer.campaign.cluster.trim_memory``), and the scheduler's span records
   are trimmed (``optimizer.campaign.cluster.trim_spans``), so resident memory follows live
   data over days. All the run's tasks belong to one Dask span, ``tapestry-farm``, so the
   scheduler keeps one span for the run, not a new default span whenever nothing is in flight.
   With ``worker_lifetime`` (local clusters, ``cluster.worker_lifetime``), the same tick
   restarts the oldest worker once it has run that long (staggered by up to a tenth, one worker
   per tick; its nanny starts a fresh process and the task it ran is resubmitted). A cluster
   left with no worker at all for ``NO_WORKERS_SECONDS`` (a restart that never came back, seen
   on a loaded host) stops the campaign as failed, checkpointed, instead of waiting for ever.
8. with ``driver_lifetime`` (``cluster.driver_lifetime``), once the driver has run that long it
   submits nothing more, lets the tasks in flight finish and returns ``DRIVER_RESTART``: the
   command line then replaces the process with ``tapestry resume`` (``optimizer.cli``), so the
   driver's allocators start afresh too.

Budgets stop within a task's length: a task is submitted only while the evaluation budget has
room beyond the evaluations already in flight, with its steps cut to that room, and with a time
limit that ends it by the wall-time deadline (``SearchTaskSpec.time_limit``). The run's reason
names the budget that stopped it.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from optimizer.campaign.cluster import trim_memory, trim_memory_async, trim_spans
from optimizer.campaign.progress import Progress
from optimizer.search.pareto import EpsilonBoxArchive, hypervolume
from optimizer.search.strategies.base import Strategy
from optimizer.search.worker import EvaluateTaskSpec, SearchTaskSpec, evaluate_task, search_task

log = logging.getLogger("tapestry.farm")
MAX_RETRIES = 3
#: tasks in a row that fail for good (after MAX_RETRIES resubmissions each) before the run stops
MAX_FAILED_IN_A_ROW = 3
#: seconds between two ``trim_memory`` calls in the driver and the workers (a trim takes
#: milliseconds)
TRIM_SECONDS = 60.0
#: a local cluster left without any worker this long (a lifetime restart that never came back)
#: stops the campaign as failed, checkpointed, instead of waiting for ever; ``resume`` goes on
NO_WORKERS_SECONDS = 300.0
#: the run's reason when the driver has reached its lifetime (the caller restarts it)
DRIVER_RESTART = "driver restart after its lifetime"
#: task functions by name, with their spec types (checkpoints name them)
TASKS: dict[str, tuple[Callable, type]] = {"search_task": (search_task, SearchTaskSpec),
                                           "evaluate_task": (evaluate_task, EvaluateTaskSpec)}


@dataclass
class Budget:
    evaluations: int | None
    wall_time: float | None
    stall_evaluations: int | None


@dataclass
class FarmState:
    counters: dict[str, Any] = field(default_factory=lambda: {
        "evaluations": 0, "tasks_done": 0, "tasks_failed": 0, "seq": 0, "wall_seconds": 0.0,
        "hv_best": 0.0, "hv_improved_at": 0})


class Farm:
    """One campaign's driver. ``run()`` returns when the budget is spent or a signal arrives."""

    def __init__(self, campaign: str, archive: Any, client: Any, strategy: Strategy, objectives: list[str],
                 reference: np.ndarray, budget: Budget, epsilon: float, checkpoint_seconds: float,
                 rng: np.random.Generator, progress: Progress | None = None, sampler: Any = None) -> None:
        self.campaign = campaign
        self.archive = archive
        self.client = client
        self.strategy = strategy
        self.objectives = objectives
        self.reference = np.asarray(reference, dtype=float)
        self.budget = budget
        self.front = EpsilonBoxArchive([epsilon] * len(objectives))
        self.checkpoint_seconds = checkpoint_seconds
        self.rng = rng
        self.state = FarmState()
        self.progress = progress
        self.sampler = sampler
        self.stop_reason: str | None = None
        self._pending: list[tuple[Callable, Any, dict, int]] = []  # (fn, spec, meta, tries); resubmissions first
        self._in_flight: dict[Any, tuple[Callable, Any, dict, int]] = {}
        self._last_ckpt = time.monotonic()
        self._t0 = time.monotonic()
        self._wall0 = 0.0
        self._best_gap = math.inf
        self._failed_in_a_row = 0
        self._last_trim = time.monotonic()
        self.compactor: Any = None  # optimizer.campaign.retention.Compactor, set by the lifecycle
        self.worker_lifetime: float | None = None  # seconds; set by the lifecycle for local clusters
        self.driver_lifetime: float | None = None  # seconds; set by the lifecycle
        self._worker_due: dict[str, float] = {}  # worker address -> when it is due for a restart
        self._no_workers_since: float | None = None  # since when a local cluster has had no worker
        self._stagger = np.random.default_rng()  # not self.rng: restarts must not move the search's streams

    # -- state ------------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, Any]:
        return self.state.counters

    def front_members(self) -> list[dict]:
        return [{"digest": k, "f": f.tolist(), **(p or {})} for k, f, p in self.front.members()]

    def hypervolume(self) -> float:
        F = self.front.objectives()
        return hypervolume(F, self.reference) if len(F) else 0.0

    def restore(self, counters: dict, front_rows: list[dict], checkpoint: dict | None,
                fetch_graph: Callable[[str], str], seed_records: list[dict] | None = None) -> None:
        """Continue from the archive: committed counters and front, checkpointed strategy and RNG.

        Without a checkpoint (stopped before the first one, or a start that failed), the strategy
        starts again from the front and ``seed_records`` (the evaluated baselines), which are
        archived first if nothing is."""
        me = self.counters.get("driver")
        self.counters.update(counters)
        if me:
            self.counters["driver"] = me
        self.counters["seq"] = max(int(self.counters.get("seq", 0)), int(self.archive.last_seq(self.campaign) or 0))
        self._wall0 = float(self.counters.get("wall_seconds", 0.0))
        self.front.update((r["digest"], [r["objectives"][n] for n in self.objectives],
                           {"graph_json": fetch_graph(r["digest"]), "gap": r.get("gap")}) for r in front_rows)
        # the best gap of the front so far (the run's report says what ``status`` says)
        self._best_gap = min([float(r["gap"]) for r in front_rows if r.get("gap") is not None], default=math.inf)
        if checkpoint:
            st = checkpoint["state"]
            self.rng.bit_generator.state = st["rng"]
            self.strategy.load_json(st["strategy"], fetch_graph)
            self._pending = [(TASKS[t["fn"]][0], TASKS[t["fn"]][1].from_json(t["spec"]), t["meta"], 0)
                             for t in st.get("in_flight", [])]
        elif seed_records is not None:
            members = [{"digest": r["digest"], "graph_json": fetch_graph(r["digest"]), "objectives": r["objectives"]}
                       for r in front_rows]
            self.strategy.seed_population(members + seed_records)
            if not front_rows:
                self.merge(seed_records, len(seed_records), "driver")

    def checkpoint(self) -> None:
        state = {"rng": self.rng.bit_generator.state, "strategy": self.strategy.to_json(),
                 "counters": self.counters, "reference": self.reference.tolist(),
                 "in_flight": [{"fn": fn.__name__, "spec": spec.to_json(), "meta": meta}
                               for fn, spec, meta, _ in list(self._in_flight.values()) + self._pending]}
        self.archive.save_checkpoint(self.campaign, int(self.counters["seq"]), json.loads(json.dumps(state)))
        self._last_ckpt = time.monotonic()

    # -- merging -----------------------------------------------------------------------
    def merge(self, records: list[dict], evaluations: int, worker: str | None = None,
              seconds: float | None = None) -> list[str]:
        """Archive a batch of evaluated plans; returns the digests that entered the front.

        ``worker`` and ``seconds`` (the task's busy time) feed the per-worker counters that
        ``status`` turns into evaluations/s per worker."""
        c = self.counters
        for r in records:
            c["seq"] += 1
            r["seq"] = c["seq"]
            if worker and "worker" not in r:
                r["worker"] = worker
        c["evaluations"] += int(evaluations)
        c["wall_seconds"] = self._wall0 + (time.monotonic() - self._t0)
        if worker and worker != "driver":
            w = c.setdefault("workers", {}).setdefault(worker, {"evaluations": 0, "seconds": 0.0})
            w["evaluations"] += int(evaluations)
            w["seconds"] += float(seconds or 0.0)
        items = [(r["digest"], [r["objectives"][n] for n in self.objectives],
                  {"graph_json": r["graph_json"], "gap": r.get("gap")}) for r in records]
        changes = self.front.update(items)
        hv = self.hypervolume()
        if hv > c["hv_best"] * (1 + 1e-9):
            c["hv_best"] = hv
            c["hv_improved_at"] = c["evaluations"]
            c["hv_improved_wall"] = c["wall_seconds"]
            # [evaluations, hypervolume, wall seconds, best makespan], thinned to <= 256 points
            hist = c.setdefault("hv_history", [])
            hist.append([c["evaluations"], hv, round(c["wall_seconds"], 3), self._best_makespan()])
            if len(hist) > 256:
                c["hv_history"] = hist[::2] + ([hist[-1]] if len(hist) % 2 == 0 else [])
        for r in records:
            if r.get("gap") is not None and r["digest"] in self.front:
                self._best_gap = min(self._best_gap, float(r["gap"]))
        # One transaction: after a crash, stored evaluations, front and counters still agree.
        self.archive.record_merge(self.campaign, records, entered=list(changes.entered), left=list(changes.left),
                                  front_seq=c["seq"], counters=c)
        return list(changes.entered)

    def _best_makespan(self) -> float | None:
        if "makespan" not in self.objectives:
            return None
        F = self.front.objectives()
        return float(F[:, self.objectives.index("makespan")].min()) if len(F) else None

    def compact(self) -> None:
        """Apply the retention policy (``self.compactor``, set by the lifecycle) now: checkpoint
        first, so the populations the strategy holds are named by the newest checkpoint and
        kept; the front is kept by name too."""
        self.checkpoint()
        keep = [digest for digest, _f, _p in self.front.members()]
        self.compactor.run(self.archive, self.campaign, keep)
        self.counters["retention"] = self.compactor.counters()

    def trim_memory(self) -> None:
        """Collect cyclic garbage (all of it: unfrozen first) and return free heap pages to the
        operating system here, and trim every worker (a fire-and-forget ``client.run``: a busy
        worker trims when its event loop is free; its own evaluator paces its collector)."""
        self._last_trim = time.monotonic()
        # An Evaluator made here (a sampler refit's rescore) freezes the whole process through
        # its GcPacer (costmodel.gc_pacing); the driver has no evaluation loop to unfreeze again,
        # so objects frozen while alive that died in cycles would be pinned until the next refit.
        gc.unfreeze()
        gc.collect()
        trim_memory()
        try:
            self.client.run(trim_memory_async, wait=False)
        except Exception as e:  # noqa: BLE001  (a worker leaving mid-call must not stop the campaign)
            log.debug("trim_memory on the workers failed: %s", e)
        try:
            self.client.run_on_scheduler(trim_spans)
        except Exception as e:  # noqa: BLE001  (a remote scheduler without this package: its spans grow)
            log.debug("trim_spans on the scheduler failed: %s", e)
        if self.worker_lifetime:
            self.restart_old_workers()

    def restart_old_workers(self) -> str | None:
        """Restart the worker longest past its lifetime, if any (one per call); returns its
        address. Every cache of a worker is capped, but the allocators keep their high-water
        marks (pymalloc arenas pinned by a few long-lived objects): over days, a fresh process is
        what keeps a worker flat. Dask's own ``lifetime`` retires a worker gracefully, which a
        cluster with nowhere to move its data may refuse (measured: a one-worker soak restarted
        once, then never); ``restart_workers`` goes through the nanny and does not ask."""
        try:
            workers = list(self.client.scheduler_info(n_workers=-1)["workers"])
        except Exception as e:  # noqa: BLE001  (a scheduler going away: try again next tick)
            log.debug("scheduler_info failed: %s", e)
            return None
        now = time.monotonic()
        if not workers:  # every worker gone (seen after a lifetime restart on a loaded host)
            if self._no_workers_since is None:
                self._no_workers_since = now
            elif now - self._no_workers_since >= NO_WORKERS_SECONDS and self.stop_reason is None:
                self.stop_reason = (f"failed: the local cluster has had no worker for "
                                    f"{now - self._no_workers_since:.0f} s (a worker restarted on its lifetime "
                                    f"did not come back); resume the campaign to go on")
            return None
        self._no_workers_since = None
        life = float(self.worker_lifetime)
        due = self._worker_due
        for gone in set(due) - set(workers):
            del due[gone]
        for w in workers:  # a restarted worker comes back under a new address: a new lifetime
            if w not in due:
                due[w] = now + life + self._stagger.uniform(0.0, min(0.1 * life, 600.0))
        ripe = [w for w in workers if due[w] <= now]
        if not ripe:
            return None
        w = min(ripe, key=due.__getitem__)
        del due[w]
        try:
            self.client.restart_workers([w], raise_for_error=False)
        except Exception as e:  # noqa: BLE001  (the farm resubmits whatever the worker was running)
            log.warning("restarting worker %s failed: %s", w, e)
            return None
        self.counters["worker_restarts"] = int(self.counters.get("worker_restarts", 0)) + 1
        log.info("restarted worker %s after its lifetime (%.0f s)", w, life)
        return w

    # -- budget ------------------------------------------------------------------------
    def exhausted(self) -> str | None:
        c, b = self.counters, self.budget
        if b.evaluations is not None and c["evaluations"] >= b.evaluations:
            return "evaluation budget spent"
        if b.wall_time is not None and self._wall0 + (time.monotonic() - self._t0) >= b.wall_time:
            return "wall-time budget spent"
        if b.stall_evaluations is not None and c["evaluations"] - c["hv_improved_at"] >= b.stall_evaluations:
            return f"hypervolume stalled for {b.stall_evaluations} evaluations"
        return None

    # -- the loop ----------------------------------------------------------------------
    def _submit(self, fn: Callable, spec: Any, meta: dict, tries: int) -> None:
        fut = self.client.submit(fn, spec, pure=False)
        self._in_flight[fut] = (fn, spec, meta, tries)

    def _evaluations_room(self) -> float:
        """Evaluations the budget still allows beyond those done and those in flight (inf: no limit)."""
        if self.budget.evaluations is None:
            return math.inf
        in_flight = sum(spec.max_evaluations() for _, spec, _, _ in self._in_flight.values())
        return self.budget.evaluations - self.counters["evaluations"] - in_flight

    def _fit(self, spec: Any) -> Any:
        """``spec`` with its steps cut to the evaluation budget's room and a time limit that ends it
        by the wall-time deadline."""
        changes: dict[str, Any] = {}
        room = self._evaluations_room()
        if isinstance(spec, SearchTaskSpec) and room < spec.max_evaluations():
            changes["steps"] = max(1, int(room) - len(spec.parents))
        if self.budget.wall_time is not None:
            left = self.budget.wall_time - (self._wall0 + time.monotonic() - self._t0)
            changes["time_limit"] = max(0.05, left if spec.time_limit is None else min(spec.time_limit, left))
        return dataclasses.replace(spec, **changes) if changes else spec

    def _target_in_flight(self) -> int:
        try:
            n = len(self.client.scheduler_info(n_workers=-1)["workers"])
        except (TypeError, KeyError):
            n = len(self.client.scheduler_info().get("workers", {}))
        return max(2, 2 * n)

    def _fill(self) -> None:
        target = self._target_in_flight()
        while len(self._in_flight) < target:
            if self.exhausted() or self.stop_reason or self._evaluations_room() <= 0:
                return
            if self._pending:
                fn, spec, meta, tries = self._pending.pop(0)
            else:
                task = self.strategy.next_task(self.rng, self.front_members())
                if task is None:
                    return
                (fn, spec, meta), tries = task, 0
            self._submit(fn, self._fit(spec), meta, tries)

    def _install_signals(self) -> list:
        if threading.current_thread() is not threading.main_thread():
            return []
        old = []

        def handler(signum, frame):  # noqa: ARG001
            self.stop_reason = f"stopped by {signal.Signals(signum).name}"

        for s in (signal.SIGINT, signal.SIGTERM):
            old.append((s, signal.signal(s, handler)))
        return old

    def run(self) -> str:
        from distributed import span

        with span("tapestry-farm"):
            return self._run()

    def _run(self) -> str:
        from distributed import wait

        old = self._install_signals()
        try:
            self._fill()
            while self._in_flight:
                try:
                    wait(list(self._in_flight), timeout=0.5, return_when="FIRST_COMPLETED")
                except TimeoutError:
                    pass  # nothing finished: still check signals, budget and checkpoints
                done = [f for f in self._in_flight if f.done()]
                for fut in done:
                    fn, spec, meta, tries = self._in_flight.pop(fut)
                    try:
                        res = fut.result()
                    except Exception as e:  # noqa: BLE001  (worker death, KilledWorker, task error)
                        self.counters["tasks_failed"] += 1
                        log.warning("task %s failed (%s: %s)%s", meta, type(e).__name__, e,
                                    "; resubmitting" if tries < MAX_RETRIES else "; giving up")
                        if tries < MAX_RETRIES:
                            self._pending.append((fn, spec, meta, tries + 1))
                        else:
                            self.strategy.on_failure(meta)
                            self._failed_in_a_row += 1
                            if self._failed_in_a_row >= MAX_FAILED_IN_A_ROW:
                                self.stop_reason = (f"failed: {self._failed_in_a_row} tasks in a row failed "
                                                    f"{MAX_RETRIES + 1} times each (last: {type(e).__name__}: {e})")
                        continue
                    finally:
                        fut.release()
                    self._failed_in_a_row = 0
                    self.counters["tasks_done"] += 1
                    records = self.strategy.on_result(meta, res, self.front_members())
                    entered = self.merge(records, res.get("evaluations", 0), res.get("worker"), res.get("seconds"))
                    if self.sampler is not None and entered:
                        self.sampler.offer([r for r in records if r["digest"] in set(entered)])
                if self.sampler is not None:
                    self.sampler.poll(self)
                if self.stop_reason is None and self.exhausted():
                    self.stop_reason = self.exhausted()
                if self.stop_reason is None and self.driver_lifetime and \
                        time.monotonic() - self._t0 >= self.driver_lifetime:
                    self.stop_reason = DRIVER_RESTART  # drain: the tasks in flight finish, none is added
                if time.monotonic() - self._last_ckpt >= self.checkpoint_seconds:
                    self.checkpoint()
                if self.compactor is not None and self.compactor.due():
                    self.compact()
                if time.monotonic() - self._last_trim >= TRIM_SECONDS:
                    self.trim_memory()
                if self.progress:
                    self.progress.update(self)
                if self.stop_reason and self.stop_reason.startswith(("stopped by", "failed")):
                    break  # interrupted: checkpoint keeps the in-flight specs for resume
                self._fill()
            if self.sampler is not None:
                self.sampler.drain(self)
            if self.stop_reason == DRIVER_RESTART:
                if self.exhausted():  # spent while draining: nothing to restart for
                    self.stop_reason = self.exhausted()
                else:
                    self.counters["driver_restarts"] = int(self.counters.get("driver_restarts", 0)) + 1
                    if self.compactor is not None and self.compactor.enabled:
                        # the next process compacts only ``every_seconds`` after its start: without
                        # this, candidates pile up across the restart (a step in the archive's size)
                        self.compact()
            self.counters["wall_seconds"] = self._wall0 + (time.monotonic() - self._t0)
            self.archive.update_counters(self.campaign, self.counters)
            self.checkpoint()
        finally:
            for s, h in old:
                signal.signal(s, h)
            for fut in list(self._in_flight):
                fut.cancel()
        if self.stop_reason is None and self.exhausted() is None:
            self.stop_reason = "nothing left to search (the strategy has no task to run)"
        return self.stop_reason or self.exhausted() or "done"

    @property
    def best_gap(self) -> float:
        return self._best_gap
