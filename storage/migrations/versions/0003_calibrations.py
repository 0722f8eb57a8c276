"""Calibrations: hardware a campaign refitted from its sampled executions.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

* New table ``calibrations`` (campaign, role ``sampling`` | ``target``, number of sampled plans
  the fit used, creation time, the calibrated hardware as JSON, the fit's report as JSON).

Written by hand and frozen (no storage.models import). Only CREATE TABLE: existing rows untouched.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "calibrations",
        sa.Column("id", ID, nullable=False),
        sa.Column("campaign_id", ID, nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("plans", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("hardware_json", sa.Text(), nullable=False),
        sa.Column("report_json", sa.Text(), nullable=False),
        sa.CheckConstraint("role IN ('sampling', 'target')", name="ck_calibrations_role"),
        sa.ForeignKeyConstraint(
            ["campaign_id"], ["campaigns.id"], name="fk_calibrations_campaign_id_campaigns"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_calibrations"),
    )
    op.create_index("ix_calibrations_campaign_id", "calibrations", ["campaign_id"])


def downgrade() -> None:
    op.drop_table("calibrations")
