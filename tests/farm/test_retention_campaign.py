"""Retention from the campaign's side: the driver compacts by itself; ``tapestry archive
compact`` keeps the front, its lineage and objectives (same hypervolume); resume continues after
it; a running driver is refused; bad ``retention`` settings exit 2."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from ir.rewrites import RewriteError, random_rewrite, unshard
from ir.serialize import dumps
from ir.workloads import build
from optimizer.campaign.plans import replay_rewrite
from optimizer.search.mutation import Crossover
from storage import Archive, NotReplayable
from tests.farm.conftest import cli, popen_cli, small_config, write_config


def _status(db: str, name: str) -> dict:
    return json.loads(cli("status", name, "--db", db, "--json", check=True).stdout)


def _lineage_ok(archive: Archive, name: str, digest: str) -> int:
    """Walk a candidate's parents while they are stored; every step's plan must be readable."""
    steps = 0
    fetch = lambda d: archive.get_graph_json(name, d, replay=replay_rewrite)  # noqa: E731
    frame = archive.evaluations_frame(name)
    parent_of = dict(zip(frame["digest"], frame["parent_digest"]))
    while digest is not None and digest in parent_of:
        assert json.loads(fetch(digest))
        digest = parent_of[digest]
        steps += 1
    return steps


@pytest.mark.slow  # a local Dask cluster, 800 + 400 evaluations and five CLI calls: ~40 s on an idle machine
def test_compaction_keeps_the_front_and_resume_continues(tmp_path, db):
    """The driver compacts by itself (every second here), then ``tapestry archive compact`` by
    hand: front, hypervolume, counts and lineage survive; resume and export replay deltas."""
    cfg = write_config(tmp_path, small_config(
        "rc", db, budget={"evaluations": 800},
        retention={"enabled": True, "every_seconds": 1, "grace_seconds": 0, "interval_seconds": 5}))
    cli("run", str(cfg), "--db", db, "--quiet", check=True)
    before = _status(db, "rc")
    assert before["campaign"]["counters"]["retention"]["runs"] >= 1
    with Archive.open(db, readonly=True) as a:
        count, last = a.evaluation_count("rc"), a.last_seq("rc")
        folded = sum(i["evaluations"] for i in a.evaluation_intervals("rc"))
    assert count >= before["progress"]["archive_rows"]["evaluations"] + folded > 0
    res = cli("archive", "compact", "rc", "--db", db, "--grace-seconds", "0", "--json", check=True)
    report = json.loads(res.stdout)
    assert report["rows_after"]["candidates"] <= report["rows_before"]["candidates"]
    after = _status(db, "rc")
    # Deltas are checked after the hand compaction: whether the driver's own last compaction
    # (every second, timed by the machine's load) saw a child of a kept parent is luck.
    assert after["progress"]["archive_rows"]["candidates_delta"] > 0
    key = lambda r: r["digest"]  # noqa: E731
    assert sorted(before["front"], key=key) == sorted(after["front"], key=key)
    assert after["hypervolume"] == before["hypervolume"]
    with Archive.open(db, readonly=True) as a:
        assert (a.evaluation_count("rc"), a.last_seq("rc")) == (count, last)
        for r in after["front"]:
            _lineage_ok(a, "rc", r["digest"])
    # Compacting again changes nothing; resume goes on from the compacted archive.
    again = json.loads(cli("archive", "compact", "rc", "--db", db, "--grace-seconds", "0", "--json",
                           check=True).stdout)
    assert again["deleted_candidates"] == 0 and again["dropped_plans"] == 0
    cli("resume", "rc", "--db", db, "--evaluations", "1200", "--quiet", check=True)
    st = _status(db, "rc")
    assert st["campaign"]["counters"]["evaluations"] >= 1200
    assert st["hypervolume"] >= before["hypervolume"] - 1e-12
    out = tmp_path / "export"
    cli("export", "rc", "--db", db, "--out", str(out), check=True)
    assert len(list((out / "plans").glob("*.json"))) == len(st["front"])
    assert (out / "progress.png").stat().st_size > 1000


@pytest.mark.slow
def test_compact_refuses_while_the_driver_runs(tmp_path, db):
    cfg = write_config(tmp_path, small_config("live", db, budget={"evaluations": 10**9, "wall_time": 300}))
    proc = popen_cli("run", str(cfg), "--db", db, "--quiet")
    try:
        t0 = time.time()
        while time.time() - t0 < 120:
            st = cli("status", "live", "--db", db, "--json")
            if st.returncode == 0 and json.loads(st.stdout)["campaign"]["counters"].get("driver"):
                break
            time.sleep(0.5)
        res = cli("archive", "compact", "live", "--db", db)
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert "while its driver runs" in " ".join(res.stderr.split())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.slow
def test_bad_retention_settings_exit_2(tmp_path, db):
    for bad, field in (({"history": "everything"}, "retention.history"),
                       ({"every_seconds": -1}, "retention.every_seconds"),
                       ({"max_delta_depth": 10**6}, "retention.max_delta_depth"),
                       ({"keep": "all"}, "retention.keep")):
        res = cli("run", str(write_config(tmp_path, small_config("bad", db, retention=bad))), "--db", db)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert field in res.stderr
    assert not os.path.exists(db) or "bad" not in cli("status", "--db", db).stdout
    res = cli("archive", "compact", "nope", "--db", db, "--history", "all")
    assert res.returncode == 2 and "--history" in res.stderr


def test_replay_rewrite_rebuilds_random_rewrites() -> None:
    rng = np.random.default_rng(0)
    g = unshard(build("transformer"))
    replayed = 0
    for _ in range(40):
        try:
            child, move = random_rewrite(g, rng, 8, max_shards_per_op=16)
        except RewriteError:
            continue
        text, digest = replay_rewrite(dumps(g, indent=None), str(move))
        assert digest == child.digest and json.loads(text)
        replayed += 1
        g = child
    assert replayed >= 30


def test_replay_rewrite_refuses_a_crossover_as_lineage_only() -> None:
    g = unshard(build("mlp"))
    text = str(Crossover("ab" * 32, ("fc1",)))
    with pytest.raises(NotReplayable, match="crossover"):
        replay_rewrite(dumps(g, indent=None), text)
