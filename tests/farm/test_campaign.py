"""Campaigns end to end: run, status, export, resume; crashes of the driver and of a worker;
two campaigns on one SQLite file; PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from optimizer.search.pareto import dominates
from tests.farm.conftest import cli, popen_cli, small_config, write_config


def rows(db: str, sql: str) -> list[dict]:
    return json.loads(cli("sql", sql, "--db", db, "--format", "json", check=True).stdout)


def front_points(db: str, name: str) -> np.ndarray:
    r = rows(db, "SELECT e.makespan, e.peak_memory FROM front f JOIN evaluations e ON e.candidate_id = f.candidate_id "
                 f"JOIN campaigns c ON c.id = f.campaign_id WHERE c.name = '{name}' AND f.left_at IS NULL")
    return np.array([[x["makespan"], x["peak_memory"]] for x in r])


def eps_dominated_by(p: np.ndarray, F: np.ndarray, eps: float = 0.01) -> bool:
    """Whether some row of ``F`` ε-dominates ``p``: the front archive's guarantee for every point it
    was ever offered (``EpsilonBoxArchive``: a newcomer may replace a member of its ε-box that it
    does not Pareto-dominate, so plain weak dominance is not promised and failed now and then)."""
    return bool(np.any(np.all(F <= p * (1 + eps), axis=1)))


@pytest.mark.slow
def test_run_status_export_resume(tmp_path, db):
    cfg = write_config(tmp_path, small_config("c1", db))
    run = cli("run", str(cfg), "--db", db, "--quiet", check=True)
    assert "finished (evaluation budget spent)" in run.stdout  # the run names the budget that stopped it
    st = json.loads(cli("status", "c1", "--db", db, "--json", check=True).stdout)
    assert st["campaign"]["status"] == "finished"
    n1 = st["campaign"]["counters"]["evaluations"]
    assert 1500 <= n1 <= 1500 + 5 and len(st["front"]) >= 2 and st["hypervolume"] > 0  # within a task's length
    assert st["best_gap"] >= 1.0  # nothing beats the lower bound
    seq = rows(db, "SELECT count(*) AS n, max(seq) AS s FROM evaluations")[0]
    assert seq["n"] == seq["s"]  # every archived evaluation has its own sequence number

    out = tmp_path / "export"
    cli("export", "c1", "--db", db, "--out", str(out), check=True)
    table = pq.read_table(out / "front.parquet").to_pydict()
    assert len(table["digest"]) == len(st["front"])
    assert (out / "pareto.png").stat().st_size > 1000
    summary = (out / "summary.md").read_text()
    assert "single-device" in summary and "data-parallel-8" in summary and "| what it does |" in summary
    assert " on 8 devices" in summary or "single device" in summary
    plans = sorted((out / "plans").glob("*.json"))
    assert len(plans) == len(st["front"])
    assert cli("graph", "validate", str(plans[0]), check=True).returncode == 0
    assert cli("verify", str(plans[0]), check=True).returncode == 0

    # a larger budget continues the same campaign: counters and sequence numbers go on
    res = cli("resume", "c1", "--db", db, "--evaluations", "3000", "--quiet", check=True)
    st2 = json.loads(cli("status", "c1", "--db", db, "--json", check=True).stdout)
    # the run's report gives the front's best gap, as status does (it gave the resumed run's own best)
    assert f"best gap to bound {st2['best_gap']:.2f}×" in " ".join(res.stdout.split()), res.stdout
    assert st2["campaign"]["counters"]["evaluations"] >= 3000 > n1
    assert st2["hypervolume"] >= st["hypervolume"] - 1e-12
    seq2 = rows(db, "SELECT count(*) AS n, max(seq) AS s, min(seq) AS lo FROM evaluations")[0]
    assert seq2["n"] == seq2["s"] and seq2["lo"] == 1 and seq2["n"] > seq["n"]

    # exporting again replaces the earlier export's plans: none is stale
    (out / "plans" / "99_0123456789ab.json").write_text("{}")
    cli("export", "c1", "--db", db, "--out", str(out), check=True)
    names = {p.stem.split("_", 1)[1] for p in (out / "plans").glob("*.json")}
    assert names == {r["digest"][:12] for r in st2["front"]}


@pytest.mark.slow
def test_resume_refuses_a_changed_problem(tmp_path, db):
    cli("run", str(write_config(tmp_path, small_config("c2", db, budget={"evaluations": 300}))), "--db", db,
        "--quiet", check=True)
    for change in ({"hardware": "h200-sxm-8"}, {"objectives": ["makespan", "energy"]},
                   {"workload": {"name": "mlp", "params": {"batch": 32, "widths": [256, 1024, 256]}}}):
        cfg = small_config("c2", db, **change)
        res = cli("resume", "c2", "--db", db, "--config", str(write_config(tmp_path, cfg)))
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert "may only change its budget" in " ".join(res.stderr.split())
    checkpoints = rows(db, "SELECT count(*) AS n FROM checkpoints")[0]["n"]
    # the search's settings are the problem's too (a new population or strategy was ignored, exit 0)
    for change in ({"search": {"population": 7}}, {"search": {"strategy": "random"}}):
        cfg = small_config("c2", db, budget={"evaluations": 5000}, **change)
        res = cli("resume", "c2", "--db", db, "--config", str(write_config(tmp_path, cfg)))
        assert res.returncode == 2 and "changes search" in " ".join(res.stderr.split()), res.stderr
    # a finished campaign resumed without a new budget would stop at once (it exited 0, adding a checkpoint)
    for extra in ((), ("--config", str(write_config(tmp_path, small_config("c2", db, budget={"evaluations": 100}))))):
        res = cli("resume", "c2", "--db", db, *extra)
        assert res.returncode == 2 and "has spent its evaluation budget" in " ".join(res.stderr.split()), res.stderr
        assert "--evaluations" in res.stderr and "Traceback" not in res.stderr
    assert rows(db, "SELECT count(*) AS n FROM checkpoints")[0]["n"] == checkpoints
    assert rows(db, "SELECT status FROM campaigns WHERE name = 'c2'")[0]["status"] == "finished"


def _wait_for(db: str, name: str, n: int, timeout: float = 120) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            r = rows(db, f"SELECT count(*) AS n FROM evaluations e JOIN campaigns c ON c.id = e.campaign_id "
                         f"WHERE c.name = '{name}'")
            if r[0]["n"] >= n:
                return
        except AssertionError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"campaign {name} did not reach {n} archived evaluations in {timeout} s")


@pytest.mark.slow
def test_driver_killed_with_sigkill_then_resumed(tmp_path, db):
    cfg = write_config(tmp_path, small_config("crash", db, budget={"evaluations": 10**9, "wall_time": 600},
                                              cluster={"workers": 2}))
    proc = popen_cli("run", str(cfg), "--db", db, "--quiet")
    try:
        _wait_for(db, "crash", 60)
        time.sleep(1.5)  # let a checkpoint land mid-campaign
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its local cluster, no clean-up
        proc.wait(timeout=30)
    before = {r["id"]: r for r in rows(db, "SELECT id, seq, makespan FROM evaluations")}
    counters = json.loads(rows(db, "SELECT counters_json FROM campaigns WHERE name='crash'")[0]["counters_json"])
    F_before = front_points(db, "crash")
    assert len(before) >= 60 and len(F_before) >= 1

    target = counters["evaluations"] + 1500
    cli("resume", "crash", "--db", db, "--evaluations", str(target), "--quiet", check=True)
    after = {r["id"]: r for r in rows(db, "SELECT id, seq, makespan FROM evaluations")}
    assert all(after[i] == r for i, r in before.items())  # no committed evaluation lost or changed
    assert max(r["seq"] for r in after.values()) > max(r["seq"] for r in before.values())
    assert len({r["seq"] for r in after.values()}) == len(after)  # sequence numbers continue, no reuse
    c2 = json.loads(rows(db, "SELECT counters_json, status FROM campaigns WHERE name='crash'")[0]["counters_json"])
    assert c2["evaluations"] >= target > counters["evaluations"]
    F_after = front_points(db, "crash")
    assert all(eps_dominated_by(p, F_after) for p in F_before)  # the front only improves (up to its ε-boxes)


@pytest.mark.slow
def test_campaign_survives_a_killed_worker(tmp_path, db):
    import threading

    from distributed import Client, LocalCluster

    from optimizer.campaign.config import parse_config
    from optimizer.campaign.lifecycle import run_campaign
    from storage import Archive

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    try:
        client = Client(cluster)
        pids = list(client.run(os.getpid).values())
        cfg = parse_config(small_config("wk", db, budget={"evaluations": 12000}, search={"steps_per_task": 150}))
        killed_at: list[int] = []

        def killer():  # kill a worker once the campaign is under way
            t0 = time.time()
            while time.time() - t0 < 120:
                try:
                    with Archive.open(db, readonly=True) as a:
                        n = a.evaluation_count("wk")
                except Exception:  # noqa: BLE001  (not created yet)
                    n = 0
                if n >= 5:
                    os.kill(pids[0], signal.SIGKILL)
                    killed_at.append(n)
                    return
                time.sleep(0.2)

        t = threading.Thread(target=killer, daemon=True)
        t.start()
        res = run_campaign(cfg, scheduler=cluster.scheduler_address, quiet=True)
        t.join()
        assert killed_at, "the worker was never killed"
        assert res["status"] == "finished" and res["evaluations"] >= 12000
        with Archive.open(db, readonly=True) as a:
            assert a.evaluation_count("wk") > killed_at[0]  # the campaign went on after the kill
        assert pids[0] not in client.run(os.getpid).values()  # a new worker process replaced it
        client.close()
    finally:
        cluster.close()


@pytest.mark.slow
def test_two_campaigns_on_one_sqlite_file(tmp_path, db):
    procs = [popen_cli("run", str(write_config(tmp_path, small_config(n, db, budget={"evaluations": 2500}))),
                       "--db", db, "--quiet") for n in ("twin_a", "twin_b")]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    for n in ("twin_a", "twin_b"):
        r = rows(db, f"SELECT count(*) AS n, max(e.seq) AS s FROM evaluations e JOIN campaigns c "
                     f"ON c.id = e.campaign_id WHERE c.name = '{n}'")[0]
        assert r["n"] == r["s"] > 0  # every result the driver numbered is in the file
        assert rows(db, f"SELECT status FROM campaigns WHERE name = '{n}'")[0]["status"] == "finished"


@pytest.mark.postgres
def test_campaign_on_postgresql(tmp_path):
    url = os.environ.get("TAPESTRY_PG_URL")
    if not url:
        if os.environ.get("CI"):
            pytest.fail("CI must provide TAPESTRY_PG_URL (see .ci/run)")
        pytest.skip("no PostgreSQL server: set TAPESTRY_PG_URL")
    name = f"pg_{os.getpid()}_{int(time.time())}"
    cfg = write_config(tmp_path, small_config(name, url, budget={"evaluations": 800}))
    cli("run", str(cfg), "--db", url, "--quiet", check=True)
    st = json.loads(cli("status", name, "--db", url, "--json", check=True).stdout)
    assert st["campaign"]["status"] == "finished" and len(st["front"]) >= 1
    res = cli("sql", "DELETE FROM evaluations", "--db", url)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    n = rows(url, f"SELECT count(*) AS n FROM evaluations e JOIN campaigns c ON c.id = e.campaign_id "
                  f"WHERE c.name = '{name}'")[0]["n"]
    assert n > 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optuna-nsga2", "optuna-tpe", "random"])
def test_other_strategies_run_and_share_the_archive(tmp_path, db, strategy):
    import optuna

    name = strategy.replace("-", "_")
    cfg = small_config(name, db, budget={"evaluations": 500}, search={"strategy": strategy, "steps_per_task": 80})
    cli("run", str(write_config(tmp_path, cfg)), "--db", db, "--quiet", check=True)
    st = json.loads(cli("status", name, "--db", db, "--json", check=True).stdout)
    assert st["campaign"]["status"] == "finished" and len(st["front"]) >= 1
    if strategy.startswith("optuna"):
        # the study lives in the same database, so optuna-dashboard can browse it
        study = optuna.load_study(study_name=name, storage=f"sqlite:///{db}")
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        assert len(done) >= 4 and len(done[0].values) == 2
        assert study.metric_names == ["makespan", "peak_memory"]


@pytest.mark.slow
def test_resume_refuses_while_the_driver_is_alive(tmp_path, db):
    cfg = write_config(tmp_path, small_config("live", db, budget={"evaluations": 10**9, "wall_time": 120}))
    proc = popen_cli("run", str(cfg), "--db", db, "--quiet")
    try:
        _wait_for(db, "live", 20)
        res = cli("resume", "live", "--db", db)
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert "is running" in " ".join(res.stderr.split())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # a clean stop: checkpoint, status paused
        proc.wait(timeout=60)
    assert rows(db, "SELECT status FROM campaigns WHERE name = 'live'")[0]["status"] == "paused"
