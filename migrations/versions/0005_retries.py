"""Add the retries table and the inbox's ``retrying`` outcome.

A handler failure is counted here (not by the server's delivery count, which
infrastructure failures raise too), and a failed message waits here for its
retry instead of in the consumer's ack-pending window.

Revision ID: eop_0005
Revises: eop_0004
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from eop.pg import migrate

revision = "eop_0005"
down_revision = "eop_0004"
branch_labels = None
depends_on = None

_OUTCOMES_BEFORE = "outcome IN ('processed', 'dead_lettered')"
_OUTCOMES_AFTER = "outcome IN ('processed', 'dead_lettered', 'retrying')"


def upgrade() -> None:
    """Create the retries table; let the inbox hold ``retrying`` rows."""
    schema = migrate.configured_schema(context.config)
    op.create_table(
        "retries",
        sa.Column("subscription", sa.Text(), nullable=False),
        sa.Column("stream", sa.Text(), nullable=False),
        sa.Column("stream_epoch", sa.Text(), nullable=False),
        sa.Column("stream_seq", sa.BigInteger(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("runs", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("parked", sa.Boolean(), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=False),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("headers", sa.LargeBinary(), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("stored_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint(
            "subscription", "stream", "stream_epoch", "stream_seq", name="retries_pkey"
        ),
        schema=schema,
    )
    op.create_index(
        "retries_due_idx",
        "retries",
        ["subscription", "due_at"],
        postgresql_where=sa.text("parked"),
        schema=schema,
    )
    op.drop_constraint("inbox_outcome_check", "inbox", schema=schema)
    op.create_check_constraint("inbox_outcome_check", "inbox", _OUTCOMES_AFTER, schema=schema)


def downgrade() -> None:
    """Drop the retries table; a retrying inbox row becomes no outcome (redelivery decides).

    A parked message was acked: dropping its row loses the retry. Downgrade
    only a drained system.
    """
    schema = migrate.configured_schema(context.config)
    op.execute(sa.text(f"DELETE FROM \"{schema}\".inbox WHERE outcome = 'retrying'"))
    op.drop_constraint("inbox_outcome_check", "inbox", schema=schema)
    op.create_check_constraint("inbox_outcome_check", "inbox", _OUTCOMES_BEFORE, schema=schema)
    op.drop_index("retries_due_idx", table_name="retries", schema=schema)
    op.drop_table("retries", schema=schema)
