"""Bounded memory over multi-day campaigns (issue 16): the driver and the workers give free heap
pages back to the operating system (``trim_memory``), the scheduler's span records stay bounded
(``trim_spans``), and the farm does both on a timer."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from optimizer.campaign import farm as farm_module
from optimizer.campaign.cluster import SPAN_KEEP, trim_memory_async, trim_spans
from optimizer.campaign.farm import Budget, Farm

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")

# Fragment the C heap: 60,000 blocks of 2 kB (above pymalloc's 512-byte limit, so from malloc),
# then free all but every 100th, so no free run reaches the heap's top and free() alone returns
# nothing. Prints resident MB after the frees and after trim_memory().
_FRAGMENT = textwrap.dedent(
    """
    import psutil
    from optimizer.campaign.cluster import trim_memory
    rss = lambda: psutil.Process().memory_info().rss / 1e6
    blocks = [bytes([i % 251]) * 2048 for i in range(60_000)]
    kept = blocks[::100]
    del blocks
    before = rss()
    released = trim_memory()
    print(before, rss(), released)
    """
)


@glibc
def test_trim_memory_gives_freed_heap_pages_back() -> None:
    out = subprocess.run([sys.executable, "-c", _FRAGMENT], capture_output=True, text=True, check=True)
    before, after, released = out.stdout.split()
    assert released == "True"
    # ~120 MB were allocated and ~99 % freed: the trim returns most of it (measured: ~115 MB)
    assert float(before) - float(after) > 60.0, out.stdout


class _Client:
    """Records ``client.run`` calls, or fails them like a cluster losing a worker."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.on_scheduler: list = []
        self.fail = fail

    def run(self, fn, *args, wait: bool = True):
        if self.fail:
            raise OSError("worker tcp://127.0.0.1:1 left")
        self.calls.append((fn, args, wait))

    def run_on_scheduler(self, fn):
        if self.fail:
            raise OSError("scheduler unreachable")
        self.on_scheduler.append(fn)


def _farm(client: _Client) -> Farm:
    return Farm("c", archive=None, client=client, strategy=None, objectives=["makespan"], reference=[1.0],
                budget=Budget(None, None, None), epsilon=0.01, checkpoint_seconds=60.0,
                rng=np.random.default_rng(0))


def test_farm_trims_the_driver_and_every_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    driver_calls = []

    def fake_trim() -> bool:
        driver_calls.append(1)
        return True

    monkeypatch.setattr(farm_module, "trim_memory", fake_trim)
    client = _Client()
    farm = _farm(client)
    farm.trim_memory()
    assert driver_calls == [1]
    # every worker, fire and forget: Dask takes only coroutine functions with wait=False
    assert client.calls == [(trim_memory_async, (), False)]
    assert inspect.iscoroutinefunction(trim_memory_async)
    assert client.on_scheduler == [trim_spans]
    assert farm_module.TRIM_SECONDS == 60.0


def test_a_failed_worker_trim_does_not_stop_the_campaign() -> None:
    farm = _farm(_Client(fail=True))
    farm.trim_memory()  # no exception


def _inc(x: int) -> int:
    return x + 1


@pytest.mark.filterwarnings(r"ignore:Port \d+ is already in use")
def test_trim_spans_bounds_the_farm_span_on_a_real_scheduler() -> None:
    """Dask's span of a long run gains a metadata entry per submit and keeps its forgotten task
    groups; trimmed, both stay at SPAN_KEEP while the span goes on (checked on the installed
    Dask's own objects, so a Dask that renames them fails here, not silently in a campaign)."""
    import distributed

    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client, distributed.span("tapestry-farm"):
        for round_ in range(3):
            for i in range(30):
                # a new key prefix per round: a new task group, forgotten once released
                assert client.submit(_inc, i, key=f"r{round_}x-{i}").result() == i + 1
        ext = cluster.scheduler.extensions["spans"]
        (span,) = [s for s in ext.spans.values() if s.name == ("tapestry-farm",)]
        assert len(span.metadata["collections"]) == 90
        dropped = client.run_on_scheduler(trim_spans)
        assert len(span.metadata["collections"]) == SPAN_KEEP
        assert dropped >= 90 - SPAN_KEEP
        # SPAN_KEEP forgotten groups, plus the last group if its last future's release has not
        # reached the scheduler yet (a live group is never dropped)
        assert len(span.groups) <= SPAN_KEEP + 1 and span.done and span.stop > 0
        # the span still takes new tasks after a trim
        assert client.submit(_inc, 1, key="after-1").result() == 2
        assert len(span.metadata["collections"]) == SPAN_KEEP + 1
    assert trim_spans(object()) == 0  # not a scheduler (or a Dask without spans): left alone


@pytest.mark.slow
def test_local_cluster_keeps_short_diagnostic_logs() -> None:
    """The scheduler (in this process) and the workers use LOCAL_CLUSTER_CONFIG's log lengths."""
    from optimizer.campaign.cluster import LOCAL_CLUSTER_CONFIG, dask_client

    n = LOCAL_CLUSTER_CONFIG["distributed.admin.low-level-log-length"]
    with dask_client(None, 1) as client:
        scheduler = client.cluster.scheduler
        assert scheduler.transition_log.maxlen == n
        assert scheduler.computations.maxlen == LOCAL_CLUSTER_CONFIG["distributed.diagnostics.computations.max-history"]
        assert client.scheduler_comm.recent_message_log.maxlen == n  # the driver's update-graph messages
        monitor_length = LOCAL_CLUSTER_CONFIG["distributed.admin.system-monitor.log-length"]
        assert {q.maxlen for q in scheduler.monitor.quantities.values()} == {monitor_length}
        worker_lengths = client.run(lambda dask_worker: sorted({q.maxlen for q in dask_worker.monitor.quantities.values()}))
        assert list(worker_lengths.values()) == [[monitor_length]]
        (logs,) = client.run(lambda dask_worker: (dask_worker.state.log.maxlen, dask_worker.state.stimulus_log.maxlen,
                                                  dask_worker.profile_history.maxlen)).values()
        assert list(logs) == [n, n, n]
        # what the farm sends each minute: Dask refuses wait=False for a plain function
        # ("Combination not supported"), so it must be a coroutine function
        with pytest.raises(Exception, match="Combination not supported"):
            client.run(lambda: 0, wait=False)
        assert client.run(trim_memory_async, wait=False) is None
        assert set(client.run(trim_memory_async).values()) <= {True, False}
        with dask_client(scheduler.address) as remote:  # a client of an existing scheduler too
            assert remote.scheduler_comm.recent_message_log.maxlen == n


class _RestartClient:
    """The two calls ``Farm.restart_old_workers`` makes, recorded."""

    def __init__(self, workers: list[str]) -> None:
        self.workers, self.restarted = list(workers), []

    def scheduler_info(self, n_workers: int = 5) -> dict:
        assert n_workers == -1  # every worker, not Dask's default first five
        return {"workers": {w: {} for w in self.workers}}

    def restart_workers(self, workers: list[str], raise_for_error: bool = True) -> dict:
        self.restarted += workers
        self.workers = [w for w in self.workers if w not in workers] + [w + "'" for w in workers]
        return {w: "OK" for w in workers}


def test_farm_restarts_the_oldest_worker_past_its_lifetime(monkeypatch: pytest.MonkeyPatch) -> None:
    """One restart per tick, the worker longest due first, each restarted worker (a new
    address) given a new lifetime; staggered by at most a tenth of the lifetime."""
    clock = [1000.0]
    monkeypatch.setattr(farm_module.time, "monotonic", lambda: clock[0])
    farm = Farm.__new__(Farm)
    farm.client = _RestartClient(["a", "b"])
    farm.worker_lifetime, farm._worker_due, farm._stagger = 100.0, {}, np.random.default_rng(0)
    farm.state = farm_module.FarmState()
    assert farm.restart_old_workers() is None  # both just seen
    assert all(1100.0 <= t <= 1110.0 for t in farm._worker_due.values())
    clock[0] = 1111.0
    first = min(farm._worker_due, key=farm._worker_due.get)
    assert farm.restart_old_workers() == first  # both due: only the one due first
    assert farm.restart_old_workers() in {"a", "b"} - {first}  # the other on the next tick
    assert farm.client.restarted == [first, ({"a", "b"} - {first}).pop()]
    assert farm.counters["worker_restarts"] == 2
    assert farm.restart_old_workers() is None  # the fresh workers start a new lifetime
    assert set(farm._worker_due) == {"a'", "b'"} and min(farm._worker_due.values()) >= 1211.0


@pytest.mark.slow
def test_campaign_goes_on_across_worker_restarts(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local worker restarted on its lifetime (here 4 s, checked every second) is replaced by a
    fresh process, again and again, and the campaign spends its budget."""
    import threading
    import time

    import psutil

    from optimizer.campaign.config import parse_config
    from optimizer.campaign.lifecycle import run_campaign
    from tests.farm.conftest import small_config

    monkeypatch.setattr(farm_module, "TRIM_SECONDS", 1.0)
    db = str(tmp_path / "life.db")
    cfg = parse_config(small_config("life", db, budget={"evaluations": 15000}, search={"steps_per_task": 150}))
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"worker_lifetime": 4.0})})
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:  # the worker processes: the nannies (in this process) spawn them
        me = psutil.Process()
        while not done.is_set():
            for p in me.children(recursive=True):
                try:
                    if "spawn_main" in " ".join(p.cmdline()):
                        seen.add(p.pid)
                except psutil.Error:
                    pass
            time.sleep(0.5)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        res = run_campaign(cfg, quiet=True)
    finally:
        done.set()
        t.join()
    assert res["status"] == "finished" and res["evaluations"] >= 15000
    assert len(seen) >= 3, seen  # replaced more than once


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_local_cluster_left_without_workers_stops_the_campaign(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker of the local cluster gone and none coming back (a lifetime restart that timed
    out on a loaded host left a campaign polling an empty cluster for ever): after
    ``NO_WORKERS_SECONDS`` the campaign stops as failed, with a reason that says so, checkpointed
    for ``resume``. The scheduler is made to report no worker once a task has finished."""
    import time

    from optimizer.campaign.config import parse_config
    from optimizer.campaign.lifecycle import run_campaign
    from tests.farm.conftest import small_config

    monkeypatch.setattr(farm_module, "TRIM_SECONDS", 0.5)
    monkeypatch.setattr(farm_module, "NO_WORKERS_SECONDS", 2.0)
    original = Farm.restart_old_workers
    emptied: list[float] = []

    def empty_cluster(self):
        if self.counters["tasks_done"] >= 1:
            if not emptied:
                emptied.append(time.monotonic())
            info = self.client.scheduler_info
            self.client.scheduler_info = lambda **kw: {**info(**kw), "workers": {}}
            try:
                return original(self)
            finally:
                self.client.scheduler_info = info
        return original(self)

    monkeypatch.setattr(Farm, "restart_old_workers", empty_cluster)
    db = str(tmp_path / "empty.db")
    cfg = parse_config(small_config("empty", db, budget={"evaluations": 10_000_000}))
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"worker_lifetime": 3600.0})})
    res = run_campaign(cfg, quiet=True)
    assert emptied, "the campaign ended before the cluster was emptied"
    assert res["status"] == "failed" and "no worker for" in res["reason"] and "resume" in res["reason"], res
    assert time.monotonic() - emptied[0] < 60  # stopped soon after (it polled for ever before)
    assert 0 < res["evaluations"] < 10_000_000


def test_a_restarted_worker_s_nanny_is_not_closed_as_lost() -> None:
    """Dask's SpecCluster closes a worker's nanny when no worker of its name is registered
    ``lost-worker-timeout`` after the worker left; a lifetime restart that left such a timer
    behind closed the nanny if the timer fired while the worker was away again (two restarts
    within 15 s on a loaded host), and the campaign lost its only worker. A timer of 10 ms fires
    while the restarted worker process is still starting, every time."""
    import time

    import dask

    from optimizer.campaign.cluster import dask_client

    with dask_client(None, 1) as client:
        for _ in range(2):
            (w,) = client.scheduler_info()["workers"]
            with dask.config.set({"distributed.deploy.lost-worker-timeout": "10ms"}):
                client.restart_workers([w], raise_for_error=False)
                time.sleep(1.0)  # the timers fire
            client.wait_for_workers(1, timeout=60)
            assert len(client.scheduler_info()["workers"]) == 1
            assert client.submit(sum, [1, 2], pure=False).result(timeout=60) == 3
