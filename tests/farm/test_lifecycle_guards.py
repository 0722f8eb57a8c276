"""Campaign lifecycle guards (issue 14): no phantom campaigns, validated resume budgets, no empty
archive created by a forgotten --db, a killed driver's campaign shown as interrupted, and a
resume that extends what the user asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from optimizer.campaign import lifecycle
from optimizer.campaign.cluster import ClusterError
from optimizer.campaign.config import BudgetConfig, ConfigError, budget_with, parse_config
from optimizer.cli import main
from storage import Archive
from tests.farm.conftest import small_config


def _names(db: str) -> list[str]:
    with Archive.open(db, readonly=True) as a:
        return [c["name"] for c in a.list_campaigns()]


def test_unreachable_scheduler_leaves_no_campaign(tmp_path, monkeypatch):
    db = str(tmp_path / "farm.db")

    def unreachable(*a, **k):
        raise ClusterError("cannot reach the Dask scheduler at 'tcp://10.0.0.1:8786'")

    monkeypatch.setattr(lifecycle, "_cluster", unreachable)
    cfg = parse_config(small_config("phantom", db))
    with pytest.raises(ClusterError):
        lifecycle.run_campaign(cfg, db, quiet=True)
    assert "phantom" not in _names(db)  # the name is free for the next try


def test_failure_after_start_marks_the_campaign_failed(tmp_path, monkeypatch):
    db = str(tmp_path / "farm.db")

    class Boom(RuntimeError):
        pass

    def boom(*a, **k):
        raise Boom("strategy cannot start")

    monkeypatch.setattr(lifecycle, "_cluster", lambda *a, **k: _null())
    monkeypatch.setattr(lifecycle, "make_strategy", boom)
    with pytest.raises(Boom):
        lifecycle.run_campaign(parse_config(small_config("half", db)), db, quiet=True)
    with Archive.open(db, readonly=True) as a:
        assert a.get_campaign("half")["status"] == "failed"  # not a phantom "running"


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_resume_budget_validation_and_extension():
    b = BudgetConfig(evaluations=5000, wall_time=90)
    done = {"evaluations": 5000, "wall_seconds": 95.0, "hv_improved_at": 4000}
    with pytest.raises(ConfigError, match="--evaluations"):
        budget_with(b, done, -5, None, "resume q")
    with pytest.raises(ConfigError, match="--wall-time"):
        budget_with(b, done, None, -1, "resume q")
    with pytest.raises(ConfigError, match="must exceed the 5000 evaluations"):
        budget_with(b, done, 4000, None, "resume q")
    new, notes = budget_with(b, done, 20000, None, "resume q")
    assert new.evaluations == 20000 and new.wall_time is None  # the spent wall-time budget no longer stops it
    assert any("wall-time budget (90 s) was spent" in n for n in notes)
    new, notes = budget_with(b, done, 20000, 600, "resume q")
    assert (new.evaluations, new.wall_time, notes) == (20000, 600, [])


def test_commands_without_db_never_create_an_archive(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TAPESTRY_DB", raising=False)
    for argv in (["resume", "quickstart", "--quiet"], ["status"], ["status", "quickstart"],
                 ["export", "quickstart", "--out", "o"], ["sql", "SELECT 1"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "no archive at 'tapestry.db'" in err and "Traceback" not in err, argv
    assert not (tmp_path / "tapestry.db").exists() and not (tmp_path / "o").exists()


def _running_with_driver(db: str, name: str, driver: dict) -> None:
    with Archive.open(db) as a:
        a.create_campaign(name, {"config": small_config(name, db), "base_digest": "0" * 64}, "h",
                          ["makespan", "peak_memory"], [1.0, 1.0])
        a.set_status(name, "running")
        a.update_counters(name, {"driver": driver, "evaluations": 10})


def test_status_shows_a_killed_drivers_campaign_as_interrupted(tmp_path, capsys):
    db = str(tmp_path / "farm.db")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _running_with_driver(db, "killed", {"host": lifecycle.socket.gethostname(), "pid": dead.pid,
                                        "started": 0.0})
    _running_with_driver(db, "alive", lifecycle.driver_identity())
    st = lifecycle.campaign_status(db, None)
    status = {c["name"]: c["status"] for c in st["campaigns"]}
    assert status == {"killed": "interrupted", "alive": "running"}
    with pytest.raises(SystemExit):
        main(["status", "killed", "--db", db])
    out = capsys.readouterr().out
    assert "interrupted" in out and "tapestry resume killed" in out
    # pid reuse: a live process with another start time is not the driver
    _running_with_driver(db, "reused", {"host": lifecycle.socket.gethostname(), "pid": os.getpid(),
                                        "started": 12345.0})
    assert lifecycle.campaign_status(db, "reused")["campaign"]["status"] == "interrupted"
    # another host: judged by the heartbeat
    _running_with_driver(db, "remote", {"host": "elsewhere", "pid": 1, "started": 1.0})
    row = lifecycle.campaign_status(db, "remote")["campaign"]
    assert row["status"] == "running" and "elsewhere" in row["driver_note"]
    with Archive.open(db) as a:
        with pytest.raises(ConfigError, match="is running"):
            lifecycle.check_not_running(a.get_campaign("remote"))
        lifecycle.check_not_running(a.get_campaign("killed"))  # a dead driver does not block resume


def test_status_json_is_plain(tmp_path, capsys):
    db = str(tmp_path / "farm.db")
    _running_with_driver(db, "c", lifecycle.driver_identity())
    with pytest.raises(SystemExit):
        main(["status", "c", "--db", db, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["campaign"]["status"] == "running" and doc["campaign"]["stored_status"] == "running"


def _spec(steps: int = 200):
    from optimizer.search.worker import SearchTaskSpec, TaskConstraints

    return SearchTaskSpec(parents=(("d", "{}"),) * 4, hardware={}, objectives=("makespan",),
                          constraints=TaskConstraints(True, None, None), max_shards_per_op=None, seed=(1,),
                          steps=steps, weights={"rewrite": 1.0}, adaptive=True, returns=16, mode="evolve",
                          time_limit=None)


def _farm(budget):
    import numpy as np

    from optimizer.campaign.farm import Farm

    return Farm("c", None, None, None, ["makespan"], np.ones(1), budget, 0.01, 5.0, np.random.default_rng(0))


def test_tasks_are_cut_to_the_budget_left():
    """Budgets overshot (6,236 evaluations for 5,000; 129 s for 90 s): tasks now get the room left."""
    from optimizer.campaign.farm import Budget

    farm = _farm(Budget(1000, 90.0, None))
    farm.counters["evaluations"] = 900
    fit = farm._fit(_spec())
    assert fit.steps == 96 and fit.max_evaluations() == 100 and 0 < fit.time_limit <= 90
    farm._in_flight[object()] = (None, fit, {}, 0)
    assert farm._evaluations_room() == 0  # nothing more is submitted
    unlimited = _farm(Budget(None, None, 100))._fit(_spec())
    assert unlimited.steps == 200 and unlimited.time_limit is None
    assert _farm(Budget(10**6, None, None)).exhausted() is None


def test_specs_round_trip_and_read_old_checkpoints():
    from optimizer.search.worker import SearchTaskSpec

    s = _spec()
    assert SearchTaskSpec.from_json(s.to_json()) == s
    old = s.to_json()
    del old["time_limit"]  # a checkpoint written before time limits
    assert SearchTaskSpec.from_json(old) == s


def test_progress_says_compiling_until_the_first_task_returns():
    import numpy as np

    from optimizer.campaign.farm import Budget
    from optimizer.campaign.progress import Progress

    farm = _farm(Budget(5000, 90.0, None))
    farm.counters["evaluations"] = 3
    p = Progress("q", quiet=True, budget=farm.budget)
    s = p.snapshot(farm)
    assert s["phase"] == "compiling" and s["rate"] == 0.0 and s["elapsed"] >= 0
    ev, tm = p._budget_text(s)
    assert ev == "3 of 5,000 (0%)" and tm.endswith("of 90 s")
    farm.counters["tasks_done"] = 1
    assert p.snapshot(farm)["phase"] == "searching"
    assert np.isfinite(p.snapshot(farm)["rate"])


def test_cupy_sampling_without_cupy_fails_at_start(tmp_path, capsys):
    from executor.backend import BackendError, get_backend

    try:
        get_backend("cupy")
        pytest.skip("CuPy works here")
    except BackendError:
        pass
    db = str(tmp_path / "farm.db")
    cfg = tmp_path / "gpu.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump(small_config("gpu", db, sampling={"rate": 0.5, "backend": "cupy"})))
    with pytest.raises(SystemExit) as e:
        main(["run", str(cfg), "--db", db, "--quiet"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "sampling.backend is cupy" in err and "Traceback" not in err
    assert not os.path.exists(db)


def test_workers_validate_plans_read_from_the_archive():
    """A corrupted or hand-edited plan row fails its task with the plan's problems, before any step."""
    import dataclasses

    from ir import workloads
    from ir.serialize import InvalidGraph, dumps
    from optimizer.realrun.sampling import MeasureTaskSpec, measure_task
    from optimizer.search.worker import search_task

    doc = json.loads(dumps(workloads.mlp(batch=8, widths=(16, 32, 8))))
    doc["ops"][0]["shards"]["device"] = [-3]
    bad = json.dumps(doc)
    with pytest.raises(InvalidGraph, match="negative"):
        search_task(dataclasses.replace(_spec(), parents=(("d" * 64, bad),)))
    with pytest.raises(InvalidGraph, match="negative"):
        measure_task(MeasureTaskSpec("d" * 64, bad, "numpy", 1, {}))


def test_of_two_drivers_claiming_a_campaign_only_one_gets_it(tmp_path):
    """Two resumes started together both passed the liveness check (the campaign became
    ``running`` only seconds later, inside the farm) and both ran, writing duplicate sequence
    numbers. The check and the mark are now one transaction (``Archive.claim``): the second
    claim sees the first driver alive and is refused, changing nothing."""
    db = str(tmp_path / "claim.db")
    with Archive.open(db) as a:
        a.create_campaign("c", {"config": {}}, "h", ["makespan"], [1.0])
        a.set_status("c", "paused")
        check = lambda row: lifecycle.check_not_running(row)  # noqa: E731
        a.claim("c", check, {"driver": lifecycle.driver_identity()})
        row = a.get_campaign("c")
        assert row["status"] == "running" and row["counters"]["driver"]["pid"] == os.getpid()
        other = {**lifecycle.driver_identity(), "pid": os.getpid() + 1}
        with pytest.raises(ConfigError, match="is running"):
            a.claim("c", check, {"driver": other})
        assert a.get_campaign("c")["counters"]["driver"]["pid"] == os.getpid()


def test_ctrl_c_before_the_farm_runs_pauses_the_campaign(tmp_path, monkeypatch):
    """Ctrl-C in a driver's first seconds (before the farm installs its own handler) left the
    campaign ``failed``, a resumed finished one included; it is a pause, as Ctrl-C is later."""
    db = str(tmp_path / "farm.db")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(lifecycle, "_cluster", lambda *a, **k: _null())
    monkeypatch.setattr(lifecycle, "make_strategy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lifecycle.run_campaign(parse_config(small_config("early", db)), db, quiet=True)
    with Archive.open(db, readonly=True) as a:
        assert a.get_campaign("early")["status"] == "paused"


def test_an_export_stopped_midway_leaves_a_summary_with_its_plans(tmp_path, monkeypatch):
    """An export deleted the earlier export's plans first and wrote its summary last: killed in
    between, the folder held a summary listing plans that were gone. Stale plans are removed
    last now, so either summary finds its plans."""
    from costmodel.presets import PRESETS
    from ir import workloads
    from ir.rewrites import place, split
    from ir.serialize import dumps
    from optimizer.campaign import export

    db = str(tmp_path / "e.db")
    g = workloads.build("mlp", batch=8, widths=[16, 32, 16])
    plans = [g, place(split(g, "fc1", "o", 2), "fc1", [0, 1])]
    with Archive.open(db) as a:
        a.create_campaign("e", {"config": {}, "hardware": PRESETS["h100-sxm-8"].to_dict(), "base_digest": g.digest},
                          "h", ["makespan", "peak_memory"], [1.0, 1e12])
        for seq, (p, t) in enumerate(zip(plans, (2e-3, 1e-3)), start=1):
            a.record_merge("e", [{"digest": p.digest, "graph_json": dumps(p), "seq": seq, "feasible": True,
                                  "objectives": {"makespan": t, "energy": 1.0, "peak_memory": 1e9 / seq,
                                                 "devices": seq, "bytes_moved": 0.0}}],
                           entered=[p.digest], front_seq=seq)
    out = tmp_path / "out"
    export.export_campaign("e", str(out), db)
    before = sorted(p.name for p in (out / "plans").glob("*.json"))
    assert len(before) == 2
    (out / "plans" / "07_0123456789ab.json").write_text("{}")  # a plan of an export before that one
    for suffix in (".py", ".placements.json"):  # and its generated program (``export --program``)
        (out / "plans" / f"07_0123456789ab{suffix}").write_text("{}")
    better = place(split(g, "fc1", "o", 4), "fc1", [0, 1, 2, 3])  # the search goes on: a new best plan
    with Archive.open(db) as a:
        a.record_merge("e", [{"digest": better.digest, "graph_json": dumps(better), "seq": 3, "feasible": True,
                              "objectives": {"makespan": 5e-4, "energy": 1.0, "peak_memory": 2e8, "devices": 4,
                                             "bytes_moved": 0.0}}], entered=[better.digest], front_seq=3)

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "_summary", killed)
    with pytest.raises(KeyboardInterrupt):
        export.export_campaign("e", str(out), db)
    listed = (out / "summary.md").read_text()
    assert all((out / "plans" / n).exists() for n in before) and all(n[3:15] in listed for n in before)
    monkeypatch.undo()
    export.export_campaign("e", str(out), db)
    now = sorted(p.name for p in (out / "plans").glob("*.json"))  # the new front's names, no stale one
    assert len(now) == 3 and now[0].endswith(f"{better.digest[:12]}.json") and "07_0123456789ab.json" not in now
    # a stale program ran and printed PASS for a plan no longer on the front
    assert not list((out / "plans").glob("07_*"))
