"""Key the inbox by (lane, stream_seq): the lane is the integer of a watermark row.

The inbox was keyed by (subscription, stream, stream_epoch, stream_seq): three
text columns, the same for every row of a subscription's epoch, compared on
every B-tree descent of every claim. Each watermark row, one per (subscription,
stream, epoch), now has an integer identity, its lane, and the inbox is keyed by
(lane, stream_seq); it drops stream and stream_epoch (the lane's watermark row
holds them) and subject (nothing read it: the fingerprint covers it, the dead
letter and the retry keep their own). BENCHMARKS.md, "What would take the rest".

The inbox is made anew, its fixed-width columns first, and its rows copied with
their lanes; a watermark row (at 0) is added first for any (subscription,
stream, epoch) that has inbox rows but none yet. Privileges granted on the old
table are granted on the new one. Both tables are locked first, the inbox
before the watermarks, the order in which a claim takes them (its INSERT's
target, then the watermark row it reads FOR SHARE): the revision waits for
every open transaction on them, and a claim that comes meanwhile waits for the
revision. Locking the watermarks first (the column added) let a claim that
arrived while the revision waited take the inbox and wait for the watermarks
behind it: a deadlock, which failed the upgrade. After this revision commits,
a worker of an older eop fails at its first statement on the inbox (its
columns are gone: SQLSTATE 42703), and its transaction rolls back.

The downgrade copies the rows back with their stream and epoch; their subject,
which this revision dropped, comes back empty. The watermark rows stay, their
lanes dropped.

Revision ID: eop_0011
Revises: eop_0010
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from eop.pg import migrate

revision = "eop_0011"
down_revision = "eop_0010"
branch_labels = None
depends_on = None

_OUTCOMES = "outcome IN ('processed', 'dead_lettered', 'retrying')"


def upgrade() -> None:
    """Give each watermark row a lane, and key the inbox by (lane, stream_seq)."""
    schema = migrate.configured_schema(context.config)
    q = f'"{schema}"'
    _lock_as_claims_do(q)
    # Adding an identity column numbers the rows already there.
    op.add_column(
        "watermarks",
        sa.Column("lane", sa.Integer(), sa.Identity(), nullable=False),
        schema=schema,
    )
    op.create_unique_constraint("watermarks_lane_key", "watermarks", ["lane"], schema=schema)
    op.execute(
        f"INSERT INTO {q}.watermarks (subscription, stream, stream_epoch, watermark) "
        f"SELECT DISTINCT subscription, stream, stream_epoch, 0 FROM {q}.inbox "
        "ON CONFLICT DO NOTHING"
    )
    _set_aside(schema, "wide")
    op.create_table(
        "inbox",
        sa.Column("lane", sa.Integer(), nullable=False),
        sa.Column("stream_seq", sa.BigInteger(), nullable=False),
        sa.Column("delivery_count", sa.Integer(), nullable=False),
        sa.Column(
            "processed_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("subscription", sa.Text(), nullable=False),
        sa.Column("fingerprint", sa.LargeBinary(), nullable=False),
        sa.Column("msg_id", sa.Text(), nullable=True),
        sa.Column("msg_id_digest", sa.LargeBinary(), nullable=True),
        sa.CheckConstraint(_OUTCOMES, name="inbox_outcome_check"),
        sa.PrimaryKeyConstraint("lane", "stream_seq", name="inbox_pkey"),
        schema=schema,
    )
    op.execute(
        f"INSERT INTO {q}.inbox (lane, stream_seq, delivery_count, processed_at, outcome,"
        " subscription, fingerprint, msg_id, msg_id_digest)"
        " SELECT w.lane, i.stream_seq, i.delivery_count, i.processed_at, i.outcome,"
        " i.subscription, i.fingerprint, i.msg_id, i.msg_id_digest"
        f" FROM {q}.inbox_wide AS i JOIN {q}.watermarks AS w"
        " USING (subscription, stream, stream_epoch)"
    )
    _msg_id_index(schema)
    _grant_again(schema, "inbox_wide")
    op.drop_table("inbox_wide", schema=schema)


def _lock_as_claims_do(q: str) -> None:
    """Both tables at once, in a claim's order (the inbox, then the watermarks): a claim
    arriving while this waits queues behind it instead of closing a cycle with it."""
    op.execute(f"LOCK TABLE {q}.inbox, {q}.watermarks IN ACCESS EXCLUSIVE MODE")


def downgrade() -> None:
    """Key the inbox by (subscription, stream, stream_epoch, stream_seq) again (subjects
    empty), and drop the watermark rows' lanes."""
    schema = migrate.configured_schema(context.config)
    q = f'"{schema}"'
    _lock_as_claims_do(q)
    _set_aside(schema, "lanes")
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
        sa.Column("msg_id_digest", sa.LargeBinary(), nullable=True),
        sa.CheckConstraint(_OUTCOMES, name="inbox_outcome_check"),
        sa.PrimaryKeyConstraint(
            "subscription", "stream", "stream_epoch", "stream_seq", name="inbox_pkey"
        ),
        schema=schema,
    )
    op.execute(
        f"INSERT INTO {q}.inbox (subscription, stream, stream_epoch, stream_seq, fingerprint,"
        " msg_id, subject, outcome, delivery_count, processed_at, msg_id_digest)"
        " SELECT i.subscription, w.stream, w.stream_epoch, i.stream_seq, i.fingerprint,"
        " i.msg_id, '', i.outcome, i.delivery_count, i.processed_at, i.msg_id_digest"
        f" FROM {q}.inbox_lanes AS i JOIN {q}.watermarks AS w ON w.lane = i.lane"
    )
    _msg_id_index(schema)
    _grant_again(schema, "inbox_lanes")
    op.drop_table("inbox_lanes", schema=schema)
    op.drop_constraint("watermarks_lane_key", "watermarks", schema=schema)
    op.drop_column("watermarks", "lane", schema=schema)


def _set_aside(schema: str, suffix: str) -> None:
    """Rename the inbox and its indexes (``inbox_<suffix>``), freeing their names."""
    op.rename_table("inbox", f"inbox_{suffix}", schema=schema)
    for index in ("inbox_pkey", "inbox_msg_id_key"):
        op.execute(f'ALTER INDEX "{schema}".{index} RENAME TO {index}_{suffix}')


def _msg_id_index(schema: str) -> None:
    """The msg-id guard's index, made after the rows are in (one sort, not an insert each)."""
    op.create_index(
        "inbox_msg_id_key",
        "inbox",
        ["subscription", "msg_id_digest"],
        unique=True,
        schema=schema,
        postgresql_where=sa.text("msg_id_digest IS NOT NULL"),
    )


def _grant_again(schema: str, old: str) -> None:
    """Grant on the new inbox what was granted on ``old`` (a worker's role, say), but the
    owner's own privileges, which the new table's owner has."""
    rows = op.get_bind().execute(
        sa.text(
            "SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END,"
            " a.privilege_type, a.is_grantable"
            " FROM pg_class AS c CROSS JOIN LATERAL aclexplode(c.relacl) AS a"
            " LEFT JOIN pg_roles AS r ON r.oid = a.grantee"
            " WHERE c.oid = CAST(:table AS regclass) AND a.grantee <> c.relowner"
        ),
        {"table": f'"{schema}".{old}'},
    )
    for grantee, privilege, grantable in rows:
        option = " WITH GRANT OPTION" if grantable else ""
        op.execute(f'GRANT {privilege} ON "{schema}".inbox TO {grantee}{option}')
