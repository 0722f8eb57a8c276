"""How many bytes an archive takes on disk (``tapestry status`` and the soak benchmark)."""

from __future__ import annotations

import os

from sqlalchemy import text
from sqlalchemy.orm import Session

from storage.models import Base

__all__ = ["archive_bytes"]


def archive_bytes(s: Session) -> int | None:
    """Bytes of the archive behind session ``s``; None when the backend cannot tell.

    SQLite: the database file plus its write-ahead log (freed pages stay in the file and are
    reused, so this is the disk footprint). PostgreSQL: ``pg_total_relation_size`` (table,
    indexes and TOAST) summed over Tapestry's tables in the current schema.
    """
    bind = s.get_bind()
    dialect = bind.dialect.name
    if dialect == "sqlite":
        # The main database's file as SQLite itself resolved it (read-only engines open a
        # ``file:...?mode=ro`` URI, so the URL is not a path); empty for in-memory databases.
        rows = s.execute(text("PRAGMA database_list"))
        path = next((row[2] for row in rows if row[1] == "main"), "")
        if not path:
            return None
        return sum(os.path.getsize(p) for p in (path, f"{path}-wal") if os.path.exists(p))
    if dialect == "postgresql":
        stmt = text(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.relname = ANY(:names)"
        )
        return int(s.scalar(stmt, {"names": list(Base.metadata.tables)}) or 0)
    return None
