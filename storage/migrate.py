"""Schema versioning with Alembic, run from code (no alembic.ini on disk).

Revisions live in ``storage/migrations/versions``. :func:`upgrade` brings a database to the newest
revision; :class:`storage.archive.Archive` calls it whenever it opens an archive for writing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError

from storage.engine import display_url, make_engine
from storage.errors import SchemaError, translate_db_error
from storage.models import Base

__all__ = [
    "alembic_config",
    "check_at_head",
    "current_revision",
    "downgrade",
    "head_revision",
    "include_name",
    "upgrade",
]

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

# Our own version table: Optuna's RDB storage keeps its study in the same database and runs its
# own Alembic migrations with the default "alembic_version" table.
VERSION_TABLE = "tapestry_alembic_version"


def include_name(name: str | None, type_: str, _parents: Any) -> bool:
    """Alembic ``include_name`` hook: compare only Tapestry's tables.

    Other tables in the database (Optuna's studies and trials) are not ours to migrate.
    """
    if type_ == "table":
        return name in Base.metadata.tables
    return True


def alembic_config() -> Config:
    """An Alembic config pointing at the packaged migrations."""
    config = Config()
    # configparser interpolation: a literal % in the install path must be doubled.
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return config


def head_revision() -> str:
    """The newest revision this code knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "storage/migrations/versions holds no revision"
    return head


def _engine_of(engine_or_url: Engine | str | Path | URL) -> tuple[Engine, bool]:
    if isinstance(engine_or_url, Engine):
        return engine_or_url, False
    return make_engine(engine_or_url), True


def current_revision(engine_or_url: Engine | str | Path | URL) -> str | None:
    """The revision a database is at (None for an empty database)."""
    engine, owned = _engine_of(engine_or_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            return context.get_current_revision()
    except SQLAlchemyError as exc:
        where = display_url(engine.url)
        raise translate_db_error(exc, f"reading the schema version of {where}") from exc
    finally:
        if owned:
            engine.dispose()


def upgrade(engine_or_url: Engine | str | Path | URL, revision: str = "head") -> None:
    """Migrate a database to ``revision`` (default: newest). Safe to run concurrently.

    Raises :class:`~storage.errors.SchemaError` when the database was written by a newer version
    of Tapestry (unknown revision) or a migration fails, and other
    :class:`~storage.errors.StorageError` subclasses for connection problems.
    """
    engine, owned = _engine_of(engine_or_url)
    where = display_url(engine.url)
    config = alembic_config()
    try:
        with engine.connect() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
    except CommandError as exc:
        raise SchemaError(
            f"cannot migrate the archive at {where} to revision {revision}: {exc}. If the "
            "archive was written by a newer Tapestry, upgrade Tapestry to open it."
        ) from exc
    except SQLAlchemyError as exc:
        raise translate_db_error(exc, f"migrating the archive at {where}") from exc
    finally:
        if owned:
            engine.dispose()


def downgrade(engine_or_url: Engine | str | Path | URL, revision: str) -> None:
    """Migrate a database down to ``revision`` (``"base"`` drops every table). For tests/tools."""
    engine, owned = _engine_of(engine_or_url)
    config = alembic_config()
    try:
        with engine.connect() as conn:
            config.attributes["connection"] = conn
            command.downgrade(config, revision)
    except CommandError as exc:
        raise SchemaError(f"cannot downgrade {display_url(engine.url)}: {exc}") from exc
    except SQLAlchemyError as exc:
        raise translate_db_error(exc, f"downgrading {display_url(engine.url)}") from exc
    finally:
        if owned:
            engine.dispose()


def check_at_head(engine: Engine) -> None:
    """Raise :class:`~storage.errors.SchemaError` unless the database is at the newest revision.

    Used for read-only archives, which cannot be migrated.
    """
    current = current_revision(engine)
    head = head_revision()
    if current == head:
        return
    where = display_url(engine.url)
    if current is None:
        raise SchemaError(
            f"{where} holds no Tapestry archive (no schema version). Check the --db URL."
        )
    known = {rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current not in known:
        raise SchemaError(
            f"the archive at {where} has schema revision {current}, which this Tapestry does not "
            "know: it was written by a newer version. Upgrade Tapestry to read it."
        )
    raise SchemaError(
        f"the archive at {where} has schema revision {current}, older than {head}. Open it once "
        "for writing (any campaign command) to migrate it, then retry."
    )
