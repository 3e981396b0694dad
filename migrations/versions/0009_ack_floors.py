"""Add ack_floors: where each consumer's ack floor stands, and since when a delivery waits.

Revision ID: eop_0009
Revises: eop_0008
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from eop.pg import migrate

revision = "eop_0009"
down_revision = "eop_0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the ack_floors table."""
    schema = migrate.configured_schema(context.config)
    op.create_table(
        "ack_floors",
        sa.Column("stream", sa.Text(), nullable=False),
        sa.Column("consumer", sa.Text(), nullable=False),
        sa.Column("subscription", sa.Text(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=True),
        sa.Column("consumer_created", sa.DateTime(timezone=True), nullable=True),
        sa.Column("floor_seq", sa.BigInteger(), nullable=False),
        sa.Column("delivered_seq", sa.BigInteger(), nullable=False),
        sa.Column("waiting_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "observed_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("stream", "consumer", name="ack_floors_pkey"),
        schema=schema,
    )
    op.create_index("ack_floors_subscription_idx", "ack_floors", ["subscription"], schema=schema)


def downgrade() -> None:
    """Drop the ack_floors table."""
    schema = migrate.configured_schema(context.config)
    op.drop_index("ack_floors_subscription_idx", table_name="ack_floors", schema=schema)
    op.drop_table("ack_floors", schema=schema)
