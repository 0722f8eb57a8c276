"""The one session helper: a transaction that commits, rolls back and translates errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from storage.engine import READ_OPTION
from storage.errors import StorageError, translate_db_error

__all__ = ["session_scope"]


@contextmanager
def session_scope(
    engine: Engine, *, write: bool = True, what: str = "archive"
) -> Iterator[Session]:
    """Run the body in one transaction and end it.

    Commits when the body returns, rolls back when it raises. Driver and SQLAlchemy errors are
    re-raised as :class:`~storage.errors.StorageError` subclasses whose message starts with
    ``what`` (e.g. ``"add_results for campaign 'mlp'"``); other exceptions pass unchanged.

    ``write=False`` marks a read-only transaction: on SQLite it starts with a deferred BEGIN
    instead of ``BEGIN IMMEDIATE`` so it does not wait for writers. Do not write inside it.
    """
    bind = engine.execution_options(**{READ_OPTION: True}) if not write else engine
    session = Session(bind=bind, autoflush=False, expire_on_commit=False)
    try:
        yield session
        session.commit()
    except SQLAlchemyError as exc:
        _rollback_quietly(session)
        raise translate_db_error(exc, what) from exc
    except BaseException:
        _rollback_quietly(session)
        raise
    finally:
        session.close()


def _rollback_quietly(session: Session) -> None:
    # A failed rollback (dead connection) must not hide the error that caused it.
    with suppress(SQLAlchemyError, StorageError):
        session.rollback()
