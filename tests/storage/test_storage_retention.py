"""Retention and compaction: what is kept, deltas, intervals, crash safety, the 0001 -> 0002
migration of an old archive."""

from __future__ import annotations

import json
import os
import zlib
import re
import signal
import subprocess
import sys
import textwrap

import pytest
from sqlalchemy import text
from storage_testkit import (
    OBJECTIVES,
    REFERENCE_POINT,
    digest_of,
    graph_json,
    new_campaign,
    result,
)

from storage import Archive, NotReplayable, PlanNotKept, StorageError
from storage.migrate import current_revision, head_revision, upgrade
from storage.retention import RetentionPolicy

CAMPAIGN = "mlp-h100x8"
NOW = RetentionPolicy(grace_seconds=0.0)  # tests compact everything, however recent
THIN = RetentionPolicy(grace_seconds=0.0, deltas=False)  # the same, without deltas (no note about replay)


def retag(tag: str) -> str:
    """The rewrite text that turns any plan into ``graph_json(tag)`` under :func:`replay`."""
    return f"retag{{tag={tag}}}"


def replay(parent_json: str, rewrite: str) -> tuple[str, str]:
    """A real replay for the test's plans: applies a ``retag`` rewrite, refuses anything else."""
    match = re.fullmatch(r"retag\{tag=([\w-]+)\}", rewrite)
    if match is None or '"tag"' not in parent_json:
        raise ValueError(f"cannot replay {rewrite!r}")
    child = graph_json(match.group(1))
    return child, digest_of(child)


def _item(tag: str, seq: int, parent: str | None, **kw: object) -> dict:
    pd = None if parent is None else digest_of(graph_json(parent))
    rewrite = kw.pop("rewrite", retag(tag))
    return result(tag, seq, parent=pd, rewrite=rewrite, **kw)  # type: ignore[arg-type]


def d(tag: str) -> str:
    return digest_of(graph_json(tag))


def build(archive: Archive, noise: int = 30) -> dict[str, list[str]]:
    """A campaign with every kind of candidate the policy distinguishes.

    baseline b0 -> c1 -> c2 -> c3 (front); f2 (front, child of b0); e1 (was on the front, left);
    s1 (sampled); k1 (named by a checkpoint); x0..x{noise-1} (plain search results).
    """
    new_campaign(archive, CAMPAIGN)
    seq = iter(range(1, 10_000))
    items = [
        _item("b0", next(seq), None, rewrite="baseline:single-device", makespan=0.05),
        _item("c1", next(seq), "b0", makespan=0.04),
        _item("c2", next(seq), "c1", makespan=0.03),
        _item("c3", next(seq), "c2", makespan=0.01, devices=8),
        _item("f2", next(seq), "b0", makespan=0.02, devices=2),
        _item("e1", next(seq), "b0", makespan=0.025, devices=4),
        _item("s1", next(seq), "b0", makespan=0.06),
        _item("k1", next(seq), "c1", makespan=0.07),
    ]
    items += [
        _item(f"x{i}", next(seq), "c1" if i % 2 else "b0", makespan=0.1 + i) for i in range(noise)
    ]
    items.append(_item("x0", next(seq), "b0", makespan=0.1))  # a second evaluation of x0
    archive.add_results(CAMPAIGN, items)
    archive.update_front(CAMPAIGN, [d("c3"), d("f2"), d("e1")], [], 10)
    archive.update_front(CAMPAIGN, [], [d("e1")], 20)
    archive.add_measurements(
        [{"campaign": CAMPAIGN, "plan_digest": d("s1"), "kind": "plan", "backend": "numpy",
          "device_name": "cpu", "measured_seconds": 0.5}]
    )
    archive.save_checkpoint(CAMPAIGN, 40, {"strategy": {"islands": [[{"digest": d("k1")}]]}})
    return {
        "plans": ["b0", "c1", "c2", "c3", "f2", "s1", "k1"],
        "rows_only": ["e1"],
        "gone": [f"x{i}" for i in range(noise)],
    }


def _kinds(archive: Archive) -> dict[str, str]:
    with archive.engine.connect() as conn:
        rows = conn.execute(text("SELECT digest, plan_kind FROM candidates")).all()
    return {digest: kind for digest, kind in rows}


def test_compaction_keeps_what_the_policy_names(archive: Archive) -> None:
    sets = build(archive)
    front = archive.current_front(CAMPAIGN)
    history = archive.front_history(CAMPAIGN)
    count, last = archive.evaluation_count(CAMPAIGN), archive.last_seq(CAMPAIGN)
    report = archive.compact(CAMPAIGN, NOW)  # no replay: plans stay full
    assert report["deleted_candidates"] == 30 and report["aggregated_evaluations"] == 31
    assert report["plan_set"] == 7 and report["row_set"] == 8
    assert archive.current_front(CAMPAIGN) == front  # members, objectives, lineage fields
    assert archive.front_history(CAMPAIGN) == history
    assert archive.evaluation_count(CAMPAIGN) == count == 39
    assert archive.last_seq(CAMPAIGN) == last
    kinds = _kinds(archive)
    for tag in sets["plans"]:
        assert kinds[d(tag)] == "full"
        assert archive.get_graph_json(CAMPAIGN, d(tag)) == graph_json(tag)
    assert kinds[d("e1")] == "dropped"
    with pytest.raises(PlanNotKept, match="retention policy kept only"):
        archive.get_graph_json(CAMPAIGN, d("e1"))
    assert not {d(t) for t in sets["gone"]} & set(kinds)
    frame = archive.evaluations_frame(CAMPAIGN)
    assert set(frame["digest"]) == {d(t) for t in sets["plans"] + sets["rows_only"]}
    intervals = archive.evaluation_intervals(CAMPAIGN)
    assert sum(i["evaluations"] for i in intervals) == 31
    assert min(i["min_makespan"] for i in intervals) == pytest.approx(0.1)
    assert min(i["min_seq"] for i in intervals) == 9 and max(i["max_seq"] for i in intervals) == 39
    stats = archive.storage_stats(CAMPAIGN)
    assert stats["rows"]["candidates"] == 8 and stats["rows"]["candidates_dropped"] == 1
    assert stats["rows"]["evaluations"] == 8 and stats["bytes"] > 0
    # Idempotent: a second run finds nothing to do.
    again = archive.compact(CAMPAIGN, NOW)
    assert again["deleted_candidates"] == again["dropped_plans"] == again["deltas"] == 0
    assert archive.evaluation_count(CAMPAIGN) == 39


def test_objectives_history_keeps_every_row(archive: Archive) -> None:
    sets = build(archive)
    archive.compact(CAMPAIGN, RetentionPolicy(history="objectives", grace_seconds=0))
    kinds = _kinds(archive)
    assert len(kinds) == 38
    assert {kinds[d(t)] for t in sets["gone"] + sets["rows_only"]} == {"dropped"}
    assert archive.evaluation_intervals(CAMPAIGN) == []
    assert len(archive.evaluations_frame(CAMPAIGN)) == 39


def test_grace_period_leaves_recent_candidates(archive: Archive) -> None:
    build(archive)
    report = archive.compact(CAMPAIGN, RetentionPolicy(grace_seconds=3600))
    assert report["deleted_candidates"] == report["dropped_plans"] == 0
    assert len(_kinds(archive)) == 38


def test_deltas_replay_to_the_same_plan(archive: Archive) -> None:
    sets = build(archive)
    report = archive.compact(CAMPAIGN, NOW, replay=replay)
    kinds = _kinds(archive)
    # Every plan-set member with a plan-set parent becomes a delta; the baseline stays full.
    assert kinds[d("b0")] == "full"
    assert {kinds[d(t)] for t in ("c1", "c2", "c3", "f2", "s1", "k1")} == {"delta"}
    assert report["deltas"] == 6
    for tag in sets["plans"]:
        assert archive.get_graph_json(CAMPAIGN, d(tag), replay=replay) == graph_json(tag)
    with pytest.raises(StorageError, match="stored as a delta"):
        archive.get_graph_json(CAMPAIGN, d("c3"))
    stats = archive.storage_stats(CAMPAIGN)["rows"]
    assert stats["candidates_delta"] == 6 and stats["candidates_full"] == 1


def test_delta_depth_is_capped_and_bad_replays_keep_the_full_plan(archive: Archive) -> None:
    build(archive)
    archive.compact(CAMPAIGN, RetentionPolicy(grace_seconds=0, max_delta_depth=1), replay=replay)
    kinds = _kinds(archive)
    assert kinds[d("c1")] == "delta" and kinds[d("c2")] == "full" and kinds[d("c3")] == "delta"

    def wrong(parent_json: str, rewrite: str) -> tuple[str, str]:
        return parent_json, digest_of(parent_json)  # replays to the parent: digest mismatch

    other = archive.compact(CAMPAIGN, NOW, replay=wrong)
    assert other["deltas"] == 0 and other["delta_failures"] >= 1
    assert _kinds(archive)[d("c2")] == "full"


def test_lineage_only_rewrites_stay_whole_without_counting_as_failures(archive: Archive) -> None:
    build(archive)

    def lineage_only(parent_json: str, rewrite: str) -> tuple[str, str]:
        raise NotReplayable(f"{rewrite!r} records lineage only")

    report = archive.compact(CAMPAIGN, NOW, replay=lineage_only)
    assert report["deltas"] == 0 and report["delta_failures"] == 0 and report["not_replayable"] >= 6
    assert {_kinds(archive)[d(t)] for t in ("c1", "c2", "c3")} == {"full"}


def test_a_dropped_plan_found_again_is_stored_again(archive: Archive) -> None:
    build(archive)
    archive.compact(CAMPAIGN, NOW)
    archive.add_results(CAMPAIGN, [_item("e1", 100, "b0")])
    assert archive.get_graph_json(CAMPAIGN, d("e1")) == graph_json("e1")
    archive.add_results(CAMPAIGN, [_item("x3", 101, "b0")])  # deleted earlier: stored anew
    assert archive.get_graph_json(CAMPAIGN, d("x3")) == graph_json("x3")


def test_policy_refuses_bad_values() -> None:
    from storage import InvalidRecord

    with pytest.raises(InvalidRecord, match="history"):
        RetentionPolicy(history="everything")
    with pytest.raises(InvalidRecord, match="interval_seconds"):
        RetentionPolicy(interval_seconds=0)
    with pytest.raises(InvalidRecord, match="max_delta_depth"):
        RetentionPolicy(max_delta_depth=-1)



def _bulky(tag: str, seq: int) -> dict:
    """A search result whose plan is ~6 kB of incompressible text: on PostgreSQL it goes to
    TOAST, like a real plan, so dead rows there show in the archive's size."""
    item = result(tag, seq)
    text = json.dumps({"tag": tag, "pad": os.urandom(3000).hex()})
    item.update(graph_json=text, digest=digest_of(text))
    return item


def test_compaction_reuses_the_space_of_deleted_rows(archive: Archive, db_url: str) -> None:
    """Rounds of 300 results, each thinned away by compaction: the archive stops growing after
    the first round (PostgreSQL: the VACUUM after compaction; SQLite: its freelist). Without
    the VACUUM, PostgreSQL grows by the dead rows of every round (~1 MB each here)."""
    new_campaign(archive, CAMPAIGN)
    sizes, seq = [], 0
    for rnd in range(5):
        items = [_bulky(f"r{rnd}-{i}", seq + i + 1) for i in range(300)]
        seq += len(items)
        archive.add_results(CAMPAIGN, items)
        report = archive.compact(CAMPAIGN, THIN)
        assert report["deleted_candidates"] == 300 and not report["notes"]
        assert (report["vacuum_seconds"] > 0) == db_url.startswith("postgresql")
        sizes.append(archive.storage_stats(CAMPAIGN)["bytes"])
    assert archive.evaluation_count(CAMPAIGN) == 1500  # folded into intervals, still counted
    assert sizes[-1] <= sizes[1] * 1.15, f"archive grew over rounds: {sizes}"


def test_a_failed_vacuum_is_noted_not_raised(archive: Archive, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy.exc import OperationalError

    import storage.archive

    def refuse(engine, tables):  # noqa: ARG001
        raise OperationalError("VACUUM", {}, Exception("server closed the connection"))

    monkeypatch.setattr(storage.archive, "reclaim_space", refuse)
    build(archive)
    report = archive.compact(CAMPAIGN, THIN)
    assert report["deleted_candidates"] == 30 and report["vacuum_seconds"] == 0.0
    assert report["notes"] == ["VACUUM failed (OperationalError: (builtins.Exception) server closed the connection)"]
    assert archive.evaluation_count(CAMPAIGN) == 39  # the compaction itself committed

_KILLER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_storage_retention import replay
    from storage import Archive
    from storage.retention import RetentionPolicy, _CHUNK
    import storage.retention as r
    r._CHUNK = 7  # many small steps, so the kill lands between two of them

    def die(step):
        if step == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)

    with Archive.open({url!r}) as a:
        a.compact("{campaign}", RetentionPolicy(grace_seconds=0), replay=replay, after_step=die)
    """
)


@pytest.mark.parametrize("kill_at", [1, 3])
def test_kill_9_during_compaction_loses_nothing_kept(db_url: str, kill_at: int) -> None:
    with Archive.open(db_url) as archive:
        sets = build(archive, noise=40)
        front = archive.current_front(CAMPAIGN)
        count = archive.evaluation_count(CAMPAIGN)
    script = _KILLER.format(
        tests=os.path.dirname(__file__), url=db_url, campaign=CAMPAIGN, kill_at=kill_at
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with Archive.open(db_url) as archive:
        # Halfway: every kept plan readable, counts exact (no chunk half-applied).
        assert archive.current_front(CAMPAIGN) == front
        assert archive.evaluation_count(CAMPAIGN) == count
        for tag in sets["plans"]:
            assert archive.get_graph_json(CAMPAIGN, d(tag), replay=replay) == graph_json(tag)
        archive.compact(CAMPAIGN, NOW, replay=replay)  # finishes the job
        assert archive.evaluation_count(CAMPAIGN) == count
        assert len(_kinds(archive)) == 8
        for tag in sets["plans"]:
            assert archive.get_graph_json(CAMPAIGN, d(tag), replay=replay) == graph_json(tag)


def test_an_old_archive_migrates_with_its_data(tmp_path) -> None:
    """A 0001 archive file (written before retention existed) opens, keeps every row as a full
    plan, and can then be compacted."""
    url = os.path.join(tmp_path, "old.db")
    upgrade(url, "0001")
    from storage import make_engine

    engine = make_engine(url)
    with engine.begin() as conn:  # rows as the 0001 code wrote them (no plan_kind column)
        conn.execute(
            text(
                "INSERT INTO campaigns (id, name, config_json, config_hash, status, created_at, "
                "updated_at, reference_point_json, objectives_json, counters_json) VALUES (1, "
                "'old', '{}', 'h', 'paused', '2025-01-01 00:00:00', '2025-01-01 00:00:00', "
                ":ref, :obj, '{}')"
            ),
            {"ref": json.dumps(REFERENCE_POINT), "obj": json.dumps(OBJECTIVES)},
        )
        for i, tag in enumerate(("b0", "x1", "x2"), start=1):
            conn.execute(
                text("INSERT INTO candidates (id, campaign_id, digest, graph_zlib, parent_digest, "
                     "rewrite, created_at) "
                     "VALUES (:i, 1, :d, :g, NULL, :r, '2025-01-01 00:00:00')"),
                {"i": i, "d": d(tag), "g": zlib.compress(graph_json(tag).encode()),
                 "r": "baseline:x" if tag == "b0" else retag(tag)},
            )
            conn.execute(
                text("INSERT INTO evaluations (campaign_id, candidate_id, makespan, energy, "
                     "peak_memory, devices, bytes_moved, feasible, evaluated_at, seq) VALUES "
                     "(1, :i, 0.1, 1.0, 1e9, 1, 0.0, 1, '2025-01-01 00:00:00', :i)"),
                {"i": i},
            )
        conn.execute(text("INSERT INTO front (campaign_id, candidate_id, entered_at, entered_seq) "
                          "VALUES (1, 2, '2025-01-01 00:00:00', 2)"))
    engine.dispose()
    assert current_revision(url) == "0001"
    with Archive.open(url) as archive:
        assert current_revision(archive.engine) == head_revision()
        assert set(_kinds(archive).values()) == {"full"}
        assert archive.get_graph_json("old", d("x2")) == graph_json("x2")
        assert [r["digest"] for r in archive.current_front("old")] == [d("x1")]
        archive.compact("old", NOW)
        assert set(_kinds(archive)) == {d("b0"), d("x1")}
        assert archive.evaluation_count("old") == 3
