"""Retention: candidates may keep their plan as a delta or drop it; thinned evaluations are
aggregated per time bucket.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

* ``candidates.plan_kind`` (full | delta | dropped, default full) says how the plan is kept;
  existing rows are ``full``. A delta or dropped plan keeps an empty ``graph_zlib``.
* New table ``evaluation_intervals``.

Written by hand and frozen (no storage.models import). Only ADD COLUMN and CREATE TABLE: no
copy of the candidates table, which is the largest in an old archive (and SQLite's copy-and-swap
would trip the foreign keys that point at it).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column(
        "candidates",
        sa.Column("plan_kind", sa.String(length=8), nullable=False, server_default="full"),
    )
    op.create_table(
        "evaluation_intervals",
        sa.Column("id", ID, nullable=False),
        sa.Column("campaign_id", ID, nullable=False),
        sa.Column("bucket_start", TS, nullable=False),
        sa.Column("bucket_seconds", sa.Double(), nullable=False),
        sa.Column("evaluations", sa.BigInteger(), nullable=False),
        sa.Column("feasible", sa.BigInteger(), nullable=False),
        sa.Column("min_seq", sa.BigInteger(), nullable=False),
        sa.Column("max_seq", sa.BigInteger(), nullable=False),
        sa.Column("min_makespan", sa.Double(), nullable=True),
        sa.Column("min_energy", sa.Double(), nullable=True),
        sa.Column("min_peak_memory", sa.Double(), nullable=True),
        sa.Column("min_devices", sa.Integer(), nullable=True),
        sa.Column("min_bytes_moved", sa.Double(), nullable=True),
        sa.Column("eval_seconds", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["campaign_id"], ["campaigns.id"], name="fk_evaluation_intervals_campaign_id_campaigns"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_evaluation_intervals"),
        sa.UniqueConstraint(
            "campaign_id", "bucket_start", name="uq_evaluation_intervals_campaign_id_bucket_start"
        ),
    )


def downgrade() -> None:
    op.drop_table("evaluation_intervals")
    # Plans kept as deltas or dropped cannot come back without the program: a downgrade keeps
    # only the candidates that still hold their full plan.
    conn = op.get_bind()
    kept = "SELECT id FROM candidates WHERE plan_kind = 'full'"
    conn.execute(
        sa.text(f"UPDATE measurements SET candidate_id = NULL WHERE candidate_id NOT IN ({kept})")
    )
    for table in ("evaluations", "front"):
        conn.execute(sa.text(f"DELETE FROM {table} WHERE candidate_id NOT IN ({kept})"))
    conn.execute(sa.text("DELETE FROM candidates WHERE plan_kind <> 'full'"))
    # Plain ALTER TABLE (SQLite >= 3.35 drops columns in place; batch mode would copy the table).
    conn.execute(sa.text("ALTER TABLE candidates DROP COLUMN plan_kind"))
