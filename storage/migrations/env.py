"""Alembic environment for the archive schema.

Run through :func:`storage.migrate.upgrade`, which passes an open connection in
``config.attributes["connection"]``; there is no alembic.ini. With only a URL
(``sqlalchemy.url`` main option) it opens its own engine.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from storage.engine import make_engine
from storage.migrate import VERSION_TABLE, include_name
from storage.models import Base

# Any constant; serializes concurrent upgrades of one PostgreSQL database.
_PG_MIGRATION_LOCK = 0x7A9E57


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        include_name=include_name,  # leave Optuna's tables alone
        # Our SQLite engines emit BEGIN themselves, so DDL is transactional there too: a failed
        # migration leaves the file as it was.
        transactional_ddl=True,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK})")
        # (SQLite: BEGIN IMMEDIATE already holds the write lock.)
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(context.config.get_main_option("sqlalchemy.url") or "")
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (--sql) migrations are not supported for the Tapestry archive")
run_migrations_online()
