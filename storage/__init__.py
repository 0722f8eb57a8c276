"""The Tapestry archive: campaigns, candidates, evaluations, front, measurements, checkpoints.

SQLAlchemy over SQLite (default, a file) or PostgreSQL. Stores bytes, numbers and JSON only; it
imports no other Tapestry package. Entry points:

* :class:`Archive` - the driver's and tools' interface (see its contract docstring);
* :func:`make_engine` - engines with the SQLite locking discipline and read-only modes;
* :func:`run_readonly_query` / :func:`format_rows` - ``tapestry sql``;
* :mod:`storage.records` - validation of stored records (results, front changes, measurements);
* :mod:`storage.parquet` - Parquet export of a front;
* :mod:`storage.retention` - the retention policy and compaction (bounded archives);
* :mod:`storage.errors` - every error raised here is a ``StorageError``;
* :mod:`storage.migrate` - Alembic schema migrations, run when an archive is opened.
"""

from storage import errors
from storage.archive import Archive
from storage.engine import make_engine
from storage.errors import (
    ArchiveUnavailable,
    CampaignExists,
    CampaignNotFound,
    CandidateNotFound,
    DatabaseBusy,
    InvalidRecord,
    MultipleStatements,
    PlanNotKept,
    QueryError,
    ReadOnlyViolation,
    SchemaError,
    StorageError,
)
from storage.records import OBJECTIVE_COLUMNS
from storage.retention import NotReplayable, RetentionPolicy
from storage.session import session_scope
from storage.sql import format_rows, run_readonly_query

__all__ = [
    "OBJECTIVE_COLUMNS",
    "Archive",
    "ArchiveUnavailable",
    "CampaignExists",
    "CampaignNotFound",
    "CandidateNotFound",
    "DatabaseBusy",
    "InvalidRecord",
    "MultipleStatements",
    "NotReplayable",
    "PlanNotKept",
    "QueryError",
    "ReadOnlyViolation",
    "RetentionPolicy",
    "SchemaError",
    "StorageError",
    "errors",
    "format_rows",
    "make_engine",
    "run_readonly_query",
    "session_scope",
]
