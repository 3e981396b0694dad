"""Add the watermarks table that bounds the inbox.

Revision ID: eop_0002
Revises: eop_0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from eop.pg import migrate

revision = "eop_0002"
down_revision = "eop_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the watermarks table."""
    schema = migrate.configured_schema(context.config)
    op.create_table(
        "watermarks",
        sa.Column("subscription", sa.Text(), nullable=False),
        sa.Column("stream", sa.Text(), nullable=False),
        sa.Column("stream_epoch", sa.Text(), nullable=False),
        sa.Column("watermark", sa.BigInteger(), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("subscription", "stream", "stream_epoch", name="watermarks_pkey"),
        schema=schema,
    )


def downgrade() -> None:
    """Drop the watermarks table."""
    schema = migrate.configured_schema(context.config)
    op.drop_table("watermarks", schema=schema)
