"""Read-only SQL over an archive (``tapestry sql``), and formatting of the result rows.

Safety does not rest on reading the SQL text. The database itself refuses writes:

* SQLite: the file is opened with ``mode=ro``, ``PRAGMA query_only`` is on, and an authorizer
  allows only reads (SELECT, reading columns, functions, recursive CTEs, introspection pragmas),
  which also blocks TEMP tables and ATTACH that ``mode=ro`` alone would allow;
* PostgreSQL: the session starts with ``default_transaction_read_only=on`` and the statement is
  sent as a prepared statement (extended protocol), which the server refuses to run when it holds
  more than one command, so no ``COMMIT; BEGIN READ WRITE; ...`` sequence can slip through.

On top, a small lexer counts statements first so that a multi-statement query gets a clear
message on every backend.
"""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import io
import json
import math
import re
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError

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

__all__ = ["format_rows", "run_readonly_query", "split_statements"]

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
        "query (SELECT, WITH ... SELECT, EXPLAIN, introspection PRAGMA); change the archive "
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


def run_readonly_query(
    url: str | Path | URL, sql: str, limit: int | None = None
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one read-only SQL statement against an archive; return ``(columns, rows)``.

    ``limit`` caps the number of rows fetched (None: all). A statement that returns no rows
    gives ``([], [])``.

    Raises :class:`~storage.errors.ReadOnlyViolation` for any write (INSERT, UPDATE, DELETE,
    CREATE, DROP, ...), :class:`~storage.errors.MultipleStatements` for more than one statement,
    :class:`~storage.errors.QueryError` for SQL the database rejects, and
    :class:`~storage.errors.ArchiveUnavailable` when the archive cannot be opened.
    """
    if limit is not None and limit < 0:
        raise InvalidRecord(f"limit must be >= 0, got {limit}")
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

    engine = make_engine(parsed, readonly=True)
    try:
        raw = engine.raw_connection()
        try:
            driver: Any = raw.driver_connection
            if dialect == "sqlite":
                return _run_sqlite(driver, statement, limit, where)
            if dialect == "postgresql":
                return _run_postgresql(driver, statement, limit, where)
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


def _run_sqlite(
    conn: sqlite3.Connection, statement: str, limit: int | None, where: str
) -> tuple[list[str], list[tuple[Any, ...]]]:
    conn.execute("PRAGMA query_only = ON")
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


def _run_postgresql(
    conn: Any, statement: str, limit: int | None, where: str
) -> tuple[list[str], list[tuple[Any, ...]]]:
    import psycopg

    try:
        with conn.cursor() as cursor:
            # prepare=True: extended protocol, so the server runs at most one command.
            cursor.execute(statement, prepare=True)
            return _fetch(cursor, limit)
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
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


def format_rows(
    columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: Format = "table"
) -> str:
    """Render query results as ``table`` (aligned text), ``csv`` or ``json`` (list of objects).

    NULL is ``NULL`` in tables, empty in CSV and ``null`` in JSON; binary values show as
    ``<N bytes>``; in JSON, infinities and NaN become the strings ``inf``, ``-inf``, ``nan``.
    """
    if fmt == "json":
        objects = [{c: _plain(v) for c, v in zip(columns, row, strict=True)} for row in rows]
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
