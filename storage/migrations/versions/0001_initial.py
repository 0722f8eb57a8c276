"""Initial archive schema: campaigns, candidates, evaluations, front, measurements, checkpoints.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Written by hand and frozen: it must not import storage.models, whose later versions describe later
revisions. Types match the models (64-bit keys on PostgreSQL, INTEGER rowid keys on SQLite).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def _id() -> sa.Column[int]:
    return sa.Column("id", ID, nullable=False)


def upgrade() -> None:
    op.create_table(
        "campaigns",
        _id(),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("config_hash", sa.String(length=128), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("reference_point_json", sa.Text(), nullable=False),
        sa.Column("objectives_json", sa.Text(), nullable=False),
        sa.Column("counters_json", sa.Text(), nullable=False),
        sa.CheckConstraint(
            "status IN ('created', 'running', 'paused', 'finished', 'failed')",
            name="ck_campaigns_status",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_campaigns"),
        sa.UniqueConstraint("name", name="uq_campaigns_name"),
    )
    op.create_table(
        "candidates",
        _id(),
        sa.Column("campaign_id", ID, nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("graph_zlib", sa.LargeBinary(), nullable=False),
        sa.Column("parent_digest", sa.String(length=64), nullable=True),
        sa.Column("rewrite", sa.Text(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["campaign_id"], ["campaigns.id"], name="fk_candidates_campaign_id_campaigns"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_candidates"),
        sa.UniqueConstraint("campaign_id", "digest", name="uq_candidates_campaign_id_digest"),
    )
    op.create_table(
        "evaluations",
        _id(),
        sa.Column("campaign_id", ID, nullable=False),
        sa.Column("candidate_id", ID, nullable=False),
        sa.Column("makespan", sa.Double(), nullable=False),
        sa.Column("energy", sa.Double(), nullable=False),
        sa.Column("peak_memory", sa.Double(), nullable=False),
        sa.Column("devices", sa.Integer(), nullable=False),
        sa.Column("bytes_moved", sa.Double(), nullable=False),
        sa.Column("feasible", sa.Boolean(), nullable=False),
        sa.Column("lower_bound", sa.Double(), nullable=True),
        sa.Column("gap", sa.Double(), nullable=True),
        sa.Column("worker", sa.Text(), nullable=True),
        sa.Column("eval_seconds", sa.Double(), nullable=True),
        sa.Column("evaluated_at", TS, nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["campaign_id"], ["campaigns.id"], name="fk_evaluations_campaign_id_campaigns"
        ),
        sa.ForeignKeyConstraint(
            ["candidate_id"], ["candidates.id"], name="fk_evaluations_candidate_id_candidates"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_evaluations"),
    )
    op.create_index("ix_evaluations_campaign_id_seq", "evaluations", ["campaign_id", "seq"])
    op.create_index("ix_evaluations_candidate_id", "evaluations", ["candidate_id"])
    op.create_table(
        "front",
        _id(),
        sa.Column("campaign_id", ID, nullable=False),
        sa.Column("candidate_id", ID, nullable=False),
        sa.Column("entered_at", TS, nullable=False),
        sa.Column("left_at", TS, nullable=True),
        sa.Column("entered_seq", sa.BigInteger(), nullable=False),
        sa.Column("left_seq", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["campaign_id"], ["campaigns.id"], name="fk_front_campaign_id_campaigns"
        ),
        sa.ForeignKeyConstraint(
            ["candidate_id"], ["candidates.id"], name="fk_front_candidate_id_candidates"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_front"),
    )
    op.create_index("ix_front_campaign_id_left_at", "front", ["campaign_id", "left_at"])
    op.create_index("ix_front_candidate_id", "front", ["candidate_id"])
    op.create_table(
        "measurements",
        _id(),
        sa.Column("campaign_id", ID, nullable=True),
        sa.Column("candidate_id", ID, nullable=True),
        sa.Column("plan_digest", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("backend", sa.String(length=16), nullable=False),
        sa.Column("device_name", sa.Text(), nullable=False),
        sa.Column("op", sa.Text(), nullable=True),
        sa.Column("shard", sa.Integer(), nullable=True),
        sa.Column("measured_seconds", sa.Double(), nullable=False),
        sa.Column("predicted_seconds", sa.Double(), nullable=True),
        sa.Column("verified", sa.Boolean(), nullable=True),
        sa.Column("max_rel_error", sa.Double(), nullable=True),
        sa.Column("details_json", sa.Text(), nullable=False),
        sa.Column("measured_at", TS, nullable=False),
        sa.CheckConstraint("backend IN ('numpy', 'cupy')", name="ck_measurements_backend"),
        sa.CheckConstraint(
            "kind IN ('plan', 'shard', 'transfer', 'kernel')", name="ck_measurements_kind"
        ),
        sa.ForeignKeyConstraint(
            ["campaign_id"], ["campaigns.id"], name="fk_measurements_campaign_id_campaigns"
        ),
        sa.ForeignKeyConstraint(
            ["candidate_id"], ["candidates.id"], name="fk_measurements_candidate_id_candidates"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_measurements"),
    )
    op.create_index("ix_measurements_campaign_id", "measurements", ["campaign_id"])
    op.create_index("ix_measurements_candidate_id", "measurements", ["candidate_id"])
    op.create_index("ix_measurements_plan_digest", "measurements", ["plan_digest"])
    op.create_table(
        "checkpoints",
        _id(),
        sa.Column("campaign_id", ID, nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("state_json", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["campaign_id"], ["campaigns.id"], name="fk_checkpoints_campaign_id_campaigns"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
    )
    op.create_index("ix_checkpoints_campaign_id_seq", "checkpoints", ["campaign_id", "seq"])


def downgrade() -> None:
    for table in ("checkpoints", "measurements", "front", "evaluations", "candidates", "campaigns"):
        op.drop_table(table)
