"""Errors raised by the archive, and the translation of driver errors into them.

Every failure that leaves :mod:`storage` is a :class:`StorageError` subclass whose message is one
paragraph a user can act on (what went wrong, where, and the fix). The underlying driver exception
stays available as ``__cause__`` for debugging.
"""

from __future__ import annotations

from sqlalchemy import exc as sa_exc

__all__ = [
    "ArchiveUnavailable",
    "CampaignExists",
    "CampaignNotFound",
    "CandidateNotFound",
    "DatabaseBusy",
    "IntegrityViolation",
    "InvalidRecord",
    "MultipleStatements",
    "PlanNotKept",
    "QueryError",
    "ReadOnlyViolation",
    "SchemaError",
    "StorageError",
    "translate_db_error",
]


class StorageError(Exception):
    """Base class of every error raised by :mod:`storage`."""


class ArchiveUnavailable(StorageError):
    """The database cannot be opened or reached (missing file, server down, bad URL)."""


class SchemaError(StorageError):
    """The database schema is not the one this code expects (migration failed or too new)."""


class CampaignExists(StorageError):
    """A campaign with this name is already stored."""


class CampaignNotFound(StorageError, LookupError):
    """No campaign with this name is stored."""


class CandidateNotFound(StorageError, LookupError):
    """No candidate with this digest is stored in the campaign."""


class PlanNotKept(CandidateNotFound):
    """The candidate is stored, but the retention policy kept only its digest and objectives."""


class InvalidRecord(StorageError, ValueError):
    """Data handed to the archive is malformed (missing field, NaN objective, unknown status)."""


class IntegrityViolation(StorageError):
    """The database refused a write because it breaks a constraint."""


class DatabaseBusy(StorageError):
    """Another connection held the lock longer than the busy timeout."""


class ReadOnlyViolation(StorageError):
    """A write was attempted on a read-only connection."""


class QueryError(StorageError):
    """A user query passed to the read-only SQL interface failed (syntax, unknown table)."""


class MultipleStatements(QueryError):
    """A user query contained more than one SQL statement."""


# SQLite primary result codes (https://www.sqlite.org/rescode.html); extended codes carry the
# primary code in their low byte.
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_READONLY = 8
_SQLITE_CORRUPT = 11
_SQLITE_CANTOPEN = 14
_SQLITE_CONSTRAINT = 19
_SQLITE_AUTH = 23
_SQLITE_NOTADB = 26


def _reason(orig: BaseException | None, fallback: BaseException) -> str:
    text = str(orig if orig is not None else fallback).strip()
    # psycopg appends multi-line context; the first line is the message.
    return text.splitlines()[0] if text else type(fallback).__name__


def translate_db_error(exc: sa_exc.SQLAlchemyError, context: str) -> StorageError:
    """Map a SQLAlchemy/driver error to the matching :class:`StorageError` subclass.

    ``context`` says what was being done (e.g. ``"add_results to campaign 'mlp'"``) and starts the
    message. The caller raises the result ``from exc``.
    """
    orig = getattr(exc, "orig", None)
    reason = _reason(orig, exc)
    sqlite_code = getattr(orig, "sqlite_errorcode", None)
    sqlstate = getattr(orig, "sqlstate", None)
    primary = sqlite_code & 0xFF if isinstance(sqlite_code, int) else None

    if primary in (_SQLITE_READONLY, _SQLITE_AUTH) or sqlstate == "25006":
        return ReadOnlyViolation(
            f"{context}: the connection is read-only and refused a write ({reason}). "
            "Read-only access (tapestry sql, read-only archives) can only run queries; "
            "use the campaign commands to change the archive."
        )
    if primary in (_SQLITE_BUSY, _SQLITE_LOCKED) or sqlstate in ("40P01", "55P03", "40001"):
        return DatabaseBusy(
            f"{context}: the database stayed locked by another connection ({reason}). "
            "Only the campaign driver should write to an archive; stop other writers or retry."
        )
    if (
        primary == _SQLITE_CONSTRAINT
        or (sqlstate or "").startswith("23")
        or isinstance(exc, sa_exc.IntegrityError)
    ):
        return IntegrityViolation(f"{context}: the database refused the write ({reason}).")
    if primary in (_SQLITE_CANTOPEN, _SQLITE_NOTADB, _SQLITE_CORRUPT):
        return ArchiveUnavailable(
            f"{context}: cannot use the database file ({reason}). Check that the --db path "
            "points to a Tapestry archive and that its directory is readable and writable."
        )
    if (sqlstate or "").startswith(("08", "28", "3D")) or (
        sqlstate is None and primary is None and isinstance(exc, sa_exc.OperationalError)
    ):
        return ArchiveUnavailable(
            f"{context}: cannot connect to the database ({reason}). Check the --db URL, that "
            "the server is running and that the database exists."
        )
    if isinstance(exc, sa_exc.DBAPIError) and (
        (sqlstate or "").startswith(("42", "22")) or primary is not None
    ):
        return QueryError(f"{context}: the database rejected the statement ({reason}).")
    return StorageError(f"{context}: database error ({reason}).")
