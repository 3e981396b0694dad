"""Add spark_reports: a Spark write's outcome counts, left by its commit for the caller.

Revision ID: eop_0007
Revises: eop_0006
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from eop.pg import migrate

revision = "eop_0007"
down_revision = "eop_0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the spark_reports table."""
    schema = migrate.configured_schema(context.config)
    op.create_table(
        "spark_reports",
        sa.Column("report_id", sa.Text(), nullable=False),
        sa.Column("batch_id", sa.BigInteger(), nullable=False),
        sa.Column("processed", sa.BigInteger(), nullable=False),
        sa.Column("duplicates", sa.BigInteger(), nullable=False),
        sa.Column("dead_lettered", sa.BigInteger(), nullable=False),
        sa.Column("quarantined", sa.BigInteger(), nullable=False),
        sa.Column("skipped", sa.BigInteger(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("report_id", "batch_id", name="spark_reports_pkey"),
        schema=schema,
    )


def downgrade() -> None:
    """Drop the spark_reports table."""
    schema = migrate.configured_schema(context.config)
    op.drop_table("spark_reports", schema=schema)
