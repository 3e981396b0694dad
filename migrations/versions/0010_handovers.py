"""Add handovers: the deliveries an ordered handler's partition made before its owner changed.

Revision ID: eop_0010
Revises: eop_0009
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from eop.pg import migrate

revision = "eop_0010"
down_revision = "eop_0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the handovers table."""
    schema = migrate.configured_schema(context.config)
    op.create_table(
        "handovers",
        sa.Column("subscription", sa.Text(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("first_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column(
            "handed_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("subscription", "partition", "epoch", name="handovers_pkey"),
        schema=schema,
    )


def downgrade() -> None:
    """Drop the handovers table."""
    schema = migrate.configured_schema(context.config)
    op.drop_table("handovers", schema=schema)
