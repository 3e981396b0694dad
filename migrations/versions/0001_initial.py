"""Create eop's inbox and dead_letters tables.

Revision ID: eop_0001
Revises:
Create Date: 2025-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

from eop.pg import migrate

revision = "eop_0001"
down_revision = None
# Lets a host app run eop's revisions in its own environment (see README.md).
branch_labels = ("eop",)
depends_on = None


def upgrade() -> None:
    """Create the schema if needed, then the inbox and dead_letters tables."""
    schema = migrate.configured_schema(context.config)
    # eop's own environment creates the schema before its version table; a
    # host app's environment running this revision may not have.
    bind = op.get_bind()
    exists = bind.execute(
        sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :schema"), {"schema": schema}
    ).first()
    if exists is None:
        op.execute(sa.schema.CreateSchema(schema))
    _create_inbox(schema)
    _create_dead_letters(schema)


def downgrade() -> None:
    """Drop the tables; the schema stays (it may hold the version table)."""
    schema = migrate.configured_schema(context.config)
    op.drop_table("dead_letters", schema=schema)
    op.drop_index("inbox_msg_id_key", table_name="inbox", schema=schema)
    op.drop_table("inbox", schema=schema)


def _create_inbox(schema: str) -> None:
    op.create_table(
        "inbox",
        sa.Column("subscription", sa.Text(), nullable=False),
        sa.Column("stream", sa.Text(), nullable=False),
        sa.Column("stream_epoch", sa.Text(), nullable=False),
        sa.Column("stream_seq", sa.BigInteger(), nullable=False),
        sa.Column("fingerprint", sa.LargeBinary(), nullable=False),
        sa.Column("msg_id", sa.Text(), nullable=True),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("delivery_count", sa.Integer(), nullable=False),
        sa.Column(
            "processed_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("outcome IN ('processed', 'dead_lettered')", name="inbox_outcome_check"),
        sa.PrimaryKeyConstraint(
            "subscription", "stream", "stream_epoch", "stream_seq", name="inbox_pkey"
        ),
        schema=schema,
    )
    op.create_index(
        "inbox_msg_id_key",
        "inbox",
        ["subscription", "msg_id"],
        unique=True,
        schema=schema,
        postgresql_where=sa.text("msg_id IS NOT NULL"),
    )


def _create_dead_letters(schema: str) -> None:
    op.create_table(
        "dead_letters",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("subscription", sa.Text(), nullable=False),
        sa.Column("stream", sa.Text(), nullable=False),
        sa.Column("stream_epoch", sa.Text(), nullable=False),
        sa.Column("stream_seq", sa.BigInteger(), nullable=False),
        sa.Column("fingerprint", sa.LargeBinary(), nullable=False),
        sa.Column("msg_id", sa.Text(), nullable=True),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("headers", postgresql.JSONB(), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("traceback", sa.Text(), nullable=True),
        sa.Column("delivery_count", sa.Integer(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name="dead_letters_pkey"),
        sa.UniqueConstraint(
            "subscription",
            "stream",
            "stream_epoch",
            "stream_seq",
            "fingerprint",
            name="dead_letters_message_key",
        ),
        schema=schema,
    )
    op.create_index(
        "dead_letters_subscription_created_idx",
        "dead_letters",
        ["subscription", "created_at"],
        schema=schema,
    )
