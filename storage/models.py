"""All archive tables, in one file.

The archive stores bytes, numbers and JSON text; nothing here knows what a graph is.

* ``campaigns``: one row per campaign: resolved config (JSON), status, objectives, the
  hypervolume reference point fixed at start, and driver counters (JSON).
* ``candidates``: one row per distinct plan of a campaign, keyed by the SHA-256 hex digest of its
  canonical JSON. ``parent_digest`` and ``rewrite`` record lineage (the parent and the textual
  rewrite that produced it). ``plan_kind`` says how the plan is kept: ``full`` (the JSON,
  zlib-compressed, in ``graph_zlib``), ``delta`` (``graph_zlib`` empty: replay ``rewrite`` on the
  stored parent) or ``dropped`` (``graph_zlib`` empty: the retention policy kept only the digest,
  lineage and objectives).
* ``evaluations``: one row per evaluation of a candidate: objectives, feasibility, lower bound
  and gap, who evaluated it and when; ``seq`` is the campaign's evaluation counter.
* ``front``: Pareto front membership history: a row per stay on the front. The current front is
  the rows with ``left_at`` NULL.
* ``measurements``: real executions (whole plans, shards, transfers, kernels) with measured and
  predicted seconds; campaign and candidate are optional (calibration runs have neither).
* ``evaluation_intervals``: evaluations the retention policy thinned away, aggregated per time
  bucket (count, feasible count, seq range, best value of each objective), so counts and
  best-so-far curves over the whole history stay answerable in SQL.
* ``calibrations``: hardware refitted by a campaign from its sampled executions (the calibrated
  hardware as JSON, and a JSON report: fitted factors, rank correlation and errors before and
  after); ``role`` is ``sampling`` (the hardware the samples ran on) or ``target`` (the
  campaign's own hardware, when the samples ran on its device kind).
* ``checkpoints``: JSON driver state for ``resume``; only the latest few per campaign are kept.

Timestamps are timezone-aware UTC. Integer keys are 64-bit on PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

__all__ = [
    "CAMPAIGN_STATUSES",
    "MEASUREMENT_BACKENDS",
    "MEASUREMENT_KINDS",
    "PLAN_KINDS",
    "Base",
    "CALIBRATION_ROLES",
    "Calibration",
    "Campaign",
    "Candidate",
    "Checkpoint",
    "Evaluation",
    "EvaluationInterval",
    "FrontEntry",
    "Measurement",
    "utcnow",
]

CAMPAIGN_STATUSES = ("created", "running", "paused", "finished", "failed")
MEASUREMENT_KINDS = ("plan", "shard", "transfer", "kernel")
MEASUREMENT_BACKENDS = ("numpy", "cupy")
PLAN_KINDS = ("full", "delta", "dropped")
CALIBRATION_ROLES = ("sampling", "target")

# Deterministic constraint names, so migrations can refer to them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# 64-bit keys on PostgreSQL; SQLite needs exactly INTEGER for an auto-incrementing rowid key
# (and its INTEGER is 64-bit anyway).
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """``DateTime(timezone=True)`` that always returns aware UTC datetimes.

    SQLite keeps no zone; PostgreSQL returns the session's zone. Both come back as UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        # SQLite's DATETIME storage drops the zone anyway; store plain UTC wall time.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _in_check(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    """Declarative base holding the archive's metadata."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Campaign(Base):
    """A search campaign: config, objectives, status, reference point, counters."""

    __tablename__ = "campaigns"
    __table_args__ = (
        UniqueConstraint("name"),
        CheckConstraint(_in_check("status", CAMPAIGN_STATUSES), name="status"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    config_json: Mapped[str] = mapped_column(Text)
    config_hash: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), default="created")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    reference_point_json: Mapped[str] = mapped_column(Text)
    objectives_json: Mapped[str] = mapped_column(Text)
    counters_json: Mapped[str] = mapped_column(Text, default="{}")


class Candidate(Base):
    """A distinct plan of a campaign, identified by its digest; graph JSON zlib-compressed
    (``plan_kind`` full), a rewrite of its parent (delta) or not kept (dropped)."""

    __tablename__ = "candidates"
    # The unique (campaign_id, digest) index also serves lookups by campaign_id alone.
    __table_args__ = (UniqueConstraint("campaign_id", "digest"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    campaign_id: Mapped[int] = mapped_column(BigId, ForeignKey("campaigns.id"))
    digest: Mapped[str] = mapped_column(String(64))
    # Empty unless plan_kind is full (a delta's plan is its rewrite of the parent).
    graph_zlib: Mapped[bytes] = mapped_column(LargeBinary)
    # One of PLAN_KINDS, checked by the code that writes it (no CHECK: SQLite cannot add one
    # to an existing table without copying it).
    plan_kind: Mapped[str] = mapped_column(String(8), default="full", server_default="full")
    parent_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    rewrite: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Evaluation(Base):
    """One evaluation of a candidate by the cost model."""

    __tablename__ = "evaluations"
    __table_args__ = (
        Index(None, "campaign_id", "seq"),
        Index(None, "candidate_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    campaign_id: Mapped[int] = mapped_column(BigId, ForeignKey("campaigns.id"))
    candidate_id: Mapped[int] = mapped_column(BigId, ForeignKey("candidates.id"))
    makespan: Mapped[float] = mapped_column(Double)
    energy: Mapped[float] = mapped_column(Double)
    peak_memory: Mapped[float] = mapped_column(Double)
    devices: Mapped[int] = mapped_column(Integer)
    bytes_moved: Mapped[float] = mapped_column(Double)
    feasible: Mapped[bool] = mapped_column(Boolean)
    lower_bound: Mapped[float | None] = mapped_column(Double, nullable=True)
    gap: Mapped[float | None] = mapped_column(Double, nullable=True)
    worker: Mapped[str | None] = mapped_column(Text, nullable=True)
    eval_seconds: Mapped[float | None] = mapped_column(Double, nullable=True)
    evaluated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # 64-bit: a fleet evaluating tens of thousands of plans a second passes 2**31 in days.
    seq: Mapped[int] = mapped_column(BigInteger)


class EvaluationInterval(Base):
    """Evaluations thinned by the retention policy, aggregated over one time bucket."""

    __tablename__ = "evaluation_intervals"
    __table_args__ = (UniqueConstraint("campaign_id", "bucket_start"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    campaign_id: Mapped[int] = mapped_column(BigId, ForeignKey("campaigns.id"))
    bucket_start: Mapped[datetime] = mapped_column(UTCDateTime())
    bucket_seconds: Mapped[float] = mapped_column(Double)
    evaluations: Mapped[int] = mapped_column(BigInteger)
    feasible: Mapped[int] = mapped_column(BigInteger)
    min_seq: Mapped[int] = mapped_column(BigInteger)
    max_seq: Mapped[int] = mapped_column(BigInteger)
    # Best (smallest) value of each objective over the bucket's feasible evaluations (NULL when
    # none was feasible): enough for best-so-far curves over the whole history.
    min_makespan: Mapped[float | None] = mapped_column(Double, nullable=True)
    min_energy: Mapped[float | None] = mapped_column(Double, nullable=True)
    min_peak_memory: Mapped[float | None] = mapped_column(Double, nullable=True)
    min_devices: Mapped[int | None] = mapped_column(Integer, nullable=True)
    min_bytes_moved: Mapped[float | None] = mapped_column(Double, nullable=True)
    eval_seconds: Mapped[float] = mapped_column(Double)


class FrontEntry(Base):
    """One stay of a candidate on the Pareto front (``left_*`` NULL while it stays)."""

    __tablename__ = "front"
    __table_args__ = (
        Index(None, "campaign_id", "left_at"),
        Index(None, "candidate_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    campaign_id: Mapped[int] = mapped_column(BigId, ForeignKey("campaigns.id"))
    candidate_id: Mapped[int] = mapped_column(BigId, ForeignKey("candidates.id"))
    entered_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    left_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    entered_seq: Mapped[int] = mapped_column(BigInteger)
    left_seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class Measurement(Base):
    """A real execution timing (plan, shard, transfer or kernel) with the model's prediction."""

    __tablename__ = "measurements"
    __table_args__ = (
        Index(None, "campaign_id"),
        Index(None, "candidate_id"),
        Index(None, "plan_digest"),
        CheckConstraint(_in_check("kind", MEASUREMENT_KINDS), name="kind"),
        CheckConstraint(_in_check("backend", MEASUREMENT_BACKENDS), name="backend"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    campaign_id: Mapped[int | None] = mapped_column(
        BigId, ForeignKey("campaigns.id"), nullable=True
    )
    candidate_id: Mapped[int | None] = mapped_column(
        BigId, ForeignKey("candidates.id"), nullable=True
    )
    plan_digest: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))
    backend: Mapped[str] = mapped_column(String(16))
    device_name: Mapped[str] = mapped_column(Text)
    op: Mapped[str | None] = mapped_column(Text, nullable=True)
    shard: Mapped[int | None] = mapped_column(Integer, nullable=True)
    measured_seconds: Mapped[float] = mapped_column(Double)
    predicted_seconds: Mapped[float | None] = mapped_column(Double, nullable=True)
    verified: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    max_rel_error: Mapped[float | None] = mapped_column(Double, nullable=True)
    details_json: Mapped[str] = mapped_column(Text, default="{}")
    measured_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Calibration(Base):
    """Hardware a campaign refitted from its sampled executions, with the fit's report (JSON)."""

    __tablename__ = "calibrations"
    __table_args__ = (
        Index(None, "campaign_id"),
        CheckConstraint(_in_check("role", CALIBRATION_ROLES), name="role"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    campaign_id: Mapped[int] = mapped_column(BigId, ForeignKey("campaigns.id"))
    role: Mapped[str] = mapped_column(String(16))
    plans: Mapped[int] = mapped_column(Integer)  # sampled plans the fit used
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    hardware_json: Mapped[str] = mapped_column(Text)
    report_json: Mapped[str] = mapped_column(Text, default="{}")


class Checkpoint(Base):
    """Driver state (JSON) at evaluation counter ``seq``, for ``tapestry resume``."""

    __tablename__ = "checkpoints"
    __table_args__ = (Index(None, "campaign_id", "seq"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    campaign_id: Mapped[int] = mapped_column(BigId, ForeignKey("campaigns.id"))
    seq: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    state_json: Mapped[str] = mapped_column(Text)
