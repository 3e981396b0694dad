"""Compaction's delete against a real PostgreSQL: chunks bounded by sequence ranges, each
starting at the lowest row that may go, and the rows that must stay left in place."""

from __future__ import annotations

import datetime
import types
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from eop.handler import HandlerSpec
from eop.pg import models
from eop.protocol import compaction
from eop.settings import Settings

from .bed import insert_inbox

SUB, STREAM, EPOCH = "orders", "ORDERS", "e1"
NOW = datetime.datetime.now(datetime.UTC)
OLD = NOW - datetime.timedelta(hours=2)
"""Past the default msg_id_retention_s (1 h)."""
GAP = 100_000
"""Sequences without a row between the two stretches of the inbox: 10,000 chunks of 10."""


async def noop(msg: Any, session: Any) -> None:
    """A handler that does nothing (the compactor only needs its names)."""


def compactor(engine: AsyncEngine, chunk_rows: int) -> compaction.Compactor:
    """A compactor whose rounds' deletes run on ``engine`` (no NATS: only its delete is run)."""
    store: Any = types.SimpleNamespace(
        app=types.SimpleNamespace(settings=Settings()),
        tables=models.tables("eop"),
        session=lambda: AsyncSession(engine),
    )
    spec = HandlerSpec(func=noop, name=SUB, stream=STREAM, subject="o", durable="eop-o")
    return compaction.Compactor(None, store, spec, None, chunk_rows=chunk_rows)  # type: ignore[arg-type]


def row(seq: int, *, epoch: str = EPOCH, sub: str = SUB, **changes: Any) -> dict[str, Any]:
    """An inbox row, processed a moment ago without a msg-id unless ``changes`` say else."""
    return {
        "subscription": sub,
        "stream": STREAM,
        "stream_epoch": epoch,
        "stream_seq": seq,
        "fingerprint": b"f",
        "subject": "o",
        "outcome": models.OUTCOME_PROCESSED,
        "delivery_count": 1,
        "msg_id": None,
        "processed_at": NOW,
        **changes,
    }


class Statements:
    """Counts the statements sent on an engine while in use (``with``)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine.sync_engine
        self.sent: list[str] = []

    def _count(self, *args: Any) -> None:
        self.sent.append(str(args[2]).split(None, 1)[0].upper())

    def __enter__(self) -> Statements:
        sa.event.listen(self.engine, "before_cursor_execute", self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        sa.event.remove(self.engine, "before_cursor_execute", self._count)


def interleaved() -> Iterator[dict[str, Any]]:
    """Two stretches of 35 sequences, 1-35 and GAP+1 to GAP+35, each holding rows that must
    stay (a msg-id within its retention, retrying) beside rows that may go (no msg-id, a
    msg-id past its retention, dead-lettered)."""
    for base in (0, GAP):
        for seq in range(base + 1, base + 36):
            if seq % 7 == 3:
                yield row(seq, msg_id=f"m-{seq}")  # within its retention: stays
            elif seq % 7 == 5:
                yield row(seq, outcome=models.OUTCOME_RETRYING)  # a parked retry's claim
            elif seq % 7 == 6:
                yield row(seq, msg_id=f"m-{seq}", processed_at=OLD)  # past its retention
            elif seq % 7 == 0:
                yield row(seq, outcome=models.OUTCOME_DEAD_LETTERED)
            else:
                yield row(seq)


def stays(seq: int, watermark: int) -> bool:
    """Whether :func:`interleaved`'s row ``seq`` must outlive a round up to ``watermark``."""
    return seq > watermark or seq % 7 in (3, 5)


async def inbox(engine: AsyncEngine) -> set[tuple[str, str, int]]:
    t = models.tables("eop")
    c, w = t.inbox.c, t.watermarks.c
    async with engine.connect() as conn:
        query = sa.select(c.subscription, w.stream_epoch, c.stream_seq).join_from(
            t.inbox, t.watermarks, w.lane == c.lane
        )
        return {(r[0], r[1], int(r[2])) for r in (await conn.execute(query)).all()}


async def test_a_round_over_a_gap_deletes_exactly_the_rows_that_may_go_in_few_chunks(
    engine: AsyncEngine,
) -> None:
    """A round from the epoch's first sequence (chunks of 10 sequences) over an inbox with a
    gap of 100,000 sequences deletes every row at or below the watermark that may go and
    no other (rows carrying a msg-id within its retention, retrying rows, rows above the
    watermark, other epochs' and subscriptions' rows all stay), in a statement count set
    by the rows, not by the gap: each chunk starts at the lowest row that may go, where
    sweeping the range 10 sequences a statement would take 10,000."""
    watermark = GAP + 30
    others = [row(seq, epoch="e0") for seq in (2, 4, GAP + 2)] + [row(4, sub="billing")]
    async with engine.begin() as conn:
        await insert_inbox(conn, [*interleaved(), *others])
    before = await inbox(engine)
    with Statements(engine) as statements:
        deleted = await compactor(engine, chunk_rows=10)._delete_below(EPOCH, watermark)
    left = await inbox(engine)
    kept = {r for r in before if r[:2] != (SUB, EPOCH) or stays(r[2], watermark)}
    assert left == kept
    assert deleted == len(before) - len(kept) == 25 + 22
    # Chunks start at 1, 11, 21 and 32 (31 stays), then across the gap at GAP+1, GAP+11
    # and GAP+22 (GAP+21 stays), the last one ending at the watermark: a look-up and a
    # delete each, in a transaction of their own.
    assert statements.sent.count("DELETE") == 7
    assert statements.sent.count("SELECT") == 7
    assert len(statements.sent) <= 7 * 4


async def test_rounds_counted_by_messages_start_above_the_previous_watermark(
    engine: AsyncEngine,
) -> None:
    """A round within the compaction interval of the one from the first sequence starts
    above the previous round's watermark, its first chunk without a look-up: a row left
    below it (a msg-id row that has since passed its retention) stays until the next
    round from the first sequence, a compaction interval later; above it, the round
    deletes what may go up to its own watermark, crossing the gap with a look-up."""
    t = models.tables("eop")
    async with engine.begin() as conn:
        await insert_inbox(conn, list(interleaved()))
    c = compactor(engine, chunk_rows=10)
    await c._delete_below(EPOCH, 20)
    async with engine.begin() as conn:  # the msg-id row 3 passes its retention
        await conn.execute(
            sa.update(t.inbox).where(t.inbox.c.stream_seq == 3).values(processed_at=OLD)
        )
    watermark = GAP + 10
    expected = {r["stream_seq"] for r in interleaved() if stays(r["stream_seq"], watermark)}
    with Statements(engine) as statements:
        deleted = await c._delete_below(EPOCH, watermark)
    assert {seq for _, _, seq in await inbox(engine)} == expected  # 3 among them
    assert deleted == 11 + 8  # 21-35, then GAP+1 to GAP+10
    # The first chunk starts where the previous round ended, without a look-up; the
    # others at 32 and GAP+1, each looked up.
    assert statements.sent.count("DELETE") == 3
    assert statements.sent.count("SELECT") == 2
    assert c._full_sweep_at is not None
    c._full_sweep_at -= c._interval_s  # a compaction interval later
    assert await c._delete_below(EPOCH, watermark) == 1
    assert {seq for _, _, seq in await inbox(engine)} == expected - {3}
