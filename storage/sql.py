"""Read-only SQL over an archive (``tapestry sql``), and formatting of the result rows.

Three independent layers, each enough against writes on its own:

1. **The statement is parsed** (sqlglot, in the archive's dialect) and must be exactly one query:
   ``SELECT``, ``WITH ... SELECT``, set operations of them, or ``VALUES``. Anything else is
   refused before it reaches the database: every write and DDL (also inside a ``WITH``),
   ``SELECT ... INTO``, ``FOR UPDATE/SHARE`` row locks, ``COPY`` (which on PostgreSQL runs
   shell commands or writes server files), ``LOCK``, ``PREPARE``, ``EXPLAIN``, ``SET``,
   transaction control, and functions that act outside the query (advisory locks, sleeps,
   server files and large objects, ``dblink``, ``query_to_xml``-style dynamic SQL, sequences,
   ``set_config``, backend signals; ``load_extension`` on SQLite). On SQLite, introspection
   ``PRAGMA``s (``table_info``, ``index_list``, ...) are allowed too, judged by layer 2.
2. **The database refuses writes.** SQLite: the file is opened with ``mode=ro``,
   ``PRAGMA query_only`` is on, and an authorizer allows only reads (SELECT, reading columns,
   functions, recursive CTEs, introspection pragmas), which also blocks TEMP tables and ATTACH
   that ``mode=ro`` alone would allow. PostgreSQL: the session starts with
   ``default_transaction_read_only=on`` and the query runs in a ``READ ONLY`` transaction
   through a server-side cursor (``DECLARE ... CURSOR FOR``, which accepts only a query).
3. **Time and size are bounded.** A statement timeout (PostgreSQL ``statement_timeout`` and
   ``lock_timeout``; SQLite a progress handler that interrupts the query), so an endless
   ``WITH RECURSIVE`` cannot hold a snapshot forever; rows are fetched incrementally up to
   ``limit``.

For defence in depth on a shared PostgreSQL server, give ``tapestry sql`` a role that can only
read (README, "Read-only SQL"): the parser is careful, a role is a guarantee.

A small lexer counts statements first so that a multi-statement query gets a clear message on
every backend.
"""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import io
import json
import math
import re
import logging
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import sqlglot
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlglot import exp

from storage.engine import display_url, make_engine, normalize_url
from storage.errors import (
    ArchiveUnavailable,
    InvalidRecord,
    MultipleStatements,
    QueryError,
    ReadOnlyViolation,
    StorageError,
    translate_db_error,
)

__all__ = ["DEFAULT_TIMEOUT_S", "check_query", "format_rows", "run_readonly_query", "split_statements"]

#: default time limit of one ``tapestry sql`` query (seconds)
DEFAULT_TIMEOUT_S = 30.0

# Statement kinds that may appear nowhere in a query (writes, DDL, locks, side channels).
_FORBIDDEN_NODES: tuple[type, ...] = tuple(
    getattr(exp, name)
    for name in ("DML", "DDL", "Into", "Lock", "Command", "Copy", "Set", "Transaction", "Commit", "Rollback",
                 "Attach", "Detach", "Pragma", "Use", "Grant", "Kill", "Cache", "Uncache", "Refresh", "Analyze",
                 "Declare", "LoadData", "TruncateTable", "Merge")
    if hasattr(exp, name)
)
# Function names (lower case) or prefixes that act outside the query: refused on every backend.
_FORBIDDEN_FUNCTIONS = (
    "pg_advisory", "pg_try_advisory", "pg_sleep", "pg_read_", "pg_ls_", "pg_stat_file", "pg_file_",
    "pg_logdir", "lo_", "dblink", "pg_terminate_backend", "pg_cancel_backend", "pg_reload_conf",
    "pg_rotate_logfile", "pg_promote", "pg_switch_wal", "pg_create_", "pg_drop_", "pg_replication_",
    "pg_logical_", "pg_notify", "pg_export_snapshot", "pg_import_system_collations", "set_config", "nextval",
    "setval", "query_to_xml", "query_to_xmlschema", "query_to_xml_and_xmlschema", "cursor_to_xml",
    "txid_current", "pg_current_xact_id", "load_extension", "readfile", "writefile", "edit", "fts3_tokenizer",
)
# PostgreSQL's own ``pg_*`` functions include many that act on the server (statistics resets,
# backups, WAL, memory-context logging...), so only these introspection ones are let through.
_PG_ALLOWED = frozenset({
    "pg_typeof", "pg_column_size", "pg_size_pretty", "pg_size_bytes", "pg_relation_size", "pg_table_size",
    "pg_total_relation_size", "pg_indexes_size", "pg_database_size", "pg_get_indexdef", "pg_get_viewdef",
    "pg_get_constraintdef", "pg_get_expr", "pg_table_is_visible", "pg_postmaster_start_time",
    "pg_backend_pid", "pg_client_encoding", "pg_encoding_to_char",
})
logging.getLogger("sqlglot").setLevel(logging.ERROR)  # its "falling back to Command" warnings

Format = Literal["table", "csv", "json"]

# sqlite3 authorizer action codes a query may use.
_SQLITE_ALLOWED_ACTIONS = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
}
# Pragmas that take a table/index name and only describe it.
_SQLITE_INTROSPECTION_PRAGMAS = {
    "table_info",
    "table_xinfo",
    "table_list",
    "index_list",
    "index_info",
    "index_xinfo",
    "foreign_key_list",
    "foreign_key_check",
    "integrity_check",
    "quick_check",
}
# Query-form pragmas (no argument) that nevertheless change something.
_SQLITE_WRITING_PRAGMAS = {"optimize", "wal_checkpoint", "incremental_vacuum", "shrink_memory"}


def split_statements(sql: str, *, dialect: str = "sqlite") -> list[str]:
    """Split SQL text into its non-empty statements, respecting quotes and comments.

    Handles '...' strings (with '' escapes, and E'..' backslash escapes on PostgreSQL),
    "..." / `...` / [...] identifiers, -- and /* */ comments (nested on PostgreSQL) and
    PostgreSQL dollar quoting.
    """
    pg = dialect == "postgresql"
    statements: list[str] = []
    start = i = 0
    n = len(sql)
    dollar = re.compile(r"\$([A-Za-z_][A-Za-z_0-9]*)?\$")
    while i < n:
        ch = sql[i]
        if ch == "'":
            backslash = pg and i > 0 and sql[i - 1] in "eE" and (i < 2 or not _ident(sql[i - 2]))
            i += 1
            while i < n:
                if backslash and sql[i] == "\\":
                    i += 2
                    continue
                if sql[i] == "'":
                    if i + 1 < n and sql[i + 1] == "'":
                        i += 2
                        continue
                    break
                i += 1
            i += 1
        elif ch in '"`' or (ch == "[" and not pg):
            close = "]" if ch == "[" else ch
            end = sql.find(close, i + 1)
            i = n if end < 0 else end + 1
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if sql.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                elif pg and sql.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                else:
                    i += 1
        elif ch == "$" and pg and (i == 0 or not _ident(sql[i - 1])):
            match = dollar.match(sql, i)
            if match:
                end = sql.find(match.group(0), match.end())
                i = n if end < 0 else end + len(match.group(0))
            else:
                i += 1
        elif ch == ";":
            statements.append(sql[start:i])
            i += 1
            start = i
        else:
            i += 1
    statements.append(sql[start:])
    return [s.strip() for s in statements if _strip_comments(s).strip()]


def _ident(ch: str) -> bool:
    return ch.isalnum() or ch in "_$"


def _strip_comments(sql: str) -> str:
    # Only used to decide whether a piece holds anything but comments and blanks.
    out = re.sub(r"--[^\n]*", " ", sql)
    return re.sub(r"/\*.*?\*/", " ", out, flags=re.S)


def _first_keyword(sql: str) -> str:
    match = re.match(r"\s*(?:(?:--[^\n]*\n)|(?:/\*.*?\*/)|\s)*\s*([A-Za-z]+)", sql, re.S)
    return match.group(1).upper() if match else "statement"


def _refusal(sql: str, where: str, reason: str) -> ReadOnlyViolation:
    keyword = _first_keyword(sql)
    return ReadOnlyViolation(
        f"tapestry sql is read-only and refused {keyword} on {where} ({reason}). It runs a single "
        "query (SELECT, WITH ... SELECT, VALUES; on SQLite also introspection PRAGMAs); change the archive "
        "only through the campaign commands."
    )


def _sqlite_authorizer(action: int, arg1: str | None, arg2: str | None, *_: Any) -> int:
    if action in _SQLITE_ALLOWED_ACTIONS:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_PRAGMA and arg1 is not None:
        name = arg1.lower()
        if name in _SQLITE_INTROSPECTION_PRAGMAS:
            return sqlite3.SQLITE_OK
        if arg2 is None and name not in _SQLITE_WRITING_PRAGMAS:
            return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def _function_name(node: exp.Expression) -> str:
    if isinstance(node, exp.Anonymous):
        return str(node.name).lower()
    try:
        return node.sql_name().lower()
    except (AttributeError, NotImplementedError):
        return type(node).__name__.lower()


def check_query(statement: str, dialect: str, where: str = "the archive") -> None:
    """Refuse (``ReadOnlyViolation``, or ``QueryError`` for text that is not SQL) anything but one
    read-only query; see the module docstring, layer 1."""
    if dialect == "sqlite" and _first_keyword(statement) == "PRAGMA":
        return  # introspection pragmas: judged by the authorizer (layer 2), which refuses the rest
    try:
        parsed = sqlglot.parse(statement, read="postgres" if dialect == "postgresql" else "sqlite")
    except sqlglot.errors.SqlglotError as exc:
        first = str(exc).strip().splitlines()[0][:200]
        raise QueryError(f"cannot read the query as SQL ({first}); tapestry sql runs one SELECT") from None
    parsed = [e for e in parsed if e is not None]
    if len(parsed) != 1:
        raise MultipleStatements(f"the query holds {len(parsed)} statements; tapestry sql runs exactly one")
    root = parsed[0]
    query = root.this if isinstance(root, exp.Subquery) else root
    if not isinstance(query, (exp.Query, exp.Values)):
        raise _refusal(statement, where, "not a query: only SELECT, WITH ... SELECT and VALUES are allowed")
    for node in root.walk():
        if isinstance(node, _FORBIDDEN_NODES):
            what = type(node).__name__.upper()
            what = {"INTO": "SELECT ... INTO", "LOCK": "FOR UPDATE/SHARE"}.get(what, what)
            raise _refusal(statement, where, f"it contains {what}, which writes or locks")
        if isinstance(node, exp.Func):
            name = _function_name(node)
            if name.startswith(_FORBIDDEN_FUNCTIONS) or (name.startswith("pg_") and name not in _PG_ALLOWED):
                raise _refusal(statement, where, f"function {name}() acts outside the query (or may: of "
                                                 f"PostgreSQL's pg_* functions only introspection ones are allowed)")


def run_readonly_query(
    url: str | Path | URL, sql: str, limit: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one read-only SQL query against an archive; return ``(columns, rows)``.

    ``limit`` caps the number of rows fetched (None: all); ``timeout_s`` stops a query that runs
    longer. A statement that returns no rows gives ``([], [])``.

    Raises :class:`~storage.errors.ReadOnlyViolation` for anything but a read-only query (writes,
    DDL, COPY, locks, ... see the module docstring), :class:`~storage.errors.MultipleStatements`
    for more than one statement, :class:`~storage.errors.QueryError` for SQL the database rejects
    or a query that ran out of time, and :class:`~storage.errors.ArchiveUnavailable` when the
    archive cannot be opened.
    """
    if limit is not None and limit < 0:
        raise InvalidRecord(f"limit must be >= 0, got {limit}")
    if not timeout_s > 0:
        raise InvalidRecord(f"timeout_s must be > 0, got {timeout_s}")
    parsed = normalize_url(url)
    where = display_url(parsed)
    dialect = parsed.get_backend_name()
    statements = split_statements(sql, dialect=dialect)
    if not statements:
        raise QueryError("empty query: pass one SQL statement, e.g. SELECT * FROM campaigns")
    if len(statements) > 1:
        raise MultipleStatements(
            f"the query holds {len(statements)} statements; tapestry sql runs exactly one "
            "(remove the extra ';'-separated statements)"
        )
    statement = statements[0]
    check_query(statement, dialect, where)

    engine = make_engine(parsed, readonly=True)
    try:
        raw = engine.raw_connection()
        try:
            driver: Any = raw.driver_connection
            if dialect == "sqlite":
                return _run_sqlite(driver, statement, limit, where, timeout_s)
            if dialect == "postgresql":
                return _run_postgresql(driver, statement, limit, where, timeout_s)
            raise StorageError(
                f"tapestry sql supports SQLite and PostgreSQL archives, not {dialect}"
            )
        finally:
            try:
                raw.rollback()
            finally:
                raw.close()
    except SQLAlchemyError as exc:
        raise translate_db_error(exc, f"opening {where} read-only") from exc
    finally:
        engine.dispose()


def _fetch(cursor: Any, limit: int | None) -> tuple[list[str], list[tuple[Any, ...]]]:
    if cursor.description is None:
        return [], []
    columns = [d[0] for d in cursor.description]
    rows = cursor.fetchall() if limit is None else cursor.fetchmany(limit)
    return columns, [tuple(r) for r in rows]


def _timeout(where: str, timeout_s: float) -> QueryError:
    return QueryError(f"the query on {where} ran longer than {timeout_s:g} s and was stopped; narrow it "
                      f"(WHERE, LIMIT) or raise --timeout")


def _run_sqlite(
    conn: sqlite3.Connection, statement: str, limit: int | None, where: str, timeout_s: float
) -> tuple[list[str], list[tuple[Any, ...]]]:
    conn.execute("PRAGMA query_only = ON")
    deadline = time.monotonic() + timeout_s
    expired: list[bool] = []

    def progress() -> int:
        if time.monotonic() > deadline:
            expired.append(True)
            return 1  # interrupts the statement (sqlite3.OperationalError "interrupted")
        return 0

    conn.set_progress_handler(progress, 10_000)
    denied: list[int] = []

    def authorizer(action: int, *args: Any) -> int:
        verdict = _sqlite_authorizer(action, *args)
        if verdict != sqlite3.SQLITE_OK:
            denied.append(action)
        return verdict

    conn.set_authorizer(authorizer)
    try:
        cursor = conn.execute(statement)
        return _fetch(cursor, limit)
    except sqlite3.ProgrammingError as exc:
        if "one statement" in str(exc):
            raise MultipleStatements(
                f"the query holds more than one statement; tapestry sql runs exactly one ({exc})"
            ) from exc
        raise QueryError(f"query on {where} failed: {exc}") from exc
    except sqlite3.Error as exc:
        if expired:
            raise _timeout(where, timeout_s) from exc
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        if code in (11, 14, 26):  # SQLITE_CORRUPT, SQLITE_CANTOPEN, SQLITE_NOTADB
            raise ArchiveUnavailable(
                f"cannot read {where} ({exc}): check that --db points to a Tapestry archive"
            ) from exc
        # SQLITE_READONLY, or our authorizer said no (reported as SQLITE_AUTH, or for some
        # DDL as SQLITE_SCHEMA "not authorized").
        if code == 8 or denied:
            raise _refusal(statement, where, str(exc)) from exc
        raise QueryError(f"query on {where} failed: {exc}") from exc
    finally:
        conn.set_authorizer(None)
        conn.set_progress_handler(None, 0)


def _run_postgresql(
    conn: Any, statement: str, limit: int | None, where: str, timeout_s: float
) -> tuple[list[str], list[tuple[Any, ...]]]:
    import psycopg

    try:
        with conn.cursor() as setup:
            # First statements of the transaction: READ ONLY, and limits that end with it.
            setup.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            setup.execute("SELECT set_config('statement_timeout', %s, true), set_config('lock_timeout', %s, true)",
                          (f"{int(timeout_s * 1000)}ms", f"{int(min(timeout_s, 5.0) * 1000)}ms"))
        # A server-side cursor (DECLARE ... CURSOR FOR <query>): the server accepts only a query
        # there, and rows arrive as they are fetched, never all at once.
        with conn.cursor(name="tapestry_sql") as cursor:
            cursor.execute(statement)
            return _fetch(cursor, limit)
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if exc.sqlstate in ("57014", "55P03"):  # query_canceled (statement_timeout), lock_not_available
            raise _timeout(where, timeout_s) from exc
        if exc.sqlstate == "25006":
            raise _refusal(statement, where, first) from exc
        if exc.sqlstate == "42601" and "multiple commands" in first:
            raise MultipleStatements(
                f"the query holds more than one statement; tapestry sql runs exactly one ({first})"
            ) from exc
        raise QueryError(f"query on {where} failed: {first}") from exc


# ---------------------------------------------------------------------- formatting


def _plain(value: Any) -> Any:
    """A value as JSON data: non-finite floats and bytes become strings."""
    if isinstance(value, decimal.Decimal):
        value = float(value) if value.is_finite() else str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, bytes | bytearray | memoryview):
        return f"<{len(bytes(value))} bytes>"
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    plain = _plain(value)
    return plain if isinstance(plain, str) else str(plain)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | decimal.Decimal) and not isinstance(value, bool)


def _unique_keys(columns: Sequence[str]) -> list[str]:
    """Column names as JSON keys, a repeated one numbered (``id``, ``id:2``): ``SELECT f.*, c.*``
    names ``id`` twice, and a JSON object keeps only the last of two equal keys."""
    seen: dict[str, int] = {}
    out = []
    for c in columns:
        seen[c] = seen.get(c, 0) + 1
        out.append(c if seen[c] == 1 else f"{c}:{seen[c]}")
    return out


def format_rows(
    columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: Format = "table"
) -> str:
    """Render query results as ``table`` (aligned text), ``csv`` or ``json`` (list of objects).

    NULL is ``NULL`` in tables, empty in CSV and ``null`` in JSON; binary values show as
    ``<N bytes>``; in JSON, infinities and NaN become the strings ``inf``, ``-inf``, ``nan``.
    """
    if fmt == "json":
        keys = _unique_keys(columns)
        objects = [{c: _plain(v) for c, v in zip(keys, row, strict=True)} for row in rows]
        return json.dumps(objects, indent=2, allow_nan=False)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow(
                ["" if v is None else repr(v) if isinstance(v, float) else _cell(v) for v in row]
            )
        return out.getvalue()
    if fmt != "table":
        raise InvalidRecord(f"unknown format {fmt!r}; use table, csv or json")
    if not columns:
        return "(no rows)"
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(str(c))] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [
        bool(rows) and all(_is_number(r[i]) or r[i] is None for r in rows)
        for i in range(len(columns))
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    lines = [line([str(c) for c in columns]), "  ".join("-" * w for w in widths)]
    lines += [line(r) for r in cells]
    lines.append(f"({len(rows)} row{'' if len(rows) == 1 else 's'})")
    return "\n".join(lines)
