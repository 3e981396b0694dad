"""Guard republishes by a digest of the msg-id, so a msg-id of any length can be claimed.

The unique index on (subscription, msg_id) could not hold a msg-id of a few
kilobytes (a btree index row is limited to about 2.7 kB): the claim of such a
message failed, and with it the claim of its whole batch. The index now holds
a fixed-size SHA-256 of the msg-id's UTF-8 bytes instead, in a column the
claim fills in.

Revision ID: eop_0004
Revises: eop_0003
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from eop.pg import migrate

revision = "eop_0004"
down_revision = "eop_0003"
branch_labels = None
depends_on = None

# Longer msg-ids may not fit the old index: on downgrade their rows lose the
# msg-id (and with it the republish guard) rather than fail the downgrade.
_OLD_INDEX_MAX_BYTES = 2000


def upgrade() -> None:
    """Add msg_id_digest, fill it for the rows kept, and index it instead of msg_id."""
    schema = migrate.configured_schema(context.config)
    op.add_column(
        "inbox", sa.Column("msg_id_digest", sa.LargeBinary(), nullable=True), schema=schema
    )
    op.execute(
        f"UPDATE \"{schema}\".inbox SET msg_id_digest = sha256(convert_to(msg_id, 'UTF8')) "
        "WHERE msg_id IS NOT NULL"
    )
    op.drop_index("inbox_msg_id_key", table_name="inbox", schema=schema)
    op.create_index(
        "inbox_msg_id_key",
        "inbox",
        ["subscription", "msg_id_digest"],
        unique=True,
        schema=schema,
        postgresql_where=sa.text("msg_id_digest IS NOT NULL"),
    )


def downgrade() -> None:
    """Index msg_id itself again; rows whose msg-id is too long for that index lose it."""
    schema = migrate.configured_schema(context.config)
    op.drop_index("inbox_msg_id_key", table_name="inbox", schema=schema)
    op.execute(
        f'UPDATE "{schema}".inbox SET msg_id = NULL '
        f"WHERE octet_length(msg_id) > {_OLD_INDEX_MAX_BYTES}"
    )
    op.drop_column("inbox", "msg_id_digest", schema=schema)
    op.create_index(
        "inbox_msg_id_key",
        "inbox",
        ["subscription", "msg_id"],
        unique=True,
        schema=schema,
        postgresql_where=sa.text("msg_id IS NOT NULL"),
    )
