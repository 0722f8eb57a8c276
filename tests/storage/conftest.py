"""Backends for the storage suite: every test taking ``db_url`` runs on each of them.

SQLite (a temporary file) always; PostgreSQL when ``TAPESTRY_PG_URL`` is set (e.g.
``postgresql+psycopg://postgres@127.0.0.1:5432/tapestry_test``, see scripts/start_postgres.sh),
each test in a fresh schema dropped afterwards. If ``CI`` is set, an unreachable
``TAPESTRY_PG_URL`` fails the PostgreSQL tests instead of skipping them.
"""

from __future__ import annotations

import os
import sys
import urllib.parse
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import SQLAlchemyError

from storage import Archive

PG_ENV = "TAPESTRY_PG_URL"

# The test modules and spawned worker processes import storage_testkit from this directory,
# whatever pytest's import mode (spawned children inherit sys.path).
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def pg_base_url() -> str:
    """The PostgreSQL test server URL; skips (or fails under CI) when there is none."""
    url = os.environ.get(PG_ENV)
    if not url:
        pytest.skip(f"PostgreSQL tests need {PG_ENV} (see scripts/start_postgres.sh)")
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 5})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except SQLAlchemyError as exc:
        message = f"{PG_ENV}={url} is unreachable: {str(exc).splitlines()[0]}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return url


def _with_search_path(url: str, schema: str) -> str:
    option = urllib.parse.quote(f"-csearch_path={schema}")
    return f"{url}{'&' if '?' in url else '?'}options={option}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[str]:
    """An empty archive location on each backend."""
    if request.param == "sqlite":
        yield os.path.join(tmp_path, "farm.db")
        return
    base = request.getfixturevalue("pg_base_url")
    schema = f"tapestry_t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield _with_search_path(base, schema)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def archive(db_url: str) -> Iterator[Archive]:
    """An open, empty archive on each backend."""
    with Archive.open(db_url) as opened:
        yield opened
