"""Engines for the archive: URL handling, SQLite locking discipline, read-only connections.

SQLite (the default) is configured for one database file shared by several processes:

* WAL journal, so readers never block the writer and the writer never blocks readers;
* ``busy_timeout`` so a writer waits for the lock instead of failing at once;
* foreign keys enforced;
* every write transaction starts with ``BEGIN IMMEDIATE``. With the default deferred ``BEGIN``
  a transaction that reads and then writes must upgrade its lock; when two do so at once one of
  them fails with "database is locked" no matter the timeout, and read-modify-write sequences
  can interleave (DESIGN.md section 8). ``BEGIN IMMEDIATE`` takes the write lock up front, so
  writers queue on the busy timeout and run one after another.

pysqlite's own transaction handling is switched off (``isolation_level = None``) and SQLAlchemy
emits the BEGIN from the engine's "begin" event: the documented SQLAlchemy recipe for SQLite
transaction control. Transactions on a connection opened with the ``tapestry_read`` execution
option (see :func:`storage.session.session_scope`) use a plain deferred BEGIN, so pure reads do not
queue behind writers.

Read-only engines open SQLite with ``mode=ro`` (the file cannot be written through them at all)
and PostgreSQL with ``default_transaction_read_only=on``; writes then fail in the database
itself, not by inspecting SQL text.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import StaticPool

from storage.errors import ArchiveUnavailable

__all__ = ["DEFAULT_BUSY_TIMEOUT_S", "READ_OPTION", "display_url", "make_engine", "normalize_url"]

#: Execution option marking a connection whose transactions only read (deferred BEGIN).
READ_OPTION = "tapestry_read"

#: How long a SQLite writer waits for the lock before giving up.
DEFAULT_BUSY_TIMEOUT_S = 30.0

_PG_READONLY_OPTION = "-c default_transaction_read_only=on"


def normalize_url(url: str | Path | URL) -> URL:
    """Turn what a user passes as ``--db`` into a SQLAlchemy URL.

    A plain path (``farm.db``, ``runs/farm.db``) means a SQLite file; ``sqlite://`` URLs get the
    pysqlite driver and ``postgresql://`` / ``postgres://`` URLs get psycopg 3.
    """
    if isinstance(url, URL):
        parsed = url
    else:
        text = str(url).strip()
        if not text:
            raise ArchiveUnavailable("empty database URL: pass a file path like farm.db or a URL")
        if "://" not in text:
            return URL.create("sqlite+pysqlite", database=str(Path(text).expanduser()))
        try:
            parsed = make_url(text)
        except ArgumentError as exc:
            raise ArchiveUnavailable(
                f"cannot parse database URL {text!r}: {exc}. Use a file path like farm.db, "
                "sqlite:///path/farm.db or postgresql+psycopg://user@host:5432/dbname"
            ) from exc
    backend = parsed.get_backend_name()
    if backend == "sqlite" and parsed.get_driver_name() in ("", "pysqlite"):
        return parsed.set(drivername="sqlite+pysqlite")
    if backend in ("postgresql", "postgres") and parsed.drivername in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+psycopg")
    if backend == "postgres":
        return parsed.set(drivername="postgresql+" + parsed.get_driver_name())
    return parsed


def display_url(url: str | Path | URL) -> str:
    """How to name an archive in messages: a SQLite file's path, else the URL without password.

    The result can be passed back as ``--db``.
    """
    try:
        parsed = normalize_url(url)
    except ArchiveUnavailable:
        return str(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and not _is_memory(parsed):
        if parsed.query.get("uri") != "true":
            return parsed.database
        if parsed.database.startswith("file:"):
            return urllib.parse.unquote(parsed.database[len("file:") :])
    return parsed.render_as_string(hide_password=True)


def _is_memory(url: URL) -> bool:
    return url.database in (None, "", ":memory:") and url.query.get("uri") != "true"


def _sqlite_readonly_url(url: URL) -> URL:
    if url.query.get("uri") == "true":
        # Already a URI filename: just force mode=ro on top of its own parameters.
        return url.update_query_dict({"mode": "ro"})
    path = Path(url.database or "").expanduser().resolve()
    if not path.is_file():
        raise ArchiveUnavailable(
            f"no archive at {path}: the file does not exist. Check the --db path, or start a "
            "campaign with `tapestry run` to create it."
        )
    return URL.create(
        "sqlite+pysqlite",
        database="file:" + urllib.parse.quote(str(path)),
        query={"mode": "ro", "uri": "true"},
    )


def _set_wal(cursor: Any, timeout_s: float) -> None:
    """Switch to WAL, retrying: SQLite can answer SQLITE_BUSY to a journal-mode change without
    consulting the busy handler while another process is creating or switching the same file."""
    import sqlite3
    import time

    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def _install_sqlite_events(engine: Engine, *, readonly: bool, busy_timeout_s: float) -> None:
    busy_ms = int(busy_timeout_s * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Hand transaction control to SQLAlchemy (see module docstring).
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if not readonly:
                _set_wal(cursor, busy_timeout_s)
                # In WAL mode NORMAL cannot corrupt the file; a power cut may drop the last
                # commits, which resume-from-checkpoint tolerates.
                cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if readonly or conn.get_execution_options().get(READ_OPTION):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


def _refuse_foreign_sqlite(path: Path) -> None:
    """``ArchiveUnavailable`` when ``path`` is an SQLite file with tables but no Tapestry schema
    version: a read-write engine would switch it to WAL and the migration add our tables to it.
    Looked at read-only, so the file is left as it was."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    import sqlite3

    try:
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
        try:
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        return  # not a database at all: opening it reports that
    if tables and "tapestry_alembic_version" not in tables:  # storage.migrate.VERSION_TABLE
        raise ArchiveUnavailable(f"{path} is an SQLite database of something else (tables {sorted(tables)[:5]}), not "
                                 f"a Tapestry archive; give a new file or an archive's path as --db")


def make_engine(
    url: str | Path | URL,
    readonly: bool = False,
    *,
    busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
    echo: bool = False,
) -> Engine:
    """Create an engine for an archive URL (or a plain SQLite file path).

    ``readonly=True`` opens SQLite files with ``mode=ro`` (the file must exist) and PostgreSQL
    sessions with ``default_transaction_read_only=on``, so every write fails in the database.
    A read-write SQLite engine creates the file's parent directory if needed.

    Raises :class:`~storage.errors.ArchiveUnavailable` for an unusable URL or a missing
    read-only SQLite file. Connection errors surface on first use.
    """
    parsed = normalize_url(url)
    backend = parsed.get_backend_name()
    kwargs: dict[str, Any] = {"echo": echo}
    connect_args: dict[str, Any] = {}

    if backend == "sqlite":
        if _is_memory(parsed):
            # One shared connection, or every checkout would see a new empty database.
            kwargs["poolclass"] = StaticPool
            connect_args["check_same_thread"] = False
        elif readonly:
            parsed = _sqlite_readonly_url(parsed)
        elif parsed.query.get("uri") != "true":
            path = Path(parsed.database or "").expanduser().resolve()
            _refuse_foreign_sqlite(path)
            path.parent.mkdir(parents=True, exist_ok=True)
    elif backend == "postgresql":
        kwargs["pool_pre_ping"] = True  # the driver runs for days; servers drop idle sockets
        if readonly:
            existing = parsed.query.get("options")
            if isinstance(existing, tuple):
                existing = " ".join(existing)
            connect_args["options"] = (
                f"{existing} {_PG_READONLY_OPTION}" if existing else _PG_READONLY_OPTION
            )

    try:
        engine = create_engine(parsed, connect_args=connect_args, **kwargs)
    except (ArgumentError, ImportError) as exc:
        raise ArchiveUnavailable(
            f"cannot use database URL {parsed.render_as_string(hide_password=True)!r}: {exc}. "
            "Supported: SQLite file paths or sqlite:/// URLs, and postgresql+psycopg:// URLs "
            "(pip install 'psycopg[binary]')."
        ) from exc

    if backend == "sqlite":
        _install_sqlite_events(engine, readonly=readonly, busy_timeout_s=busy_timeout_s)
    return engine
