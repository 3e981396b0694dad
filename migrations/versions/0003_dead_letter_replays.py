"""Add replay bookkeeping to dead_letters (`eop dlq replay`).

Revision ID: eop_0003
Revises: eop_0002
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from eop.pg import migrate

revision = "eop_0003"
down_revision = "eop_0002"
branch_labels = None
depends_on = None

_COLUMNS = (
    "replay_generation",
    "replay_mode",
    "replay_msg_id",
    "replay_requested_at",
    "replayed_at",
    "replay_stream_seq",
)


def upgrade() -> None:
    """Add the replay columns; existing dead letters start never replayed (generation 0)."""
    schema = migrate.configured_schema(context.config)
    op.add_column(
        "dead_letters",
        sa.Column("replay_generation", sa.Integer(), server_default=sa.text("0"), nullable=False),
        schema=schema,
    )
    op.add_column("dead_letters", sa.Column("replay_mode", sa.Text(), nullable=True), schema=schema)
    op.add_column(
        "dead_letters", sa.Column("replay_msg_id", sa.Text(), nullable=True), schema=schema
    )
    op.add_column(
        "dead_letters",
        sa.Column("replay_requested_at", sa.DateTime(timezone=True), nullable=True),
        schema=schema,
    )
    op.add_column(
        "dead_letters",
        sa.Column("replayed_at", sa.DateTime(timezone=True), nullable=True),
        schema=schema,
    )
    op.add_column(
        "dead_letters",
        sa.Column("replay_stream_seq", sa.BigInteger(), nullable=True),
        schema=schema,
    )
    op.create_check_constraint(
        "dead_letters_replay_mode_check",
        "dead_letters",
        "replay_mode IN ('publish', 'rerun')",
        schema=schema,
    )


def downgrade() -> None:
    """Drop the replay columns (the replay history goes with them)."""
    schema = migrate.configured_schema(context.config)
    op.drop_constraint("dead_letters_replay_mode_check", "dead_letters", schema=schema)
    for name in reversed(_COLUMNS):
        op.drop_column("dead_letters", name, schema=schema)
