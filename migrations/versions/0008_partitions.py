"""Add partitions and members: who owns which partition of an ordered handler.

Revision ID: eop_0008
Revises: eop_0007
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from eop.pg import migrate

revision = "eop_0008"
down_revision = "eop_0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the partitions and members tables."""
    schema = migrate.configured_schema(context.config)
    op.create_table(
        "partitions",
        sa.Column("subscription", sa.Text(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("partition_count", sa.Integer(), nullable=False),
        sa.Column("owner", sa.Text(), nullable=True),
        sa.Column("owner_host", sa.Text(), nullable=True),
        sa.Column("owner_pid", sa.Integer(), nullable=True),
        sa.Column("epoch", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("consumer", sa.Text(), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("subscription", "partition", name="partitions_pkey"),
        schema=schema,
    )
    op.create_table(
        "members",
        sa.Column("subscription", sa.Text(), nullable=False),
        sa.Column("member", sa.Text(), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "joined_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("subscription", "member", name="members_pkey"),
        schema=schema,
    )


def downgrade() -> None:
    """Drop the partitions and members tables."""
    schema = migrate.configured_schema(context.config)
    op.drop_table("members", schema=schema)
    op.drop_table("partitions", schema=schema)
