"""The campaign archive: the one interface the rest of Tapestry uses to reach the database."""

from __future__ import annotations

import difflib
import json
import math
import shlex
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from sqlalchemy import Engine, delete, func, insert, select, update
from sqlalchemy.engine import URL
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from storage.engine import DEFAULT_BUSY_TIMEOUT_S, display_url, make_engine
from storage.errors import (
    CampaignExists,
    CampaignNotFound,
    CandidateNotFound,
    InvalidRecord,
    ReadOnlyViolation,
    StorageError,
)
from storage.migrate import check_at_head, upgrade
from storage.models import (
    CALIBRATION_ROLES,
    CAMPAIGN_STATUSES,
    Campaign,
    Candidate,
    PLAN_KINDS,
    Checkpoint,
    Evaluation,
    EvaluationInterval,
    FrontEntry,
    Calibration,
    Measurement,
    utcnow,
)
from storage.parquet import write_front_parquet
from storage.records import (
    OBJECTIVE_COLUMNS,
    FrontChange,
    PreparedResults,
    as_float,
    as_int,
    dumps_json,
    prepare_front,
    prepare_measurement,
    prepare_results,
)
from storage.retention import Replay, RetentionPolicy, compact_campaign, load_plan, reclaim_space
from storage.session import session_scope
from storage.sizes import archive_bytes

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["OBJECTIVE_COLUMNS", "Archive"]

# Keeps IN (...) lists well below SQLite's and PostgreSQL's bound-parameter limits.
_IN_CHUNK = 500


#: Tables a running campaign deletes from or updates often (the campaign row's counters at every
#: merge, checkpoints every few seconds): vacuumed after each compaction that changed rows.
VACUUMED_TABLES = ("campaigns", "candidates", "evaluations", "evaluation_intervals", "front", "checkpoints")


class Archive:
    """A campaign archive in SQLite (default) or PostgreSQL.

    Contract
    --------
    **Who writes.** Only the campaign driver writes (campaigns, results, front, checkpoints);
    workers return plain data to the driver and never open the archive. Tools (``tapestry
    status``, ``export``, ``sql``) read, preferably through ``Archive.open(url, readonly=True)``.
    Several writers are nevertheless safe: every write method is one short transaction, and
    on SQLite each write transaction starts with ``BEGIN IMMEDIATE``, so writers queue on the
    busy timeout (30 s) instead of losing updates; read-modify-write methods lock the campaign
    row (``SELECT ... FOR UPDATE`` on PostgreSQL).

    **Consistency.** Each method is atomic: it commits entirely or not at all. Reads see only
    committed data.

    **Threads and processes.** An ``Archive`` may be shared by threads of one process (each
    call takes its own pooled connection). Each process opens its own ``Archive``; do not carry
    an open one across ``fork``.

    **Data.** Methods take and return plain Python data (str, int, float, bool, dict, list,
    timezone-aware UTC ``datetime``); no ORM object leaves this class. Campaigns are named by
    their unique name, candidates by their SHA-256 hex digest within a campaign. JSON values
    (config, counters, checkpoint state, measurement details) must be JSON-serializable.
    Objective values must not be NaN (``inf`` is fine); NaN ``lower_bound``/``gap`` are stored
    as NULL (unknown).

    **Errors.** Every method raises only :class:`~storage.errors.StorageError` subclasses:
    ``CampaignNotFound`` for an unknown campaign name, ``InvalidRecord`` for malformed input
    (checked before the transaction starts), ``ReadOnlyViolation`` for writes to a read-only
    archive, ``DatabaseBusy`` when the lock wait times out, ``ArchiveUnavailable`` for
    connection failures; each method's docstring lists the others. A failed call changes
    nothing.

    Opening an archive for writing migrates its schema to the newest revision (creating the
    tables in an empty database); opening read-only requires the newest revision.
    """

    #: Checkpoints kept per campaign; older ones are deleted by :meth:`save_checkpoint`.
    CHECKPOINTS_KEPT = 3

    def __init__(self, engine: Engine, *, readonly: bool = False, where: str | None = None) -> None:
        """Wrap an engine from :func:`storage.make_engine` (already migrated). Prefer
        :meth:`open`. ``where`` names the archive in messages (default: from the engine URL).
        """
        self._engine = engine
        self._readonly = readonly
        self._closed = False
        self._where = where or display_url(engine.url)

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def open(
        cls,
        url: str | Path | URL,
        *,
        readonly: bool = False,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
    ) -> Archive:
        """Open the archive at ``url`` (a SQLite file path or a database URL).

        For writing, creates the file/tables if needed and migrates the schema to the newest
        revision. Read-only, the archive must exist and be at the newest revision.

        Raises ``ArchiveUnavailable`` (cannot open or connect) and ``SchemaError`` (migration
        failed, or the archive is newer than this code, or read-only and out of date).
        """
        engine = make_engine(url, readonly=readonly, busy_timeout_s=busy_timeout_s)
        try:
            if readonly:
                check_at_head(engine)
            else:
                upgrade(engine)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine, readonly=readonly, where=display_url(url))

    def close(self) -> None:
        """Release all connections. Further calls raise ``StorageError``. Idempotent."""
        if not self._closed:
            self._closed = True
            self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def url(self) -> str:
        """The archive's URL, password hidden."""
        return self._where

    @property
    def readonly(self) -> bool:
        """Whether this archive was opened read-only."""
        return self._readonly

    @property
    def engine(self) -> Engine:
        """The underlying engine (for Optuna's RDB storage and tools; prefer the methods)."""
        return self._engine

    def __repr__(self) -> str:
        mode = "readonly" if self._readonly else "readwrite"
        return f"Archive({self._where!r}, {mode}{', closed' if self._closed else ''})"

    # ------------------------------------------------------------------ campaigns

    def create_campaign(
        self,
        name: str,
        config: Mapping[str, Any],
        config_hash: str,
        objectives: Sequence[str],
        reference_point: Sequence[float],
    ) -> int:
        """Store a new campaign with status ``created``; return its id.

        ``config`` is the resolved campaign config, ``objectives`` the objective names in order
        and ``reference_point`` the hypervolume reference point (one finite value per objective),
        fixed for the campaign's life.

        Raises ``CampaignExists`` if the name is taken, ``InvalidRecord`` for bad arguments.
        """
        if not isinstance(name, str) or not name.strip():
            raise InvalidRecord(f"campaign name must be a non-empty string, got {name!r}")
        objective_list = [str(o) for o in objectives]
        if not objective_list:
            raise InvalidRecord(f"campaign {name!r}: objectives must name at least one objective")
        point = [as_float(v, f"campaign {name!r}: reference_point") for v in reference_point]
        if len(point) != len(objective_list) or not all(math.isfinite(v) for v in point):
            raise InvalidRecord(
                f"campaign {name!r}: reference_point must hold one finite value per objective "
                f"({len(objective_list)}: {', '.join(objective_list)}), got {list(reference_point)}"
            )
        config_json = dumps_json(dict(config), f"campaign {name!r}: config", allow_nan=False)
        now = utcnow()
        with self._write(f"creating campaign {name!r}") as s:
            if s.scalar(select(Campaign.id).where(Campaign.name == name)) is not None:
                raise self._exists(name)
            row = Campaign(
                name=name,
                config_json=config_json,
                config_hash=str(config_hash),
                status="created",
                created_at=now,
                updated_at=now,
                reference_point_json=json.dumps(point),
                objectives_json=json.dumps(objective_list),
                counters_json="{}",
            )
            s.add(row)
            try:
                s.flush()
            except IntegrityError as exc:  # lost a race with another writer (PostgreSQL)
                raise self._exists(name) from exc
            return int(row.id)

    def get_campaign(self, name: str) -> dict[str, Any]:
        """The campaign as a dict: id, name, config, config_hash, status, objectives,
        reference_point, counters, created_at, updated_at.

        Raises ``CampaignNotFound``.
        """
        with self._read(f"reading campaign {name!r}") as s:
            return _campaign_dict(self._campaign(s, name))

    def list_campaigns(self) -> list[dict[str, Any]]:
        """All campaigns (same dicts as :meth:`get_campaign`), oldest first."""
        with self._read("listing campaigns") as s:
            rows = s.scalars(select(Campaign).order_by(Campaign.created_at, Campaign.id))
            return [_campaign_dict(row) for row in rows]

    def set_status(self, name: str, status: str) -> None:
        """Set a campaign's status (one of created, running, paused, finished, failed).

        Raises ``CampaignNotFound``, ``InvalidRecord`` for an unknown status.
        """
        if status not in CAMPAIGN_STATUSES:
            raise InvalidRecord(
                f"unknown campaign status {status!r}; use one of {', '.join(CAMPAIGN_STATUSES)}"
            )
        with self._write(f"setting the status of campaign {name!r}") as s:
            cid = self._campaign_id(s, name)
            s.execute(
                update(Campaign)
                .where(Campaign.id == cid)
                .values(status=status, updated_at=utcnow())
            )

    def update_counters(self, name: str, counters: Mapping[str, Any]) -> dict[str, Any]:
        """Merge ``counters`` into the campaign's counters (keys replaced); return the result.

        Raises ``CampaignNotFound``, ``InvalidRecord`` if the values are not JSON data.
        """
        dumps_json(dict(counters), f"counters of campaign {name!r}")
        return self._modify_counters(name, lambda current: {**current, **counters})

    def claim(self, name: str, check: Callable[[dict[str, Any]], None], counters: Mapping[str, Any]) -> None:
        """Make this process the campaign's driver, atomically: in one locked transaction read the
        campaign (as :meth:`get_campaign` returns it), call ``check`` on it (it raises to refuse,
        e.g. because another driver is alive), then set its status to ``running`` and merge
        ``counters`` (the driver's identity). Two drivers started together cannot both pass.

        Raises ``CampaignNotFound``, and whatever ``check`` raises (nothing is changed then).
        """
        dumps_json(dict(counters), f"counters of campaign {name!r}")
        with self._write(f"claiming campaign {name!r}") as s:
            # Row lock on PostgreSQL; on SQLite BEGIN IMMEDIATE already serializes writers.
            row = self._campaign(s, name, lock=True)
            check(_campaign_dict(row))
            row.status = "running"
            row.counters_json = dumps_json({**json.loads(row.counters_json), **counters},
                                           f"counters of campaign {name!r}")
            row.updated_at = utcnow()

    def increment_counters(self, name: str, deltas: Mapping[str, float]) -> dict[str, Any]:
        """Add ``deltas`` to numeric counters (missing ones start at 0); return the result.

        Atomic even with several writers: the read and the write are one locked transaction.
        Raises ``CampaignNotFound``, ``InvalidRecord`` for non-numeric deltas or counters.
        """
        for key, delta in deltas.items():
            if isinstance(delta, bool) or not isinstance(delta, int | float):
                raise InvalidRecord(f"counter delta {key!r} must be a number, got {delta!r}")

        def add(current: dict[str, Any]) -> dict[str, Any]:
            merged = dict(current)
            for key, delta in deltas.items():
                value = merged.get(key, 0)
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise InvalidRecord(
                        f"counter {key!r} of campaign {name!r} holds {value!r}, not a number"
                    )
                merged[key] = value + delta
            return merged

        return self._modify_counters(name, add)

    # ------------------------------------------------------------------ results and front

    def add_results(self, campaign: str, batch: Iterable[Mapping[str, Any]]) -> int:
        """Store a batch of evaluated plans in one transaction; return how many candidates
        were new.

        Each item is a dict with keys ``digest`` (SHA-256 hex), ``graph_json`` (str),
        ``objectives`` (dict: makespan, energy, peak_memory, devices, bytes_moved), ``feasible``,
        ``seq``, and optional ``parent_digest``, ``rewrite``, ``lower_bound``, ``gap``,
        ``worker``, ``eval_seconds``, ``evaluated_at``. A candidate already stored (same digest
        in the campaign, or earlier in the batch) is not stored again; its evaluation is.

        Raises ``CampaignNotFound``, ``InvalidRecord`` (naming the item and field).
        """
        prepared = prepare_results(campaign, batch)
        if not prepared.evaluations:
            return 0
        with self._write(f"add_results for campaign {campaign!r}") as s:
            return self._store_results(s, self._campaign_id(s, campaign), prepared)

    def update_front(
        self, campaign: str, entered: Sequence[str], left: Sequence[str], seq: int
    ) -> None:
        """Record front changes at evaluation counter ``seq`` in one transaction.

        Candidates in ``left`` leave the current front (ignored if not on it); candidates in
        ``entered`` join it (ignored if already on it). Both must be stored candidates.

        Raises ``CampaignNotFound``, ``CandidateNotFound``, ``InvalidRecord`` (a digest in both
        lists).
        """
        change = prepare_front(campaign, entered, left, seq)
        with self._write(f"update_front for campaign {campaign!r}") as s:
            # Lock the campaign row: concurrent front updates must not both add a member
            # (PostgreSQL; SQLite's BEGIN IMMEDIATE already serializes them).
            row = self._campaign(s, campaign, lock=True)
            self._store_front(s, int(row.id), campaign, change)

    def record_merge(
        self,
        campaign: str,
        results: Iterable[Mapping[str, Any]],
        *,
        entered: Sequence[str] = (),
        left: Sequence[str] = (),
        front_seq: int | None = None,
        counters: Mapping[str, Any] | None = None,
    ) -> int:
        """:meth:`add_results`, :meth:`update_front` and :meth:`update_counters` in ONE
        transaction; return how many candidates were new.

        Use it for the driver's merge step: after a crash the stored evaluations, the front and
        the counters (e.g. the ``seq`` the driver resumes from) still agree, which three separate
        calls cannot promise. ``front_seq`` defaults to the highest ``seq`` in ``results``.

        Raises ``CampaignNotFound``, ``CandidateNotFound``, ``InvalidRecord``.
        """
        prepared = prepare_results(campaign, results)
        change: FrontChange | None = None
        if entered or left:
            if front_seq is None:
                if not prepared.evaluations:
                    raise InvalidRecord(
                        f"record_merge for campaign {campaign!r}: front changes need front_seq "
                        "when no results are given"
                    )
                front_seq = max(int(e["seq"]) for _, e in prepared.evaluations)
            change = prepare_front(campaign, entered, left, front_seq)
        if counters is not None:
            dumps_json(dict(counters), f"counters of campaign {campaign!r}")
        with self._write(f"record_merge for campaign {campaign!r}") as s:
            row = self._campaign(s, campaign, lock=True)
            cid = int(row.id)
            inserted = self._store_results(s, cid, prepared) if prepared.evaluations else 0
            if change is not None:
                self._store_front(s, cid, campaign, change)
            if counters is not None:
                merged = {**json.loads(row.counters_json), **counters}
                row.counters_json = dumps_json(merged, f"counters of campaign {campaign!r}")
                row.updated_at = utcnow()
            return inserted

    def current_front(self, campaign: str) -> list[dict[str, Any]]:
        """The current Pareto front, ordered by entry.

        Each dict: ``digest``, ``objectives`` (dict of the five objectives, from the candidate's
        latest evaluation), ``feasible``, ``lower_bound``, ``gap``, ``rewrite``,
        ``parent_digest``, ``entered_seq``, ``entered_at``.

        Raises ``CampaignNotFound``.
        """
        with self._read(f"reading the front of campaign {campaign!r}") as s:
            cid = self._campaign_id(s, campaign)
            on_front = select(FrontEntry.candidate_id).where(
                FrontEntry.campaign_id == cid, FrontEntry.left_at.is_(None)
            )
            latest = (
                select(Evaluation.candidate_id, func.max(Evaluation.id).label("eid"))
                .where(Evaluation.candidate_id.in_(on_front))
                .group_by(Evaluation.candidate_id)
                .subquery()
            )
            stmt = (
                select(
                    FrontEntry.entered_seq,
                    FrontEntry.entered_at,
                    Candidate.digest,
                    Candidate.parent_digest,
                    Candidate.rewrite,
                    *(getattr(Evaluation, c) for c in OBJECTIVE_COLUMNS),
                    Evaluation.feasible,
                    Evaluation.lower_bound,
                    Evaluation.gap,
                )
                .join(Candidate, Candidate.id == FrontEntry.candidate_id)
                .outerjoin(latest, latest.c.candidate_id == Candidate.id)
                .outerjoin(Evaluation, Evaluation.id == latest.c.eid)
                .where(FrontEntry.campaign_id == cid, FrontEntry.left_at.is_(None))
                .order_by(FrontEntry.entered_seq, FrontEntry.id)
            )
            return [
                {
                    "digest": r.digest,
                    "objectives": {c: getattr(r, c) for c in OBJECTIVE_COLUMNS},
                    "feasible": r.feasible,
                    "lower_bound": r.lower_bound,
                    "gap": r.gap,
                    "rewrite": r.rewrite,
                    "parent_digest": r.parent_digest,
                    "entered_seq": r.entered_seq,
                    "entered_at": r.entered_at,
                }
                for r in s.execute(stmt)
            ]

    def front_history(self, campaign: str) -> list[dict[str, Any]]:
        """Every stay on the front, ordered by entry: ``digest``, ``entered_seq``,
        ``entered_at``, ``left_seq``, ``left_at`` (``left_*`` None while still on the front).

        Raises ``CampaignNotFound``.
        """
        with self._read(f"reading the front history of campaign {campaign!r}") as s:
            cid = self._campaign_id(s, campaign)
            stmt = (
                select(
                    Candidate.digest,
                    FrontEntry.entered_seq,
                    FrontEntry.entered_at,
                    FrontEntry.left_seq,
                    FrontEntry.left_at,
                )
                .join(Candidate, Candidate.id == FrontEntry.candidate_id)
                .where(FrontEntry.campaign_id == cid)
                .order_by(FrontEntry.entered_seq, FrontEntry.id)
            )
            return [dict(r._mapping) for r in s.execute(stmt)]

    def get_graph_json(self, campaign: str, digest: str, *, replay: Replay | None = None) -> str:
        """The stored graph JSON of a candidate.

        A plan kept as a delta (see :mod:`storage.retention`) is rebuilt from its nearest full
        ancestor with ``replay(parent_json, rewrite) -> (child_json, child_digest)``, which the
        optimizer supplies; each step's digest is checked.

        Raises ``CampaignNotFound``, ``CandidateNotFound``, ``PlanNotKept`` (the retention policy
        kept only its objectives), ``StorageError`` (corrupt, or a delta without ``replay``).
        """
        with self._read(f"reading candidate {digest} of campaign {campaign!r}") as s:
            cid = self._campaign_id(s, campaign)
            return load_plan(s, cid, campaign, digest, replay)

    # ------------------------------------------------------------------ retention

    def compact(
        self,
        campaign: str,
        policy: RetentionPolicy | None = None,
        *,
        replay: Replay | None = None,
        keep: Iterable[str] = (),
        after_step: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        """Apply a retention policy to a campaign (default policy if None); return a report.

        Thins what the policy does not keep and stores plans as deltas where smaller (only
        with ``replay``); see :mod:`storage.retention` for what is kept and why a crash halfway
        loses nothing kept. The caller must be the campaign's only writer meanwhile. On
        PostgreSQL a compaction that changed rows ends with a ``VACUUM`` of the campaign tables
        (``vacuum_seconds`` in the report), so deleted rows' space is reused and the archive
        stops growing; a vacuum that fails is noted in ``notes``.

        Raises ``CampaignNotFound``, ``ReadOnlyViolation``.
        """
        self._check_open()
        if self._readonly:
            raise ReadOnlyViolation(
                f"compacting campaign {campaign!r}: the archive at {self._where} was opened "
                "read-only; open it without readonly=True to change it"
            )
        with self._read(f"compacting campaign {campaign!r}") as s:
            cid = self._campaign_id(s, campaign)
        report = compact_campaign(
            self._write,
            self._read,
            cid,
            policy or RetentionPolicy(),
            replay=replay,
            keep=keep,
            after_step=after_step,
        )
        if report.changed_rows:
            # PostgreSQL keeps deleted rows as dead tuples until a vacuum (storage.retention).
            # A failed vacuum loses nothing (autovacuum still runs): noted, not raised.
            try:
                report.vacuum_seconds = reclaim_space(self._engine, VACUUMED_TABLES)
            except SQLAlchemyError as e:
                report.notes.append(f"VACUUM failed ({type(e).__name__}: {str(e).splitlines()[0]})")
        return report.as_dict()

    def evaluation_intervals(self, campaign: str) -> list[dict[str, Any]]:
        """Evaluations thinned by retention, aggregated per time bucket, oldest first.

        Each dict: bucket_start, bucket_seconds, evaluations, feasible, min_seq, max_seq,
        ``min_<objective>`` for each objective (over feasible evaluations; None if none),
        eval_seconds. Raises ``CampaignNotFound``.
        """
        with self._read(f"reading evaluation intervals of campaign {campaign!r}") as s:
            cid = self._campaign_id(s, campaign)
            rows = s.scalars(
                select(EvaluationInterval)
                .where(EvaluationInterval.campaign_id == cid)
                .order_by(EvaluationInterval.bucket_start)
            )
            keys = [c.key for c in EvaluationInterval.__table__.columns]
            return [
                {k: getattr(r, k) for k in keys if k not in ("id", "campaign_id")} for r in rows
            ]

    def storage_stats(self, campaign: str | None = None) -> dict[str, Any]:
        """Archive size and row counts: ``{"bytes": int | None, "rows": {table: count}}``.

        ``bytes`` is the whole archive (SQLite: the file plus its WAL; PostgreSQL: the total
        relation size of Tapestry's tables); rows are the campaign's (all campaigns if None).
        Candidates are also counted by ``plan_kind`` (``candidates_full`` etc.).

        Raises ``CampaignNotFound``.
        """
        with self._read("reading archive statistics") as s:
            cid = None if campaign is None else self._campaign_id(s, campaign)
            rows: dict[str, int] = {}
            for name, table in (
                ("candidates", Candidate),
                ("evaluations", Evaluation),
                ("front", FrontEntry),
                ("evaluation_intervals", EvaluationInterval),
                ("checkpoints", Checkpoint),
            ):
                stmt = select(func.count()).select_from(table)
                if cid is not None:
                    stmt = stmt.where(table.campaign_id == cid)
                rows[name] = int(s.scalar(stmt) or 0)
            stmt = select(Candidate.plan_kind, func.count()).group_by(Candidate.plan_kind)
            if cid is not None:
                stmt = stmt.where(Candidate.campaign_id == cid)
            kinds = {str(k): int(n) for k, n in s.execute(stmt)}
            for kind in PLAN_KINDS:
                rows[f"candidates_{kind}"] = int(kinds.get(kind, 0))
            return {"bytes": archive_bytes(s), "rows": rows}

    # ------------------------------------------------------------------ evaluations

    def evaluation_count(self, campaign: str) -> int:
        """Number of evaluations stored for the campaign, counting those the retention policy
        folded into ``evaluation_intervals``. Raises ``CampaignNotFound``."""
        with self._read(f"counting evaluations of campaign {campaign!r}") as s:
            cid = self._campaign_id(s, campaign)
            rows = s.scalar(select(func.count()).where(Evaluation.campaign_id == cid)) or 0
            folded = s.scalar(
                select(func.sum(EvaluationInterval.evaluations)).where(
                    EvaluationInterval.campaign_id == cid
                )
            )
            return int(rows) + int(folded or 0)

    def last_seq(self, campaign: str) -> int | None:
        """Highest evaluation ``seq`` stored for the campaign (None if none); for resume.

        Raises ``CampaignNotFound``.
        """
        with self._read(f"reading the last seq of campaign {campaign!r}") as s:
            cid = self._campaign_id(s, campaign)
            values = [
                s.scalar(select(func.max(Evaluation.seq)).where(Evaluation.campaign_id == cid)),
                s.scalar(
                    select(func.max(EvaluationInterval.max_seq)).where(
                        EvaluationInterval.campaign_id == cid
                    )
                ),
            ]
            known = [int(v) for v in values if v is not None]
            return max(known) if known else None

    def evaluations_frame(self, campaign: str) -> pd.DataFrame:
        """All evaluations of the campaign as a pandas DataFrame ordered by ``seq``.

        Columns: seq, digest, parent_digest, rewrite, the five objectives, feasible,
        lower_bound, gap, worker, eval_seconds, evaluated_at (UTC).

        Raises ``CampaignNotFound``.
        """
        import pandas as pd  # heavy; only tools that want frames pay for it

        columns = [
            "seq",
            "digest",
            "parent_digest",
            "rewrite",
            *OBJECTIVE_COLUMNS,
            "feasible",
            "lower_bound",
            "gap",
            "worker",
            "eval_seconds",
            "evaluated_at",
        ]
        with self._read(f"reading evaluations of campaign {campaign!r}") as s:
            cid = self._campaign_id(s, campaign)
            stmt = (
                select(
                    Evaluation.seq,
                    Candidate.digest,
                    Candidate.parent_digest,
                    Candidate.rewrite,
                    *(getattr(Evaluation, c) for c in OBJECTIVE_COLUMNS),
                    Evaluation.feasible,
                    Evaluation.lower_bound,
                    Evaluation.gap,
                    Evaluation.worker,
                    Evaluation.eval_seconds,
                    Evaluation.evaluated_at,
                )
                .join(Candidate, Candidate.id == Evaluation.candidate_id)
                .where(Evaluation.campaign_id == cid)
                .order_by(Evaluation.seq, Evaluation.id)
            )
            rows = [tuple(r) for r in s.execute(stmt)]
        frame = pd.DataFrame.from_records(rows, columns=columns)
        dtypes = {
            "seq": "int64",
            "makespan": "float64",
            "energy": "float64",
            "peak_memory": "float64",
            "devices": "int64",
            "bytes_moved": "float64",
            "feasible": "bool",
            "lower_bound": "float64",
            "gap": "float64",
            "eval_seconds": "float64",
        }
        frame = frame.astype(dtypes)
        frame["evaluated_at"] = pd.to_datetime(frame["evaluated_at"], utc=True)
        return frame

    def export_front_parquet(self, campaign: str, path: str | Path, front: list[dict[str, Any]] | None = None) -> int:
        """Write the current front (or ``front``, rows as :meth:`current_front` gives them: one
        snapshot for files written together while a driver runs) to a Parquet file; return the
        number of rows.

        Columns: campaign, digest, rewrite, parent_digest, the five objectives, feasible,
        lower_bound, gap, entered_seq, entered_at. The file's metadata holds the campaign's
        objectives and reference point (keys ``tapestry.objectives``,
        ``tapestry.reference_point``).

        Raises ``CampaignNotFound``; ``StorageError`` if the file cannot be written.
        """
        info = self.get_campaign(campaign)
        front = self.current_front(campaign) if front is None else front
        return write_front_parquet(
            path, campaign, info["objectives"], info["reference_point"], front
        )

    # ------------------------------------------------------------------ measurements

    def add_measurements(self, records: Iterable[Mapping[str, Any]]) -> int:
        """Store real execution measurements in one transaction; return how many.

        Each dict: ``plan_digest``, ``kind`` (plan|shard|transfer|kernel), ``backend``
        (numpy|cupy), ``device_name``, ``measured_seconds``, and optional ``campaign`` (name),
        ``op``, ``shard``, ``predicted_seconds``, ``verified``, ``max_rel_error``, ``details``
        (JSON dict), ``measured_at``. When ``campaign`` is given and ``plan_digest`` names one
        of its candidates, the measurement is linked to that candidate.

        Raises ``CampaignNotFound``, ``InvalidRecord``.
        """
        rows: list[tuple[str | None, dict[str, Any]]] = []
        now = utcnow()
        for index, record in enumerate(records):
            rows.append(prepare_measurement(record, f"measurement {index}", now))
        if not rows:
            return 0
        with self._write("add_measurements") as s:
            campaign_ids = {
                name: self._campaign_id(s, name) for name in {n for n, _ in rows if n is not None}
            }
            candidate_ids: dict[tuple[int, str], int] = {}
            for name, cid in campaign_ids.items():
                digests = list({r["plan_digest"] for n, r in rows if n == name})
                for digest, cand in self._candidate_ids(s, cid, digests).items():
                    candidate_ids[(cid, digest)] = cand
            values = []
            for owner, row in rows:
                owner_id = campaign_ids.get(owner) if owner is not None else None
                cand_id = (
                    candidate_ids.get((owner_id, row["plan_digest"]))
                    if owner_id is not None
                    else None
                )
                values.append({**row, "campaign_id": owner_id, "candidate_id": cand_id})
            s.execute(insert(Measurement), values)
        return len(rows)

    def measurements(self, campaign: str | None = None) -> list[dict[str, Any]]:
        """Stored measurements (all, or one campaign's), oldest first.

        Each dict has the keys accepted by :meth:`add_measurements` (``campaign`` None when
        unlinked, ``details`` parsed) plus ``id`` and ``candidate_digest`` (None when unlinked).

        Raises ``CampaignNotFound`` for an unknown campaign.
        """
        with self._read("reading measurements") as s:
            stmt = (
                select(Measurement, Campaign.name, Candidate.digest)
                .outerjoin(Campaign, Campaign.id == Measurement.campaign_id)
                .outerjoin(Candidate, Candidate.id == Measurement.candidate_id)
                .order_by(Measurement.id)
            )
            if campaign is not None:
                stmt = stmt.where(Measurement.campaign_id == self._campaign_id(s, campaign))
            return [
                {
                    "id": m.id,
                    "campaign": name,
                    "candidate_digest": digest,
                    "plan_digest": m.plan_digest,
                    "kind": m.kind,
                    "backend": m.backend,
                    "device_name": m.device_name,
                    "op": m.op,
                    "shard": m.shard,
                    "measured_seconds": m.measured_seconds,
                    "predicted_seconds": m.predicted_seconds,
                    "verified": m.verified,
                    "max_rel_error": m.max_rel_error,
                    "details": json.loads(m.details_json),
                    "measured_at": m.measured_at,
                }
                for m, name, digest in s.execute(stmt)
            ]

    # ------------------------------------------------------------------ calibrations

    def add_calibration(
        self, campaign: str, role: str, plans: int, hardware: Mapping[str, Any],
        report: Mapping[str, Any],
    ) -> int:
        """Store hardware refitted by ``campaign`` from ``plans`` sampled executions
        (``hardware``: ``Hardware.to_dict()``; ``report``: JSON data); returns its id.

        ``role``: ``sampling`` (the hardware the samples ran on) or ``target`` (the campaign's
        own hardware). Raises ``CampaignNotFound``, ``InvalidRecord``.
        """
        if role not in CALIBRATION_ROLES:
            raise InvalidRecord(f"calibration role {role!r}: expected one of {list(CALIBRATION_ROLES)}")
        hw_json = dumps_json(dict(hardware), f"calibrated hardware of campaign {campaign!r}")
        rep_json = dumps_json(dict(report), f"calibration report of campaign {campaign!r}")
        n = as_int(plans, "calibration plans")
        with self._write(f"storing a calibration of campaign {campaign!r}") as s:
            row = Calibration(campaign_id=self._campaign_id(s, campaign), role=role, plans=n,
                              created_at=utcnow(), hardware_json=hw_json, report_json=rep_json)
            s.add(row)
            s.flush()
            return int(row.id)

    def calibrations(self, campaign: str, role: str | None = None) -> list[dict[str, Any]]:
        """The campaign's calibrations, oldest first, as ``{"id", "role", "plans", "created_at",
        "hardware", "report"}`` (JSON parsed). Raises ``CampaignNotFound``."""
        with self._read(f"reading the calibrations of campaign {campaign!r}") as s:
            stmt = (select(Calibration).where(Calibration.campaign_id == self._campaign_id(s, campaign))
                    .order_by(Calibration.id))
            if role is not None:
                stmt = stmt.where(Calibration.role == role)
            return [{"id": c.id, "role": c.role, "plans": c.plans, "created_at": c.created_at,
                     "hardware": json.loads(c.hardware_json), "report": json.loads(c.report_json)}
                    for c in s.scalars(stmt)]

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, campaign: str, seq: int, state: Mapping[str, Any]) -> None:
        """Store the driver's state at evaluation counter ``seq``; keep only the latest
        :attr:`CHECKPOINTS_KEPT` checkpoints of the campaign.

        ``state`` must be JSON data (archive digests, populations, RNG states such as numpy
        ``bit_generator.state`` dicts, counters). Raises ``CampaignNotFound``, ``InvalidRecord``.
        """
        state_json = dumps_json(dict(state), f"checkpoint state of campaign {campaign!r}")
        seq = as_int(seq, "checkpoint seq")
        with self._write(f"saving a checkpoint of campaign {campaign!r}") as s:
            cid = self._campaign_id(s, campaign)
            s.add(Checkpoint(campaign_id=cid, seq=seq, created_at=utcnow(), state_json=state_json))
            s.flush()
            keep = (
                select(Checkpoint.id)
                .where(Checkpoint.campaign_id == cid)
                .order_by(Checkpoint.seq.desc(), Checkpoint.id.desc())
                .limit(self.CHECKPOINTS_KEPT)
            )
            kept_ids = list(s.scalars(keep))
            s.execute(
                delete(Checkpoint).where(
                    Checkpoint.campaign_id == cid, Checkpoint.id.not_in(kept_ids)
                )
            )

    def latest_checkpoint(self, campaign: str) -> dict[str, Any] | None:
        """The newest checkpoint as ``{"seq", "created_at", "state"}``, or None if there is none.

        Raises ``CampaignNotFound``.
        """
        with self._read(f"reading the latest checkpoint of campaign {campaign!r}") as s:
            cid = self._campaign_id(s, campaign)
            row = s.execute(
                select(Checkpoint.seq, Checkpoint.created_at, Checkpoint.state_json)
                .where(Checkpoint.campaign_id == cid)
                .order_by(Checkpoint.seq.desc(), Checkpoint.id.desc())
                .limit(1)
            ).first()
        if row is None:
            return None
        return {"seq": row.seq, "created_at": row.created_at, "state": json.loads(row.state_json)}

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"the archive at {self._where} is closed; open it again")

    def _write(self, what: str) -> AbstractContextManager[Session]:
        self._check_open()
        if self._readonly:
            raise ReadOnlyViolation(
                f"{what}: the archive at {self._where} was opened read-only; "
                "open it without readonly=True to change it"
            )
        return session_scope(self._engine, write=True, what=what)

    def _read(self, what: str) -> AbstractContextManager[Session]:
        self._check_open()
        return session_scope(self._engine, write=False, what=what)

    def _campaign(self, s: Session, name: str, *, lock: bool = False) -> Campaign:
        stmt = select(Campaign).where(Campaign.name == name)
        if lock:
            stmt = stmt.with_for_update()
        row = s.scalar(stmt)
        if row is None:
            raise self._not_found(s, name)
        return row

    def _campaign_id(self, s: Session, name: str) -> int:
        cid = s.scalar(select(Campaign.id).where(Campaign.name == name))
        if cid is None:
            raise self._not_found(s, name)
        return int(cid)

    def _not_found(self, s: Session, name: str) -> CampaignNotFound:
        names = list(s.scalars(select(Campaign.name)))
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return CampaignNotFound(
            f"no campaign named {name!r} in the archive at {self._where}.{hint} "
            f"Run `tapestry status --db {shlex.quote(self._where)}` to list the campaigns it holds."
        )

    def _exists(self, name: str) -> CampaignExists:
        return CampaignExists(
            f"a campaign named {name!r} already exists in the archive at {self._where}. "
            f"Continue it with `tapestry resume {name}`, or give the new campaign another name."
        )

    def _no_candidate(self, campaign: str, digests: Sequence[str]) -> CandidateNotFound:
        shown = ", ".join(digests[:3]) + (
            f" and {len(digests) - 3} more" if len(digests) > 3 else ""
        )
        return CandidateNotFound(
            f"campaign {campaign!r} in the archive at {self._where} has no candidate {shown}; "
            "store candidates with add_results before referring to them"
        )

    @staticmethod
    def _candidate_ids(s: Session, cid: int, digests: Sequence[str]) -> dict[str, int]:
        ids: dict[str, int] = {}
        for chunk in _chunks(list(digests)):
            stmt = select(Candidate.digest, Candidate.id).where(
                Candidate.campaign_id == cid, Candidate.digest.in_(chunk)
            )
            ids.update({d: int(i) for d, i in s.execute(stmt)})
        return ids

    def _store_results(self, s: Session, cid: int, prepared: PreparedResults) -> int:
        ids = self._candidate_ids(s, cid, list(prepared.candidates))
        fresh = [
            {**row, "campaign_id": cid} for d, row in prepared.candidates.items() if d not in ids
        ]
        self._restore_dropped_plans(s, cid, prepared, ids)
        inserted = 0
        if fresh:
            # ON CONFLICT DO NOTHING: a concurrent writer may store the same digest between
            # our SELECT and INSERT (PostgreSQL); RETURNING yields only the rows we stored.
            table = Candidate.__table__
            stmt = _insert_ignoring_conflicts(s, table, ["campaign_id", "digest"]).returning(
                table.c.digest, table.c.id
            )
            for digest, cand_id in s.execute(stmt, fresh):
                ids[digest] = int(cand_id)
                inserted += 1
            missing = [row["digest"] for row in fresh if row["digest"] not in ids]
            ids.update(self._candidate_ids(s, cid, missing))
        s.execute(
            insert(Evaluation),
            [
                {**row, "campaign_id": cid, "candidate_id": ids[digest]}
                for digest, row in prepared.evaluations
            ],
        )
        return inserted

    @staticmethod
    def _restore_dropped_plans(
        s: Session, cid: int, prepared: PreparedResults, ids: Mapping[str, int]
    ) -> None:
        # A plan the retention policy dropped may come back (a worker finds it again and the
        # strategy keeps it): store its plan again, so a later checkpoint can refetch it.
        if not ids:
            return
        for chunk in _chunks(list(ids.values())):
            dropped = s.scalars(
                select(Candidate.digest).where(
                    Candidate.id.in_(chunk), Candidate.plan_kind != "full"
                )
            )
            for digest in list(dropped):
                s.execute(
                    update(Candidate)
                    .where(Candidate.campaign_id == cid, Candidate.digest == digest)
                    .values(graph_zlib=prepared.candidates[digest]["graph_zlib"], plan_kind="full")
                )

    def _store_front(self, s: Session, cid: int, campaign: str, change: FrontChange) -> None:
        now = utcnow()
        digests = change.entered + change.left
        ids = self._candidate_ids(s, cid, digests)
        missing = [d for d in digests if d not in ids]
        if missing:
            raise self._no_candidate(campaign, missing)
        for chunk in _chunks([ids[d] for d in change.left]):
            s.execute(
                update(FrontEntry)
                .where(
                    FrontEntry.campaign_id == cid,
                    FrontEntry.candidate_id.in_(chunk),
                    FrontEntry.left_at.is_(None),
                )
                .values(left_at=now, left_seq=change.seq)
            )
        on_front: set[int] = set()
        for chunk in _chunks([ids[d] for d in change.entered]):
            on_front.update(
                s.scalars(
                    select(FrontEntry.candidate_id).where(
                        FrontEntry.campaign_id == cid,
                        FrontEntry.candidate_id.in_(chunk),
                        FrontEntry.left_at.is_(None),
                    )
                )
            )
        rows = [
            {
                "campaign_id": cid,
                "candidate_id": ids[d],
                "entered_at": now,
                "entered_seq": change.seq,
            }
            for d in change.entered
            if ids[d] not in on_front
        ]
        if rows:
            s.execute(insert(FrontEntry), rows)

    def _modify_counters(
        self, name: str, change: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> dict[str, Any]:
        with self._write(f"updating the counters of campaign {name!r}") as s:
            # Row lock on PostgreSQL; on SQLite BEGIN IMMEDIATE already serializes writers.
            row = self._campaign(s, name, lock=True)
            merged = change(json.loads(row.counters_json))
            row.counters_json = dumps_json(merged, f"counters of campaign {name!r}")
            row.updated_at = utcnow()
            return dict(merged)


# ---------------------------------------------------------------------- plain-data helpers


def _insert_ignoring_conflicts(s: Session, table: Any, columns: list[str]) -> Any:
    """INSERT ... ON CONFLICT (columns) DO NOTHING for the session's dialect."""
    dialect = s.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(table).on_conflict_do_nothing(index_elements=columns)
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table).on_conflict_do_nothing(index_elements=columns)
    return insert(table)


def _chunks(values: Sequence[Any], size: int = _IN_CHUNK) -> Iterator[Sequence[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]



def _campaign_dict(row: Campaign) -> dict[str, Any]:
    return {
        "id": row.id,
        "name": row.name,
        "config": json.loads(row.config_json),
        "config_hash": row.config_hash,
        "status": row.status,
        "objectives": json.loads(row.objectives_json),
        "reference_point": json.loads(row.reference_point_json),
        "counters": json.loads(row.counters_json),
        "created_at": row.created_at,
        "updated_at": row.updated_at,
    }
