"""Engine configuration: URLs, SQLite pragmas and BEGIN IMMEDIATE, read-only modes, sessions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import event, select, text

from storage import (
    ArchiveUnavailable,
    CampaignNotFound,
    ReadOnlyViolation,
    StorageError,
    make_engine,
    session_scope,
)
from storage.engine import normalize_url
from storage.errors import IntegrityViolation
from storage.migrate import upgrade
from storage.models import Campaign


def test_plain_paths_and_urls_are_normalized(tmp_path: Path) -> None:
    assert normalize_url("farm.db").drivername == "sqlite+pysqlite"
    assert normalize_url("farm.db").database == "farm.db"
    assert normalize_url("runs/x.db").database == "runs/x.db"
    assert normalize_url("sqlite:////tmp/a.db").drivername == "sqlite+pysqlite"
    assert normalize_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("postgres://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("postgresql+psycopg://u@h/db").drivername == "postgresql+psycopg"
    with pytest.raises(ArchiveUnavailable, match="empty database URL"):
        normalize_url("  ")
    with pytest.raises(ArchiveUnavailable, match="cannot use database URL"):
        make_engine("nosuchdb://x/y")


def test_relative_path_creates_sqlite_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    engine = make_engine("runs/farm.db")
    try:
        upgrade(engine)
    finally:
        engine.dispose()
    assert (tmp_path / "runs" / "farm.db").is_file()


def test_sqlite_pragmas_and_begin_immediate(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "farm.db")
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda c, cur, stmt, *a: statements.append(stmt))
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
        upgrade(engine)
        statements.clear()
        with session_scope(engine) as s:
            s.execute(select(Campaign.id))
        with session_scope(engine, write=False) as s:
            s.execute(select(Campaign.id))
        begins = [st for st in statements if st.startswith("BEGIN")]
        assert begins == ["BEGIN IMMEDIATE", "BEGIN"]
    finally:
        engine.dispose()


def test_sqlite_write_lock_is_taken_at_begin(tmp_path: Path) -> None:
    """A second writer waits at BEGIN (and times out there) instead of failing mid-transaction."""
    path = tmp_path / "farm.db"
    first = make_engine(path)
    second = make_engine(path, busy_timeout_s=0.2)
    try:
        upgrade(first)
        with first.connect() as holder:
            holder.begin()  # BEGIN IMMEDIATE: holds the write lock, no statement needed
            with (
                pytest.raises(StorageError, match="locked") as info,
                session_scope(second, what="second writer") as s,
            ):
                s.execute(select(Campaign.id))
            assert "second writer" in str(info.value)
            # Readers are not blocked by the writer (WAL + deferred BEGIN for reads).
            with session_scope(second, write=False) as s:
                assert s.execute(select(Campaign.id)).all() == []
            holder.rollback()
    finally:
        first.dispose()
        second.dispose()


def test_readonly_engine_refuses_writes(db_url: str) -> None:
    upgrade(db_url)
    engine = make_engine(db_url, readonly=True)
    try:
        with (
            pytest.raises(ReadOnlyViolation, match="read-only"),
            session_scope(engine, what="sneaky write") as s,
        ):
            s.execute(text("DELETE FROM campaigns"))
        with session_scope(engine, write=False) as s:
            assert s.execute(text("SELECT count(*) FROM campaigns")).scalar() == 0
    finally:
        engine.dispose()


def test_readonly_sqlite_needs_existing_file(tmp_path: Path) -> None:
    with pytest.raises(ArchiveUnavailable, match="does not exist"):
        make_engine(tmp_path / "missing.db", readonly=True)
    assert not (tmp_path / "missing.db").exists()


def test_readonly_sqlite_path_with_odd_characters(tmp_path: Path) -> None:
    path = tmp_path / "dir with space#and?query%.db"
    upgrade(path)
    engine = make_engine(path, readonly=True)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM campaigns")).scalar() == 0
    finally:
        engine.dispose()


def test_session_scope_rolls_back_and_translates(db_url: str) -> None:
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        with (
            pytest.raises(IntegrityViolation, match="inserting orphan"),
            session_scope(engine, what="inserting orphan") as s,
        ):
            s.execute(
                text(
                    "INSERT INTO checkpoints (campaign_id, seq, created_at, state_json) "
                    "VALUES (424242, 1, CURRENT_TIMESTAMP, '{}')"
                )
            )  # foreign key to a missing campaign
        # Our own errors pass through unchanged (and roll back).
        with pytest.raises(CampaignNotFound), session_scope(engine) as s:
            s.execute(text("DELETE FROM campaigns"))
            raise CampaignNotFound("x")
        with session_scope(engine, write=False) as s:
            assert s.execute(text("SELECT count(*) FROM checkpoints")).scalar() == 0
    finally:
        engine.dispose()


def test_unreachable_postgres_is_reported() -> None:
    from storage import Archive

    with pytest.raises(ArchiveUnavailable, match="cannot connect"):
        Archive.open("postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=2")


def test_storage_imports_no_other_tapestry_package() -> None:
    code = (
        "import sys, storage, storage.archive, storage.sql, storage.migrate\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('ir', 'costmodel', 'executor', 'optimizer')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
    sources = Path(__file__).parents[2] / "storage"
    for source in sources.rglob("*.py"):
        assert "pickle" not in source.read_text(), source
