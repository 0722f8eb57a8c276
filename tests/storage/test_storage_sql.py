"""Read-only SQL (``tapestry sql``) and result formatting, on every backend."""

from __future__ import annotations

import csv
import io
import json
import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from storage_testkit import new_campaign, result

from storage import (
    Archive,
    MultipleStatements,
    QueryError,
    ReadOnlyViolation,
    format_rows,
    run_readonly_query,
)
from storage.sql import split_statements

CAMPAIGN = "mlp-h100x8"
TABLES = ["campaigns", "candidates", "evaluations", "front", "measurements", "checkpoints"]


@pytest.fixture
def filled(archive: Archive, db_url: str) -> str:
    new_campaign(archive, CAMPAIGN)
    items = [result(f"p{i}", i, makespan=0.01 * (i + 1)) for i in range(5)]
    archive.add_results(CAMPAIGN, items)
    archive.update_front(CAMPAIGN, [items[0]["digest"], items[1]["digest"]], [], seq=5)
    archive.save_checkpoint(CAMPAIGN, 5, {"n": 5})
    archive.add_measurements(
        [
            {
                "campaign": CAMPAIGN,
                "plan_digest": items[0]["digest"],
                "kind": "plan",
                "backend": "numpy",
                "device_name": "cpu",
                "measured_seconds": 0.2,
            }
        ]
    )
    return db_url


def _snapshot(url: str) -> dict[str, object]:
    """Row counts and full contents of every table."""
    out: dict[str, object] = {}
    for table in TABLES:
        out[table] = run_readonly_query(url, f"SELECT * FROM {table} ORDER BY id")[1]
    out["counts"] = [run_readonly_query(url, f"SELECT count(*) FROM {t}")[1][0][0] for t in TABLES]
    return out


def test_query_returns_columns_and_rows(filled: str) -> None:
    columns, rows = run_readonly_query(
        filled,
        "SELECT seq, makespan, devices, feasible FROM evaluations WHERE makespan < 0.035 "
        "ORDER BY seq",
    )
    assert columns == ["seq", "makespan", "devices", "feasible"]
    assert [(r[0], r[1], r[2]) for r in rows] == [(0, 0.01, 4), (1, 0.02, 4), (2, 0.03, 4)]
    assert all(bool(r[3]) for r in rows)

    _, limited = run_readonly_query(filled, "SELECT seq FROM evaluations ORDER BY seq", limit=2)
    assert limited == [(0,), (1,)]
    columns, rows = run_readonly_query(
        filled,
        "WITH f AS (SELECT candidate_id FROM front WHERE left_at IS NULL) "
        "SELECT count(*) AS n FROM f;  -- trailing semicolon and comment are fine",
    )
    assert columns == ["n"] and rows == [(2,)]


@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO campaigns (name, config_json, config_hash, status, created_at, updated_at, "
        "reference_point_json, objectives_json, counters_json) VALUES ('x', '{}', 'h', 'created', "
        "'2025-01-01', '2025-01-01', '[]', '[]', '{}')",
        "UPDATE evaluations SET makespan = 0",
        "DELETE FROM evaluations",
        "DROP TABLE evaluations",
        "CREATE TABLE evil (a INTEGER)",
        "CREATE TEMP TABLE evil (a INTEGER)",
        "CREATE INDEX ix_evil ON evaluations (makespan)",
        "ALTER TABLE campaigns ADD COLUMN evil TEXT",
        "WITH gone AS (DELETE FROM front RETURNING id) SELECT count(*) FROM gone",
    ],
)
def test_writes_are_refused_and_archive_unchanged(filled: str, statement: str) -> None:
    before = _snapshot(filled)
    with pytest.raises(ReadOnlyViolation, match="read-only") as info:
        run_readonly_query(filled, statement)
    assert statement.split()[0].upper() in str(info.value)
    assert _snapshot(filled) == before


BEYOND_A_QUERY = [
        "COPY (SELECT 1) TO PROGRAM 'id > {marker}'",
        "COPY campaigns TO '{marker}'",
        "LOCK TABLE campaigns IN ACCESS EXCLUSIVE MODE",
        "SELECT pg_advisory_lock(1)",
        "SELECT pg_try_advisory_xact_lock(7), 1",
        "PREPARE p AS SELECT 1",
        "EXPLAIN ANALYZE SELECT 1",
        "SELECT * INTO evil FROM campaigns",
        "SELECT * FROM campaigns FOR UPDATE",
        "SELECT name FROM campaigns FOR SHARE",
        "SET statement_timeout = 0",
        "SELECT set_config('statement_timeout', '0', false)",
        "SELECT query_to_xml('DELETE FROM evaluations', true, true, '')",
        "SELECT pg_sleep(60)",
        "SELECT lo_import('/etc/hostname')",
        "SELECT pg_read_file('/etc/hostname')",
        "DO $$ BEGIN END $$",
        "CALL anything()",
        "BEGIN READ WRITE",
        "VACUUM",
        "SELECT load_extension('x')",
        "(SELECT 1) UNION (SELECT * FROM (WITH d AS (DELETE FROM front RETURNING id) SELECT id FROM d) q)",
]


def test_statements_beyond_a_query_are_refused(filled: str, tmp_path) -> None:
    """Issue 14: COPY ... TO PROGRAM ran shell commands on the server; locks, PREPARE, EXPLAIN and
    side-effect functions passed. Now the parser refuses them before the database sees them."""
    marker = tmp_path / "marker"
    before = _snapshot(filled)
    for statement in BEYOND_A_QUERY:
        with pytest.raises((ReadOnlyViolation, QueryError)) as info:
            run_readonly_query(filled, statement.format(marker=marker))
        assert "read-only" in str(info.value) or "cannot read the query" in str(info.value), statement
    assert not marker.exists()
    assert _snapshot(filled) == before


def test_endless_recursive_query_stops_at_the_timeout(filled: str) -> None:
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c"
    t0 = time.monotonic()
    with pytest.raises(QueryError, match="ran longer than 0.5 s"):
        run_readonly_query(filled, "SELECT count(*) FROM (" + endless + ") q", timeout_s=0.5)
    assert time.monotonic() - t0 < 10
    # rows stream: a row limit ends an endless query at once
    _, rows = run_readonly_query(filled, endless, limit=5, timeout_s=5)
    assert rows == [(1,), (2,), (3,), (4,), (5,)]
    # the archive is not held: a writer gets through at once
    with Archive.open(filled) as a:
        a.set_status(CAMPAIGN, "paused")


def test_plain_queries_still_work(filled: str) -> None:
    for q in ("VALUES (1, 2)", "SELECT 1 UNION SELECT 2 ORDER BY 1",
              "SELECT upper(name), length(config_json) > 0 FROM campaigns",
              "WITH f AS (SELECT * FROM front) SELECT count(*) FROM f"):
        cols, rows = run_readonly_query(filled, q)
        assert cols and rows, q


def test_sqlite_specific_escapes_refused(filled: str, tmp_path) -> None:
    if filled.startswith("postgresql"):
        pytest.skip("SQLite-only statements")
    before = _snapshot(filled)
    other = tmp_path / "other.db"
    for statement in (
        f"ATTACH DATABASE '{other}' AS other",
        "PRAGMA user_version = 7",
        "PRAGMA journal_mode = DELETE",
        "VACUUM",
        "REINDEX",
    ):
        with pytest.raises(ReadOnlyViolation):
            run_readonly_query(filled, statement)
    assert not other.exists()
    assert _snapshot(filled) == before
    # Introspection pragmas stay available.
    columns, rows = run_readonly_query(filled, "PRAGMA table_info(evaluations)")
    assert "name" in columns and any("makespan" in r for r in rows)


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT 1; DELETE FROM evaluations",
        "SELECT 1; SELECT 2",
        "COMMIT; BEGIN READ WRITE; DELETE FROM evaluations",
        "SELECT 'a;b' AS x; DROP TABLE front",
    ],
)
def test_multiple_statements_refused(filled: str, statement: str) -> None:
    before = _snapshot(filled)
    with pytest.raises(MultipleStatements, match="exactly one"):
        run_readonly_query(filled, statement)
    assert _snapshot(filled) == before


def test_bad_queries(filled: str) -> None:
    with pytest.raises(QueryError, match=r"no_such_table|does not exist|no such table"):
        run_readonly_query(filled, "SELECT * FROM no_such_table")
    with pytest.raises(QueryError, match="empty query"):
        run_readonly_query(filled, "  ;  -- nothing\n")


def test_semicolons_inside_literals_are_one_statement(filled: str) -> None:
    columns, rows = run_readonly_query(filled, "SELECT 'a;b' AS x, \"name\" FROM campaigns")
    assert columns == ["x", "name"] and rows == [("a;b", CAMPAIGN)]


# ---------------------------------------------------------------------- splitting


@pytest.mark.parametrize(
    ("sql", "dialect", "count"),
    [
        ("SELECT 1", "sqlite", 1),
        ("SELECT 1;", "sqlite", 1),
        ("SELECT 1; SELECT 2", "sqlite", 2),
        ("SELECT ';' -- ; \n FROM t", "sqlite", 1),
        ("SELECT 'it''s;' /* ; */", "sqlite", 1),
        ('SELECT "a;b" FROM t; ', "sqlite", 1),
        ("SELECT [a;b] FROM t", "sqlite", 1),
        ("SELECT `a;b` FROM t", "sqlite", 1),
        ("SELECT $$;$$, $tag$ ; $tag$", "postgresql", 1),
        ("SELECT E'it\\'s;' ; SELECT 2", "postgresql", 2),
        ("SELECT E'it\\'s;'", "postgresql", 1),
        ("SELECT 1 /* outer /* inner */ ; */", "postgresql", 1),
        ("-- only a comment", "sqlite", 0),
        (";;", "sqlite", 0),
    ],
)
def test_split_statements(sql: str, dialect: str, count: int) -> None:
    assert len(split_statements(sql, dialect=dialect)) == count


@given(
    st.lists(st.text(alphabet=st.characters(exclude_characters="'\x00"), max_size=12), max_size=5)
)
def test_split_statements_ignores_semicolons_in_strings(parts: list[str]) -> None:
    literals = ", ".join("'" + p + "'" for p in parts) or "1"
    assert len(split_statements(f"SELECT {literals}")) == 1
    assert len(split_statements(f"SELECT {literals}; SELECT {literals}")) == 2


# ---------------------------------------------------------------------- formatting

COLUMNS = ["digest", "makespan", "devices", "feasible", "gap", "graph_zlib"]
ROWS = [
    ("ab12", 0.0125, 4, True, None, b"\x78\x9c\x00"),
    ("cd34", math.inf, 16, False, 1.5, b""),
]


def test_format_table() -> None:
    text = format_rows(COLUMNS, ROWS, "table")
    lines = text.splitlines()
    assert lines[0].split() == COLUMNS
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["ab12", "0.0125", "4", "true", "NULL", "<3", "bytes>"]
    assert lines[3].split() == ["cd34", "inf", "16", "false", "1.5", "<0", "bytes>"]
    assert lines[-1] == "(2 rows)"
    # numbers right-aligned: the devices column ends at the same place on every row
    ends = {line.index(v) + len(v) for line, v in zip(lines[2:4], ["4", "16"], strict=True)}
    assert len(ends) == 1
    assert format_rows([], [], "table") == "(no rows)"


def test_format_csv() -> None:
    parsed = list(csv.reader(io.StringIO(format_rows(COLUMNS, ROWS, "csv"))))
    assert parsed[0] == COLUMNS
    assert parsed[1] == ["ab12", "0.0125", "4", "true", "", "<3 bytes>"]
    assert parsed[2] == ["cd34", "inf", "16", "false", "1.5", "<0 bytes>"]


def test_format_json() -> None:
    data = json.loads(format_rows(COLUMNS, ROWS, "json"))
    assert data == [
        {
            "digest": "ab12",
            "makespan": 0.0125,
            "devices": 4,
            "feasible": True,
            "gap": None,
            "graph_zlib": "<3 bytes>",
        },
        {
            "digest": "cd34",
            "makespan": "inf",
            "devices": 16,
            "feasible": False,
            "gap": 1.5,
            "graph_zlib": "<0 bytes>",
        },
    ]
    with pytest.raises(ValueError, match="unknown format"):
        format_rows(COLUMNS, ROWS, "yaml")  # type: ignore[arg-type]


def test_query_to_format_end_to_end(filled: str) -> None:
    columns, rows = run_readonly_query(filled, "SELECT name, status FROM campaigns")
    assert json.loads(format_rows(columns, rows, "json")) == [
        {"name": CAMPAIGN, "status": "created"}
    ]


def test_json_keeps_columns_of_one_name() -> None:
    """``SELECT f.*, c.*`` names ``id`` twice; JSON kept only the last (``front.id`` was lost)."""
    data = json.loads(format_rows(["id", "a", "id", "id"], [(1, 2, 3, 4)], "json"))
    assert data == [{"id": 1, "a": 2, "id:2": 3, "id:3": 4}]


@pytest.mark.parametrize("fn", ["pg_stat_reset()", "pg_stat_reset_shared('bgwriter')", "pg_backup_start('x')",
                                "pg_log_backend_memory_contexts(1)", "pg_catalog.pg_stat_reset()"])
def test_postgres_server_functions_are_refused_by_default(fn: str) -> None:
    """PostgreSQL's pg_* functions with effects on the server got past a list of known ones (a
    superuser's ``SELECT pg_stat_reset()`` zeroed the statistics); only introspection ones pass."""
    from storage.sql import check_query

    with pytest.raises(ReadOnlyViolation, match="acts outside the query"):
        check_query(f"SELECT {fn}", "postgres")
    check_query("SELECT pg_typeof(1), pg_size_pretty(10)", "postgres")
