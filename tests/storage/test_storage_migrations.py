"""Alembic migrations produce exactly the models' schema, on every backend."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from storage_testkit import new_campaign

from storage import Archive, SchemaError, make_engine
from storage.migrate import (
    MIGRATIONS_DIR,
    VERSION_TABLE,
    check_at_head,
    current_revision,
    downgrade,
    head_revision,
    include_name,
    upgrade,
)
from storage.models import Base

TABLES = {"campaigns", "candidates", "evaluations", "front", "measurements", "checkpoints"}


def _diffs(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "compare_type": True,
                    "version_table": VERSION_TABLE,
                    "include_name": include_name,
                },
            )
            return compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()


def test_migration_matches_models(db_url: str) -> None:
    upgrade(db_url)
    assert current_revision(db_url) == head_revision()
    assert _diffs(db_url) == []
    engine = make_engine(db_url)
    try:
        inspector = inspect(engine)
        assert set(inspector.get_table_names()) >= TABLES
        indexes = {i["name"] for i in inspector.get_indexes("evaluations")}
        assert {"ix_evaluations_campaign_id_seq", "ix_evaluations_candidate_id"} <= indexes
        uniques = inspector.get_unique_constraints("candidates")
        assert [u["column_names"] for u in uniques] == [["campaign_id", "digest"]]
    finally:
        engine.dispose()


def test_upgrade_is_idempotent_and_reversible(db_url: str) -> None:
    upgrade(db_url)
    upgrade(db_url)  # already at head: nothing to do
    downgrade(db_url, "base")
    assert current_revision(db_url) is None
    engine = make_engine(db_url)
    try:
        assert not TABLES & set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    upgrade(db_url)
    assert _diffs(db_url) == []


def test_open_migrates_and_keeps_data(db_url: str) -> None:
    assert current_revision(db_url) is None
    with Archive.open(db_url) as archive:
        assert current_revision(archive.engine) == head_revision()
        new_campaign(archive, "kept")
    with Archive.open(db_url) as archive:
        assert [c["name"] for c in archive.list_campaigns()] == ["kept"]


def test_archive_from_newer_tapestry_refused(db_url: str) -> None:
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = 'f00d'"))
        with pytest.raises(SchemaError, match="newer"):
            Archive.open(db_url)
        with pytest.raises(SchemaError, match="newer"):
            check_at_head(engine)
    finally:
        engine.dispose()


def test_readonly_open_needs_a_current_archive(db_url: str) -> None:
    if db_url.startswith("postgresql"):
        with pytest.raises(SchemaError, match="no Tapestry archive"):
            Archive.open(db_url, readonly=True)
    else:
        from storage import ArchiveUnavailable

        with pytest.raises(ArchiveUnavailable, match="does not exist"):
            Archive.open(db_url, readonly=True)
    upgrade(db_url)
    with Archive.open(db_url, readonly=True) as archive:
        assert archive.list_campaigns() == []


def test_optuna_shares_the_database(db_url: str) -> None:
    """Optuna's RDB storage (own tables, own "alembic_version") lives beside the archive."""
    optuna = pytest.importorskip("optuna")
    from sqlalchemy.engine import make_url

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna_url = (
        f"sqlite:///{db_url}"
        if "://" not in db_url
        else make_url(db_url).render_as_string(hide_password=False)
    )
    # Archive first, then Optuna, then the archive again: neither migration trips the other.
    with Archive.open(db_url) as archive:
        new_campaign(archive, "shared")
    study = optuna.create_study(storage=optuna_url, study_name="shared", directions=["minimize"])
    study.optimize(lambda trial: trial.suggest_float("x", -1.0, 1.0) ** 2, n_trials=3)
    with Archive.open(db_url) as archive:
        assert [c["name"] for c in archive.list_campaigns()] == ["shared"]
    assert current_revision(db_url) == head_revision()
    assert _diffs(db_url) == []  # Optuna's tables are not reported as ours
    reloaded = optuna.load_study(storage=optuna_url, study_name="shared")
    assert len(reloaded.trials) == 3


def test_migration_files_are_packaged() -> None:
    # pyproject.toml ships migrations/*.py and migrations/versions/*.py as package data.
    assert (MIGRATIONS_DIR / "env.py").is_file()
    assert sorted(p.name for p in (MIGRATIONS_DIR / "versions").glob("*.py")) == [
        "0001_initial.py",
        "0002_retention.py",
        "0003_calibrations.py",
    ]
