"""eop's tables, as SQLAlchemy Core metadata.

The schema is configurable, so the tables are built per schema name
(:func:`tables`). Alembic migrations create them; ``alembic check`` against
this metadata proves the two never drift.
"""

from __future__ import annotations

import dataclasses
import functools

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

#: Outcomes recorded in the inbox.
OUTCOME_PROCESSED = "processed"
OUTCOME_DEAD_LETTERED = "dead_lettered"
#: Not an outcome yet: the handler failed and the retry is held in :attr:`Tables.retries`
#: (the message was acked, so the row is the claim until the retry settles it).
OUTCOME_RETRYING = "retrying"

#: Reasons recorded with a dead letter.
REASON_REJECTED = "rejected"
REASON_UNDECODABLE = "undecodable"
REASON_ATTEMPTS_EXHAUSTED = "attempts_exhausted"
REASON_SEQUENCE_REUSED = "sequence_reused"
REASON_CRASH_LOOP = "crash_loop"

#: The reasons a message earns its dead letter by; any other reason is a bug to look at.
RULE_REASONS = frozenset(
    {REASON_REJECTED, REASON_UNDECODABLE, REASON_ATTEMPTS_EXHAUSTED, REASON_SEQUENCE_REUSED}
)

#: How a dead letter was replayed (``eop dlq replay``).
REPLAY_PUBLISH = "publish"
REPLAY_RERUN = "rerun"

#: The one relay lease: the relay holding it publishes, the others stand by.
RELAY_LEASE = "outbox"


def outbox_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel an insert into ``schema``'s outbox notifies (on COMMIT)."""
    return f"{schema}_outbox"


#: Name of eop's own Alembic version table, kept apart from the host app's.
VERSION_TABLE = "eop_alembic_version"


@dataclasses.dataclass(frozen=True)
class Tables:
    """The metadata and tables of one eop schema."""

    schema: str
    metadata: sa.MetaData
    inbox: sa.Table
    dead_letters: sa.Table
    watermarks: sa.Table
    retries: sa.Table
    outbox: sa.Table
    relay_leases: sa.Table
    spark_reports: sa.Table
    partitions: sa.Table
    members: sa.Table
    ack_floors: sa.Table
    handovers: sa.Table


@functools.cache
def tables(schema: str = "eop") -> Tables:
    """Build (once per schema name) the metadata of eop's tables."""
    metadata = sa.MetaData(schema=schema)
    inbox = sa.Table(
        "inbox",
        metadata,
        # The inbox key (docs/design.md, 'The inbox key'): the lane names one
        # (subscription, stream, stream epoch), the integer identity of its row of
        # the watermarks, so a recreated stream whose sequences restart at 1 (a new
        # epoch, a new lane) is not mistaken for the old one. Two integers: a B-tree
        # descent compares no text, and every column's offset is fixed up to
        # `outcome` (the fixed-width columns first).
        sa.Column("lane", sa.Integer, primary_key=True),
        sa.Column("stream_seq", sa.BigInteger, primary_key=True),
        sa.Column("delivery_count", sa.Integer, nullable=False),
        sa.Column(
            "processed_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.now(),
        ),
        sa.Column("outcome", sa.Text, nullable=False),
        # The handler's logical name, for the msg-id guard (its index is per
        # subscription, across streams and epochs) and `eop status`.
        sa.Column("subscription", sa.Text, nullable=False),
        sa.Column("fingerprint", sa.LargeBinary, nullable=False),
        sa.Column("msg_id", sa.Text, nullable=True),
        # SHA-256 of msg_id's UTF-8 bytes, set by the claim (eop.pg.sql): a msg-id
        # may be any length, but a btree index row may not exceed about 2.7 kB.
        sa.Column("msg_id_digest", sa.LargeBinary, nullable=True),
        sa.CheckConstraint(
            f"outcome IN ('{OUTCOME_PROCESSED}', '{OUTCOME_DEAD_LETTERED}', '{OUTCOME_RETRYING}')",
            name="inbox_outcome_check",
        ),
        # The second guard: a republish after the server's duplicate window
        # carries the same Nats-Msg-Id under a new sequence.
        sa.Index(
            "inbox_msg_id_key",
            "subscription",
            "msg_id_digest",
            unique=True,
            postgresql_where=sa.text("msg_id_digest IS NOT NULL"),
        ),
    )
    dead_letters = sa.Table(
        "dead_letters",
        metadata,
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("subscription", sa.Text, nullable=False),
        sa.Column("stream", sa.Text, nullable=False),
        sa.Column("stream_epoch", sa.Text, nullable=False),
        sa.Column("stream_seq", sa.BigInteger, nullable=False),
        sa.Column("fingerprint", sa.LargeBinary, nullable=False),
        sa.Column("msg_id", sa.Text, nullable=True),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("headers", postgresql.JSONB, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column("traceback", sa.Text, nullable=True),
        sa.Column("delivery_count", sa.Integer, nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.now(),
        ),
        # Replay bookkeeping (eop.ops.dlq): the generation counts replays the user
        # asked for; the msg-id of a publish is derived from it and recorded
        # (with replay_requested_at) *before* the publish, so a crash between
        # the publish and replayed_at is resumed, never replayed anew.
        sa.Column("replay_generation", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("replay_mode", sa.Text, nullable=True),
        sa.Column("replay_msg_id", sa.Text, nullable=True),
        sa.Column("replay_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("replayed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("replay_stream_seq", sa.BigInteger, nullable=True),
        sa.CheckConstraint(
            f"replay_mode IN ('{REPLAY_PUBLISH}', '{REPLAY_RERUN}')",
            name="dead_letters_replay_mode_check",
        ),
        # A redelivered poison message must not produce a second dead letter.
        sa.UniqueConstraint(
            "subscription",
            "stream",
            "stream_epoch",
            "stream_seq",
            "fingerprint",
            name="dead_letters_message_key",
        ),
        sa.Index("dead_letters_subscription_created_idx", "subscription", "created_at"),
    )
    watermarks = sa.Table(
        "watermarks",
        metadata,
        # Every stream sequence at or below the watermark has a committed outcome
        # or a parked retry (docs/design.md, 'The watermark'): its inbox rows may
        # go, but for the retrying ones.
        sa.Column("subscription", sa.Text, primary_key=True),
        sa.Column("stream", sa.Text, primary_key=True),
        sa.Column("stream_epoch", sa.Text, primary_key=True),
        sa.Column("watermark", sa.BigInteger, nullable=False),
        # The inbox's name for this (subscription, stream, epoch): its key is
        # (lane, stream_seq). Never reused, and the row is never deleted: an inbox
        # row's lane always finds its stream and epoch here.
        sa.Column("lane", sa.Integer, sa.Identity(), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.now(),
        ),
        sa.UniqueConstraint("lane", name="watermarks_lane_key"),
    )
    retries = sa.Table(
        "retries",
        metadata,
        # A message whose handler failed: how often, and (parked) the message
        # itself, so its retry waits here instead of in the consumer's
        # ack-pending window, where failing messages would starve good ones.
        sa.Column("subscription", sa.Text, primary_key=True),
        sa.Column("stream", sa.Text, primary_key=True),
        sa.Column("stream_epoch", sa.Text, primary_key=True),
        sa.Column("stream_seq", sa.BigInteger, primary_key=True),
        sa.Column("failures", sa.Integer, nullable=False),
        sa.Column("runs", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("parked", sa.Boolean, nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_error", sa.Text, nullable=False),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("headers", sa.LargeBinary, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("stored_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.now(),
        ),
        sa.Index(
            "retries_due_idx",
            "subscription",
            "due_at",
            postgresql_where=sa.text("parked"),
        ),
    )
    outbox, relay_leases = _outbox_tables(metadata)
    partitions, members, handovers = _ownership_tables(metadata)
    return Tables(
        schema=schema,
        metadata=metadata,
        inbox=inbox,
        dead_letters=dead_letters,
        watermarks=watermarks,
        retries=retries,
        outbox=outbox,
        relay_leases=relay_leases,
        spark_reports=_spark_reports(metadata),
        partitions=partitions,
        members=members,
        ack_floors=_ack_floors(metadata),
        handovers=handovers,
    )


def _outbox_tables(metadata: sa.MetaData) -> tuple[sa.Table, sa.Table]:
    """The outbox (messages committed with the app's writes, for the relay to publish)
    and the relay's lease (docs/design.md, 'The outbox')."""
    outbox = sa.Table(
        "outbox",
        metadata,
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        # Chosen when the row is added and sent with every publish of it, so the
        # server (inside its duplicate window) and the consumer's msg-id guard
        # (after it) drop a re-send.
        sa.Column("msg_id", sa.Text, nullable=False),
        sa.Column("subject", sa.Text, nullable=False),
        # JSON in bytea, as the retries keep them: any character survives.
        sa.Column("headers", sa.LargeBinary, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.now(),
        ),
        # Publishes the server refused (a missing stream): a NATS outage never counts.
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("parked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("park_reason", sa.Text, nullable=True),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("stream", sa.Text, nullable=True),
        sa.Column("stream_seq", sa.BigInteger, nullable=True),
        # What the relay reads, in order: the rows neither published nor parked.
        sa.Index(
            "outbox_pending_idx",
            "id",
            postgresql_where=sa.text("published_at IS NULL AND parked_at IS NULL"),
        ),
        sa.Index(
            "outbox_published_idx",
            "published_at",
            postgresql_where=sa.text("published_at IS NOT NULL"),
        ),
        sa.Index("outbox_parked_idx", "id", postgresql_where=sa.text("parked_at IS NOT NULL")),
    )
    relay_leases = sa.Table(
        "relay_leases",
        metadata,
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("holder", sa.Text, nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    return outbox, relay_leases


def _ownership_tables(metadata: sa.MetaData) -> tuple[sa.Table, sa.Table, sa.Table]:
    """Who owns which partition of an ordered handler, and which processes run it
    (docs/ordering.md). Leases run on the database's clock."""
    partitions = sa.Table(
        "partitions",
        metadata,
        sa.Column("subscription", sa.Text, primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True),
        # How many partitions the handler has: fixed for the stream's life, so that
        # a key always maps to the same partition (a change is refused).
        sa.Column("partition_count", sa.Integer, nullable=False),
        sa.Column("owner", sa.Text, nullable=True),
        sa.Column("owner_host", sa.Text, nullable=True),
        sa.Column("owner_pid", sa.Integer, nullable=True),
        # Raised at every acquisition: the consumer of an ownership is named after
        # it, so an owner that lost the partition cannot fetch from its successor's.
        sa.Column("epoch", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("consumer", sa.Text, nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=True),
    )
    members = sa.Table(
        "members",
        metadata,
        sa.Column("subscription", sa.Text, primary_key=True),
        sa.Column("member", sa.Text, primary_key=True),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "joined_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.now(),
        ),
    )
    # A new owner's consumer delivers again what its predecessors' delivered without an
    # ack (first_seq..last_seq): its delivery count starts at 1, so these ranges carry
    # the earlier deliveries, which the crash-loop bound counts (docs/ordering.md).
    handovers = sa.Table(
        "handovers",
        metadata,
        sa.Column("subscription", sa.Text, primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True),
        sa.Column("epoch", sa.BigInteger, primary_key=True),
        sa.Column("first_seq", sa.BigInteger, nullable=False),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.Column(
            "handed_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.now(),
        ),
    )
    return partitions, members, handovers


def _ack_floors(metadata: sa.MetaData) -> sa.Table:
    """Where each consumer's ack floor stood when a worker last read it, and since when
    (the database's clock) a delivery above it has waited unacknowledged.

    JetStream tells no delivery's time, and the floor's ``last_active`` moves with
    every ack, not only when the floor does: this is what ``eop audit``, ``eop
    status`` and the workers' metric measure a stuck delivery by (docs/design.md,
    'Stuck deliveries').
    """
    return sa.Table(
        "ack_floors",
        metadata,
        sa.Column("stream", sa.Text, primary_key=True),
        sa.Column("consumer", sa.Text, primary_key=True),
        sa.Column("subscription", sa.Text, nullable=False),
        # An ordered handler's partition (None for another handler's durable).
        sa.Column("partition", sa.Integer, nullable=True),
        # Tells a recreated consumer of the same name from the one observed before.
        sa.Column("consumer_created", sa.DateTime(timezone=True), nullable=True),
        sa.Column("floor_seq", sa.BigInteger, nullable=False),
        # The consumer's delivered sequence when the wait began: the waiting
        # delivery is at or below it.
        sa.Column("delivered_seq", sa.BigInteger, nullable=False),
        sa.Column("waiting_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "observed_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.now(),
        ),
        sa.Index("ack_floors_subscription_idx", "subscription"),
    )


#: ``spark_reports.batch_id`` of a batch job (a stream's micro-batches are 0, 1, ...).
BATCH_JOB = -1


def _spark_reports(metadata: sa.MetaData) -> sa.Table:
    """The outcome counts of a Spark write, which its driver-side commit leaves for the caller.

    Spark runs a Python data source's commit in a process of its own (on the
    cluster's driver, or the Spark Connect server), which cannot hand anything
    back to the caller's process: the database both reach can. The caller reads
    and deletes its rows (eop/contrib/spark/report.py).
    """
    return sa.Table(
        "spark_reports",
        metadata,
        sa.Column("report_id", sa.Text, primary_key=True),
        sa.Column("batch_id", sa.BigInteger, primary_key=True),
        sa.Column("processed", sa.BigInteger, nullable=False),
        sa.Column("duplicates", sa.BigInteger, nullable=False),
        sa.Column("dead_lettered", sa.BigInteger, nullable=False),
        sa.Column("quarantined", sa.BigInteger, nullable=False),
        sa.Column("skipped", sa.BigInteger, nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.now(),
        ),
    )
