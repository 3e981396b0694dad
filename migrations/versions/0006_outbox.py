"""Add the outbox, the relay's lease, and the NOTIFY that wakes the relay on COMMIT.

Revision ID: eop_0006
Revises: eop_0005
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from eop.pg import migrate, models

revision = "eop_0006"
down_revision = "eop_0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the outbox and relay_leases tables and the outbox's NOTIFY trigger."""
    schema = migrate.configured_schema(context.config)
    op.create_table(
        "outbox",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("msg_id", sa.Text(), nullable=False),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("headers", sa.LargeBinary(), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("parked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("park_reason", sa.Text(), nullable=True),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("stream", sa.Text(), nullable=True),
        sa.Column("stream_seq", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="outbox_pkey"),
        schema=schema,
    )
    op.create_index(
        "outbox_pending_idx",
        "outbox",
        ["id"],
        postgresql_where=sa.text("published_at IS NULL AND parked_at IS NULL"),
        schema=schema,
    )
    op.create_index(
        "outbox_published_idx",
        "outbox",
        ["published_at"],
        postgresql_where=sa.text("published_at IS NOT NULL"),
        schema=schema,
    )
    op.create_index(
        "outbox_parked_idx",
        "outbox",
        ["id"],
        postgresql_where=sa.text("parked_at IS NOT NULL"),
        schema=schema,
    )
    op.create_table(
        "relay_leases",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name="relay_leases_pkey"),
        schema=schema,
    )
    # One NOTIFY per INSERT statement, delivered on COMMIT (and folded into one
    # per transaction by PostgreSQL): any writer wakes the relay, eop's add()
    # or the app's own SQL, and a rolled-back insert wakes nobody. PostgreSQL
    # serialises the COMMITs of notifying transactions: a writer with many small
    # ones turns it off with SET eop.outbox_notify = off (the relay still polls).
    quoted = f'"{schema}"'
    channel = models.outbox_channel(schema).replace("'", "''")
    op.execute(
        sa.text(
            f"CREATE FUNCTION {quoted}.outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$ "
            "BEGIN "
            "IF coalesce(current_setting('eop.outbox_notify', true), '') <> 'off' THEN "
            f"PERFORM pg_notify('{channel}', ''); "
            "END IF; "
            "RETURN NULL; "
            "END $$"
        )
    )
    op.execute(
        sa.text(
            f"CREATE TRIGGER outbox_notify AFTER INSERT ON {quoted}.outbox "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {quoted}.outbox_notify()"
        )
    )


def downgrade() -> None:
    """Drop the outbox (unpublished rows are lost: downgrade only a drained outbox)."""
    schema = migrate.configured_schema(context.config)
    op.execute(sa.text(f'DROP TRIGGER IF EXISTS outbox_notify ON "{schema}".outbox'))
    op.execute(sa.text(f'DROP FUNCTION IF EXISTS "{schema}".outbox_notify()'))
    op.drop_table("relay_leases", schema=schema)
    op.drop_index("outbox_parked_idx", table_name="outbox", schema=schema)
    op.drop_index("outbox_published_idx", table_name="outbox", schema=schema)
    op.drop_index("outbox_pending_idx", table_name="outbox", schema=schema)
    op.drop_table("outbox", schema=schema)
