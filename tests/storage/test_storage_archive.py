"""Archive round trips, on every backend (fixtures in conftest.py)."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from storage_testkit import OBJECTIVES, REFERENCE_POINT, digest_of, graph_json, new_campaign, result

from storage import (
    Archive,
    CampaignExists,
    CampaignNotFound,
    CandidateNotFound,
    InvalidRecord,
    ReadOnlyViolation,
    StorageError,
    run_readonly_query,
)

CAMPAIGN = "mlp-h100x8"


def _count(url: str, table: str) -> int:
    return run_readonly_query(url, f"SELECT count(*) FROM {table}")[1][0][0]


# ---------------------------------------------------------------------- campaigns


def test_campaign_round_trip(archive: Archive) -> None:
    before = datetime.now(UTC) - timedelta(seconds=5)
    cid = new_campaign(archive, CAMPAIGN)
    got = archive.get_campaign(CAMPAIGN)
    assert got["id"] == cid
    assert got["name"] == CAMPAIGN
    assert got["config"] == {
        "workload": "mlp",
        "hardware": "h100_sxm_x8",
        "strategy": {"kind": "island", "seed": 7},
    }
    assert got["config_hash"] == "cfg-" + digest_of(CAMPAIGN)[:16]
    assert got["status"] == "created"
    assert got["objectives"] == OBJECTIVES
    assert got["reference_point"] == REFERENCE_POINT
    assert got["counters"] == {}
    assert got["created_at"].tzinfo is not None
    assert before < got["created_at"] <= got["updated_at"] < before + timedelta(minutes=5)

    new_campaign(archive, "transformer-h200x64")
    assert [c["name"] for c in archive.list_campaigns()] == [CAMPAIGN, "transformer-h200x64"]

    archive.set_status(CAMPAIGN, "running")
    assert archive.get_campaign(CAMPAIGN)["status"] == "running"
    assert archive.get_campaign("transformer-h200x64")["status"] == "created"

    merged = archive.update_counters(CAMPAIGN, {"evaluations": 1200, "islands": 4})
    assert merged == {"evaluations": 1200, "islands": 4}
    merged = archive.update_counters(CAMPAIGN, {"evaluations": 1500, "migrations": 2})
    assert merged == {"evaluations": 1500, "islands": 4, "migrations": 2}
    assert archive.increment_counters(CAMPAIGN, {"evaluations": 10, "restarts": 1}) == {
        "evaluations": 1510,
        "islands": 4,
        "migrations": 2,
        "restarts": 1,
    }
    assert archive.get_campaign(CAMPAIGN)["counters"]["evaluations"] == 1510


def test_duplicate_campaign_refused(archive: Archive, db_url: str) -> None:
    new_campaign(archive, CAMPAIGN)
    with pytest.raises(CampaignExists, match="already exists") as info:
        new_campaign(archive, CAMPAIGN)
    assert f"tapestry resume {CAMPAIGN}" in str(info.value)
    assert len(archive.list_campaigns()) == 1
    assert _count(db_url, "campaigns") == 1


def test_missing_campaign_message(archive: Archive) -> None:
    new_campaign(archive, CAMPAIGN)
    with pytest.raises(CampaignNotFound) as info:
        archive.get_campaign("mlp-h100x9")
    message = str(info.value)
    assert "'mlp-h100x9'" in message
    assert "tapestry status" in message
    assert f"Did you mean '{CAMPAIGN}'?" in message
    assert isinstance(info.value, LookupError)
    for call in (
        lambda: archive.set_status("nope", "running"),
        lambda: archive.add_results("nope", [result("a", 1)]),
        lambda: archive.current_front("nope"),
        lambda: archive.latest_checkpoint("nope"),
        lambda: archive.measurements("nope"),
        lambda: archive.evaluation_count("nope"),
    ):
        with pytest.raises(CampaignNotFound, match="'nope'"):
            call()


def test_bad_campaign_arguments(archive: Archive) -> None:
    with pytest.raises(InvalidRecord, match="reference_point"):
        archive.create_campaign("c", {}, "h", OBJECTIVES, [1.0, 2.0])
    with pytest.raises(InvalidRecord, match="reference_point"):
        archive.create_campaign("c", {}, "h", ["makespan"], [math.inf])
    with pytest.raises(InvalidRecord, match="config"):
        archive.create_campaign("c", {"x": object()}, "h", ["makespan"], [1.0])
    new_campaign(archive, CAMPAIGN)
    with pytest.raises(InvalidRecord, match="unknown campaign status 'done'"):
        archive.set_status(CAMPAIGN, "done")
    with pytest.raises(InvalidRecord, match="must be a number"):
        archive.increment_counters(CAMPAIGN, {"evaluations": "1"})
    assert archive.list_campaigns()[0]["status"] == "created"


# ---------------------------------------------------------------------- results


def test_add_results_round_trip(archive: Archive, db_url: str) -> None:
    new_campaign(archive, CAMPAIGN)
    root = result("root", 1, rewrite=None, devices=1, makespan=0.08)
    child = result("child", 2, parent=root["digest"], makespan=0.021)
    infeasible = result("huge", 3, parent=root["digest"], makespan=math.inf, feasible=False)
    infeasible["gap"] = math.nan  # unknown gap is stored as NULL
    infeasible["lower_bound"] = None
    assert archive.add_results(CAMPAIGN, [root, child, infeasible]) == 3

    # Re-evaluating a stored candidate records the evaluation but not the candidate.
    again = result("child", 4, parent=root["digest"], makespan=0.020)
    dup_in_batch = result("new", 5)
    assert archive.add_results(CAMPAIGN, [again, dup_in_batch, dict(dup_in_batch, seq=6)]) == 1
    assert archive.evaluation_count(CAMPAIGN) == 6
    assert archive.last_seq(CAMPAIGN) == 6
    assert _count(db_url, "candidates") == 4
    assert archive.add_results(CAMPAIGN, []) == 0

    assert archive.get_graph_json(CAMPAIGN, child["digest"]) == graph_json("child")
    assert json.loads(archive.get_graph_json(CAMPAIGN, root["digest"]))["tag"] == "root"
    with pytest.raises(CandidateNotFound, match=digest_of("x")):
        archive.get_graph_json(CAMPAIGN, digest_of("x"))

    frame = archive.evaluations_frame(CAMPAIGN)
    assert list(frame["seq"]) == [1, 2, 3, 4, 5, 6]
    assert frame["seq"].dtype == np.int64 and frame["devices"].dtype == np.int64
    assert frame["feasible"].dtype == np.bool_
    assert list(frame["digest"]) == [
        root["digest"],
        child["digest"],
        infeasible["digest"],
        child["digest"],
        dup_in_batch["digest"],
        dup_in_batch["digest"],
    ]
    row = frame.iloc[1]
    assert row["parent_digest"] == root["digest"]
    assert row["rewrite"] == "split{op=fc1,dim=o,parts=4}"
    assert row["makespan"] == 0.021
    assert row["energy"] == pytest.approx(0.021 * 700 * 4)
    assert row["peak_memory"] == 3.5e9 + 2
    assert row["devices"] == 4
    assert row["bytes_moved"] == 5e8
    assert row["lower_bound"] == 0.0105
    assert row["gap"] == 1.0
    assert row["worker"] == "tcp://127.0.0.1:40001"
    assert row["eval_seconds"] == 0.0031
    assert isinstance(row["evaluated_at"], pd.Timestamp) and str(row["evaluated_at"].tz) == "UTC"
    assert pd.isna(frame.iloc[0]["rewrite"]) and pd.isna(frame.iloc[0]["parent_digest"])
    assert math.isinf(frame.iloc[2]["makespan"]) and not frame.iloc[2]["feasible"]
    assert math.isnan(frame.iloc[2]["gap"]) and math.isnan(frame.iloc[2]["lower_bound"])


def test_evaluations_frame_empty(archive: Archive) -> None:
    new_campaign(archive, CAMPAIGN)
    frame = archive.evaluations_frame(CAMPAIGN)
    assert len(frame) == 0
    assert "makespan" in frame.columns and frame["makespan"].dtype == np.float64
    assert archive.evaluation_count(CAMPAIGN) == 0
    assert archive.last_seq(CAMPAIGN) is None


def test_results_are_per_campaign(archive: Archive) -> None:
    new_campaign(archive, "a")
    new_campaign(archive, "b")
    item = result("same-plan", 1)
    assert archive.add_results("a", [item]) == 1
    assert archive.add_results("b", [item]) == 1  # same digest, other campaign: new candidate
    with pytest.raises(CandidateNotFound):
        archive.get_graph_json("b", result("only-a", 2)["digest"])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda r: r.pop("seq"), "missing seq"),
        (lambda r: r.update(parent="x"), "unknown parent"),
        (lambda r: r.update(digest="ABC"), "SHA-256"),
        (lambda r: r["objectives"].update(makespan=float("nan")), "NaN"),
        (lambda r: r["objectives"].pop("energy"), "exactly makespan"),
        (lambda r: r["objectives"].update(devices=2.5), "integer"),
        (lambda r: r.update(graph_json={"not": "text"}), "graph_json"),
    ],
)
def test_add_results_rejects_malformed_items(archive: Archive, change, match: str) -> None:
    new_campaign(archive, CAMPAIGN)
    good = result("good", 1)
    bad = result("bad", 2)
    change(bad)
    with pytest.raises(InvalidRecord, match=match) as info:
        archive.add_results(CAMPAIGN, [good, bad])
    assert "item 1" in str(info.value)
    assert archive.evaluation_count(CAMPAIGN) == 0  # nothing of the batch stored


def test_numpy_scalars_accepted(archive: Archive) -> None:
    new_campaign(archive, CAMPAIGN)
    item = result("np", 1)
    item["objectives"] = {k: np.float64(v) for k, v in item["objectives"].items()}
    item["objectives"]["devices"] = np.int64(4)
    item["feasible"] = np.bool_(True)
    item["seq"] = np.int64(1)
    assert archive.add_results(CAMPAIGN, [item]) == 1
    assert archive.evaluations_frame(CAMPAIGN).iloc[0]["devices"] == 4


# ---------------------------------------------------------------------- front


def test_front_round_trip(archive: Archive) -> None:
    new_campaign(archive, CAMPAIGN)
    a, b, c = (result(t, i, makespan=0.01 * (i + 1)) for i, t in enumerate("abc"))
    archive.add_results(CAMPAIGN, [a, b, c])
    a_again = result("a", 7, makespan=0.005)  # re-evaluation: the front shows the latest
    archive.add_results(CAMPAIGN, [a_again])

    archive.update_front(CAMPAIGN, entered=[a["digest"], b["digest"]], left=[], seq=3)
    archive.update_front(CAMPAIGN, entered=[c["digest"], a["digest"]], left=[b["digest"]], seq=9)

    front = archive.current_front(CAMPAIGN)
    assert [f["digest"] for f in front] == [a["digest"], c["digest"]]
    first = front[0]
    assert first["objectives"] == a_again["objectives"]
    assert first["entered_seq"] == 3
    assert first["gap"] == 1.0 and first["feasible"] is True
    assert first["lower_bound"] == a_again["lower_bound"]
    assert first["rewrite"] == "split{op=fc1,dim=o,parts=4}"
    assert first["parent_digest"] is None
    assert first["entered_at"].tzinfo is not None
    assert front[1]["entered_seq"] == 9 and front[1]["objectives"] == c["objectives"]

    history = archive.front_history(CAMPAIGN)
    assert [(h["digest"], h["entered_seq"], h["left_seq"]) for h in history] == [
        (a["digest"], 3, None),
        (b["digest"], 3, 9),
        (c["digest"], 9, None),
    ]
    assert history[1]["left_at"] is not None and history[0]["left_at"] is None

    # b re-enters later: a second stay.
    archive.update_front(CAMPAIGN, entered=[b["digest"]], left=[a["digest"]], seq=12)
    assert [f["digest"] for f in archive.current_front(CAMPAIGN)] == [c["digest"], b["digest"]]
    assert len(archive.front_history(CAMPAIGN)) == 4


def test_front_refuses_unknown_or_contradictory_digests(archive: Archive) -> None:
    new_campaign(archive, CAMPAIGN)
    a = result("a", 1)
    archive.add_results(CAMPAIGN, [a])
    unknown = digest_of("never stored")
    with pytest.raises(CandidateNotFound, match=unknown):
        archive.update_front(CAMPAIGN, entered=[a["digest"], unknown], left=[], seq=2)
    assert archive.current_front(CAMPAIGN) == []  # the failed call changed nothing
    with pytest.raises(InvalidRecord, match="both enter and leave"):
        archive.update_front(CAMPAIGN, entered=[a["digest"]], left=[a["digest"]], seq=2)


def test_record_merge_is_one_transaction(archive: Archive) -> None:
    new_campaign(archive, CAMPAIGN)
    a, b = result("a", 1), result("b", 2)
    assert (
        archive.record_merge(
            CAMPAIGN, [a, b], entered=[a["digest"], b["digest"]], counters={"seq": 2}
        )
        == 2
    )
    assert [f["entered_seq"] for f in archive.current_front(CAMPAIGN)] == [2, 2]
    assert archive.get_campaign(CAMPAIGN)["counters"] == {"seq": 2}

    c = result("c", 3)
    archive.record_merge(CAMPAIGN, [c], entered=[c["digest"]], left=[a["digest"]], front_seq=3)
    assert [f["digest"] for f in archive.current_front(CAMPAIGN)] == [b["digest"], c["digest"]]
    assert archive.get_campaign(CAMPAIGN)["counters"] == {"seq": 2}  # counters=None: unchanged

    # A failing front change leaves results and counters untouched too.
    with pytest.raises(CandidateNotFound):
        archive.record_merge(
            CAMPAIGN,
            [result("d", 4)],
            entered=[digest_of("unknown")],
            counters={"seq": 4},
        )
    assert archive.evaluation_count(CAMPAIGN) == 3
    assert archive.get_campaign(CAMPAIGN)["counters"] == {"seq": 2}
    with pytest.raises(InvalidRecord, match="front_seq"):
        archive.record_merge(CAMPAIGN, [], entered=[a["digest"]])
    assert archive.record_merge(CAMPAIGN, [], counters={"seq": 3}) == 0
    assert archive.get_campaign(CAMPAIGN)["counters"] == {"seq": 3}


# ---------------------------------------------------------------------- measurements


def test_measurements_round_trip(archive: Archive) -> None:
    new_campaign(archive, CAMPAIGN)
    plan = result("plan", 1)
    archive.add_results(CAMPAIGN, [plan])
    when = datetime(2025, 3, 1, 12, 30, tzinfo=UTC)
    records = [
        {
            "campaign": CAMPAIGN,
            "plan_digest": plan["digest"],
            "kind": "plan",
            "backend": "cupy",
            "device_name": "NVIDIA H100 80GB HBM3",
            "measured_seconds": 0.0142,
            "predicted_seconds": 0.0125,
            "verified": True,
            "max_rel_error": 3.1e-6,
            "details": {"repeats": 20, "events": "cuda"},
            "measured_at": when,
        },
        {
            "campaign": CAMPAIGN,
            "plan_digest": plan["digest"],
            "kind": "shard",
            "backend": "cupy",
            "device_name": "NVIDIA H100 80GB HBM3",
            "op": "fc1",
            "shard": 3,
            "measured_seconds": 0.0009,
            "predicted_seconds": 0.0008,
        },
        {  # calibration kernel, no campaign
            "plan_digest": digest_of("matmul-4096"),
            "kind": "kernel",
            "backend": "numpy",
            "device_name": "cpu",
            "op": "matmul",
            "measured_seconds": 0.31,
        },
    ]
    assert archive.add_measurements(records) == 3
    assert archive.add_measurements([]) == 0

    everything = archive.measurements()
    assert len(everything) == 3
    first = everything[0]
    assert first["campaign"] == CAMPAIGN and first["candidate_digest"] == plan["digest"]
    assert first["measured_seconds"] == 0.0142 and first["predicted_seconds"] == 0.0125
    assert first["verified"] is True and first["max_rel_error"] == 3.1e-6
    assert first["details"] == {"repeats": 20, "events": "cuda"}
    assert first["measured_at"] == when
    assert everything[1]["op"] == "fc1" and everything[1]["shard"] == 3
    assert everything[1]["verified"] is None and everything[1]["details"] == {}
    kernel = everything[2]
    assert kernel["campaign"] is None and kernel["candidate_digest"] is None
    assert kernel["backend"] == "numpy" and kernel["kind"] == "kernel"

    assert [m["kind"] for m in archive.measurements(CAMPAIGN)] == ["plan", "shard"]


def test_measurements_reject_bad_values(archive: Archive) -> None:
    base = {
        "plan_digest": digest_of("p"),
        "kind": "plan",
        "backend": "numpy",
        "device_name": "cpu",
        "measured_seconds": 1.0,
    }
    with pytest.raises(InvalidRecord, match="backend 'torch'"):
        archive.add_measurements([dict(base, backend="torch")])
    with pytest.raises(InvalidRecord, match="kind 'op'"):
        archive.add_measurements([dict(base, kind="op")])
    with pytest.raises(CampaignNotFound):
        archive.add_measurements([dict(base, campaign="ghost")])
    assert archive.measurements() == []


# ---------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_and_pruning(archive: Archive, db_url: str) -> None:
    new_campaign(archive, CAMPAIGN)
    new_campaign(archive, "other")
    assert archive.latest_checkpoint(CAMPAIGN) is None
    rng = np.random.default_rng(1234)
    rng.random(10)
    state = {
        "archive": [digest_of("a"), digest_of("b")],
        "populations": [[digest_of("a")], [digest_of("b")]],
        "rng": rng.bit_generator.state,  # 128-bit integers survive JSON
        "counters": {"evaluations": 5000, "generation": 12},
        "best": math.inf,
    }
    archive.save_checkpoint("other", 1, {"n": 0})
    for seq in (100, 200, 300, 400, 500):
        archive.save_checkpoint(CAMPAIGN, seq, dict(state, seq=seq))

    latest = archive.latest_checkpoint(CAMPAIGN)
    assert latest is not None and latest["seq"] == 500
    assert latest["state"]["seq"] == 500
    assert latest["state"]["rng"] == rng.bit_generator.state
    assert latest["state"]["best"] == math.inf
    assert latest["created_at"].tzinfo is not None
    restored = np.random.default_rng()
    restored.bit_generator.state = latest["state"]["rng"]
    assert restored.random() == rng.random()

    _, rows = run_readonly_query(
        db_url,
        "SELECT c.name, k.seq FROM checkpoints k JOIN campaigns c ON c.id = k.campaign_id "
        "ORDER BY c.name, k.seq",
    )
    assert rows == [(CAMPAIGN, 300), (CAMPAIGN, 400), (CAMPAIGN, 500), ("other", 1)]
    with pytest.raises(InvalidRecord, match="plain JSON"):
        archive.save_checkpoint(CAMPAIGN, 600, {"rng": object()})
    assert archive.latest_checkpoint(CAMPAIGN)["seq"] == 500


# ---------------------------------------------------------------------- export


def test_export_front_parquet(archive: Archive, tmp_path) -> None:
    new_campaign(archive, CAMPAIGN)
    root = result("root", 1, rewrite=None, devices=1, makespan=0.08)
    fast = result("fast", 2, parent=root["digest"], devices=8, makespan=0.011)
    lean = result("lean", 3, parent=root["digest"], devices=2, makespan=0.04)
    archive.add_results(CAMPAIGN, [root, fast, lean])
    archive.update_front(CAMPAIGN, [root["digest"]], [], seq=1)
    archive.update_front(CAMPAIGN, [fast["digest"], lean["digest"]], [root["digest"]], seq=3)

    path = tmp_path / "out" / "front.parquet"
    assert archive.export_front_parquet(CAMPAIGN, path) == 2
    table = pq.read_table(path)
    frame = table.to_pandas()
    assert list(frame["digest"]) == [fast["digest"], lean["digest"]]
    assert set(frame["campaign"]) == {CAMPAIGN}
    assert list(frame["parent_digest"]) == [root["digest"], root["digest"]]
    assert list(frame["rewrite"]) == ["split{op=fc1,dim=o,parts=4}"] * 2
    assert list(frame["makespan"]) == [0.011, 0.04]
    assert list(frame["devices"]) == [8, 2]
    assert list(frame["energy"]) == [fast["objectives"]["energy"], lean["objectives"]["energy"]]
    assert list(frame["peak_memory"]) == [3.5e9 + 2, 3.5e9 + 3]
    assert list(frame["bytes_moved"]) == [1e9, 2.5e8]
    assert list(frame["feasible"]) == [True, True]
    assert list(frame["gap"]) == [1.0, 1.0]
    assert list(frame["entered_seq"]) == [3, 3]
    assert str(frame["entered_at"].dt.tz) == "UTC"
    meta = table.schema.metadata
    assert json.loads(meta[b"tapestry.objectives"]) == OBJECTIVES
    assert json.loads(meta[b"tapestry.reference_point"]) == REFERENCE_POINT

    # An empty front still gives a readable file with the schema.
    new_campaign(archive, "empty")
    assert archive.export_front_parquet("empty", tmp_path / "empty.parquet") == 0
    assert pq.read_table(tmp_path / "empty.parquet").column_names == table.column_names


# ---------------------------------------------------------------------- modes


def test_readonly_archive_refuses_writes(archive: Archive, db_url: str) -> None:
    new_campaign(archive, CAMPAIGN)
    archive.add_results(CAMPAIGN, [result("a", 1)])
    with Archive.open(db_url, readonly=True) as reader:
        assert reader.readonly
        assert reader.get_campaign(CAMPAIGN)["name"] == CAMPAIGN
        assert reader.evaluation_count(CAMPAIGN) == 1
        with pytest.raises(ReadOnlyViolation, match="read-only"):
            reader.set_status(CAMPAIGN, "running")
        with pytest.raises(ReadOnlyViolation):
            reader.add_results(CAMPAIGN, [result("b", 2)])
    assert archive.evaluation_count(CAMPAIGN) == 1
    assert archive.get_campaign(CAMPAIGN)["status"] == "created"


def test_closed_archive(db_url: str) -> None:
    archive = Archive.open(db_url)
    archive.close()
    archive.close()
    with pytest.raises(StorageError, match="closed"):
        archive.list_campaigns()


def test_reopen_keeps_data(db_url: str) -> None:
    with Archive.open(db_url) as first:
        new_campaign(first, CAMPAIGN)
        first.add_results(CAMPAIGN, [result("a", 1)])
    with Archive.open(db_url) as second:
        assert second.evaluation_count(CAMPAIGN) == 1
        assert "Archive(" in repr(second)
