"""Several processes writing one archive at once (spawned, as Dask workers are).

On SQLite these pass only because every write transaction starts with BEGIN IMMEDIATE: with a
deferred BEGIN the read-then-write transactions fail with "database is locked" or interleave.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

import storage_testkit
from storage_testkit import new_campaign, result

from storage import Archive, run_readonly_query

CAMPAIGN = "concurrent"
N_WORKERS = 2


def _run_workers(target: Callable[..., None], url: str, count: int) -> list[tuple[Any, ...]]:
    """Run ``target`` in N_WORKERS spawned processes started together; return their reports."""
    # Spawned children import the target from storage_testkit (on sys.path via conftest.py).
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(N_WORKERS)
    reports = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(url, CAMPAIGN, w, count, barrier, reports))
        for w in range(N_WORKERS)
    ]
    for p in procs:
        p.start()
    out = [reports.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    errors = [r[2] for r in out if r[0] == "error"]
    assert not errors, "\n".join(errors)
    return out


def test_two_processes_add_results_without_losing_rows(db_url: str) -> None:
    n_batches = 220
    with Archive.open(db_url) as archive:
        new_campaign(archive, CAMPAIGN)
    reports = _run_workers(storage_testkit.write_batches, db_url, n_batches)

    # Each batch: 3 candidates of its own + 1 shared by both workers (stored once).
    assert sum(r[2] for r in reports) == N_WORKERS * n_batches * 3 + n_batches
    with Archive.open(db_url) as archive:
        assert archive.evaluation_count(CAMPAIGN) == N_WORKERS * n_batches * 4
    _, rows = run_readonly_query(db_url, "SELECT count(*), count(DISTINCT digest) FROM candidates")
    assert rows == [(N_WORKERS * n_batches * 3 + n_batches,) * 2]
    _, rows = run_readonly_query(
        db_url,
        "SELECT count(*) FROM evaluations e JOIN candidates c ON c.id = e.candidate_id "
        "WHERE c.digest = '" + result("shared-b7", 0)["digest"] + "'",
    )
    assert rows == [(N_WORKERS,)]


def test_two_processes_read_modify_write_counters(db_url: str) -> None:
    """BEGIN IMMEDIATE (SQLite) / FOR UPDATE (PostgreSQL): no increment is lost."""
    n_increments = 200
    with Archive.open(db_url) as archive:
        new_campaign(archive, CAMPAIGN)
    _run_workers(storage_testkit.increment_counter, db_url, n_increments)
    with Archive.open(db_url) as archive:
        counters = archive.get_campaign(CAMPAIGN)["counters"]
    assert counters == {
        "evaluations": N_WORKERS * n_increments,
        **{f"w{w}": n_increments for w in range(N_WORKERS)},
    }


def test_two_processes_open_a_fresh_archive(db_url: str) -> None:
    """Concurrent first opens both run the migration; it must happen exactly once."""
    _run_workers(storage_testkit.open_fresh, db_url, 1)
    with Archive.open(db_url) as archive:
        names = sorted(c["name"] for c in archive.list_campaigns())
    assert names == [f"{CAMPAIGN}-{w}" for w in range(N_WORKERS)]


def test_threads_share_one_archive(archive: Archive) -> None:
    new_campaign(archive, CAMPAIGN)
    failures: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(40):
                archive.add_results(CAMPAIGN, [result(f"t{worker}-{i}", i)])
                archive.increment_counters(CAMPAIGN, {"n": 1})
                archive.current_front(CAMPAIGN)
        except BaseException as exc:  # collected and asserted below
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert archive.evaluation_count(CAMPAIGN) == 160
    assert archive.get_campaign(CAMPAIGN)["counters"] == {"n": 160}
