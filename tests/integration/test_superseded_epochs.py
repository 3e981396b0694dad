"""Compaction's sweep of a recreated stream's earlier epochs, on a real PostgreSQL.

A stream deleted and recreated is a new epoch: its messages get a new lane, and the
rows of the old one would stay for ever, since a round only compacts the epoch it
reads as current (docs/design.md, 'The watermark'). Once the current epoch has
existed for ``epoch_sweep_after_s``, a round raises every earlier epoch's watermark
past any sequence and deletes what may go there, run counts included; the rows a
round keeps (a msg-id within its retention, a parked retry's claim) stay. The
deliveries are fakes and the stream's readings a script (no NATS), but for the last
test: a worker on real servers, its stream deleted under it.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from structlog.testing import capture_logs

import eop
from eop import message, testing
from eop import settings as settings_mod
from eop.pg import models, retries
from eop.protocol import compaction, processor, retry_batch
from eop.types import Outcome

from . import bed
from .bed import create_effects_table, effects_by_body, insert_inbox, record_effect

SUB, STREAM, SUBJECT = "swept", "ORDERS", "orders.new"
OLD, CURRENT, NEWER = "e0", "e1", "e2"
NOW = datetime.datetime.now(datetime.UTC)
LONG_AGO = NOW - datetime.timedelta(hours=2)
"""Past the default msg_id_retention_s (1 h)."""
DELAY_S = 60.0
"""The app's epoch_sweep_after_s."""


class Failing:
    """The sequences whose handler raises."""

    def __init__(self) -> None:
        self.seqs: set[int] = set()


@pytest.fixture
def failing() -> Failing:
    return Failing()


@pytest.fixture
async def app(database_url: str, engine: AsyncEngine, failing: Failing) -> AsyncIterator[eop.App]:
    """One handler that records an effect (or raises for :class:`Failing`'s sequences);
    earlier epochs are swept a minute after the current one's creation."""
    await create_effects_table(engine)
    app = eop.App(
        settings=settings_mod.Settings(database_url=database_url, epoch_sweep_after_s=DELAY_S)
    )

    @app.handler(stream=STREAM, subject="orders.>", name=SUB)
    async def swept(msg: eop.Message, session: AsyncSession) -> None:
        """Records its message, or fails for the scripted sequences."""
        if msg.seq in failing.seqs:
            raise RuntimeError("the handler failed")
        await record_effect(session, SUB, msg)

    yield app
    await app.dispose()


class Readings:
    """The stream as compaction reads it: the epochs named by successive readings (the
    last one repeated), and how long the current epoch has existed."""

    def __init__(self, *epochs: str, current_for_s: float) -> None:
        self.epochs = list(epochs)
        self.current_for_s = current_for_s

    async def refresh(self, stream: str) -> str:
        return self.epochs.pop(0) if len(self.epochs) > 1 else self.epochs[0]

    def first_seq(self, stream: str) -> int:
        return 1

    def current_for(self, stream: str, epoch: str) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.current_for_s)


def compactor(app: eop.App, readings: Readings, floor: int) -> compaction.Compactor:
    """A compactor of the handler reading the stream from ``readings``, whose consumer's
    ack floor is ``floor``."""
    return bed.compactor_with_floor(app, SUB, readings, floor)


def worker(app: eop.App, epoch: str) -> processor.Processor:
    """The per-message protocol of a worker that files every delivery under ``epoch``."""
    spec = app.handlers[SUB]
    return processor.Processor(
        spec, app.settings, app.make_store(), testing.FakeEpochs(default=epoch)
    )


def delivery(seq: int, delivered: int = 1) -> testing.FakeDelivery:
    return testing.FakeDelivery.make(
        data=f"m{seq}".encode(), subject=SUBJECT, stream=STREAM, seq=seq, num_delivered=delivered
    )


def row(seq: int, epoch: str, **changes: Any) -> dict[str, Any]:
    """An inbox row, processed a moment ago without a msg-id unless ``changes`` say else."""
    return {
        "subscription": SUB,
        "stream": STREAM,
        "stream_epoch": epoch,
        "stream_seq": seq,
        "fingerprint": b"f",
        "outcome": models.OUTCOME_PROCESSED,
        "delivery_count": 1,
        "msg_id": None,
        "processed_at": NOW,
        **changes,
    }


def old_rows(epoch: str) -> list[dict[str, Any]]:
    """Rows 1-5 of ``epoch``: one that may go of each kind, and two that must stay
    (2: a msg-id within its retention, 4: a parked retry's claim)."""
    return [
        row(1, epoch),
        row(2, epoch, msg_id="m-2"),
        row(3, epoch, msg_id="m-3", processed_at=LONG_AGO),
        row(4, epoch, outcome=models.OUTCOME_RETRYING),
        row(5, epoch, outcome=models.OUTCOME_DEAD_LETTERED),
    ]


async def inbox(engine: AsyncEngine) -> dict[str, set[int]]:
    """The inbox's sequences by epoch."""
    t = models.tables("eop")
    c, w = t.inbox.c, t.watermarks.c
    async with engine.connect() as conn:
        query = sa.select(w.stream_epoch, c.stream_seq).join_from(
            t.inbox, t.watermarks, w.lane == c.lane
        )
        found: dict[str, set[int]] = {}
        for epoch, seq in (await conn.execute(query)).all():
            found.setdefault(epoch, set()).add(int(seq))
        return found


async def watermarks(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        query = "SELECT stream_epoch, watermark FROM eop.watermarks"
        return {e: int(v) for e, v in (await conn.execute(sa.text(query))).all()}


async def retry_rows(engine: AsyncEngine) -> dict[tuple[str, int], bool]:
    """Each retries row, by (epoch, sequence): whether it is parked."""
    async with engine.connect() as conn:
        query = "SELECT stream_epoch, stream_seq, parked FROM eop.retries"
        return {(e, int(s)): bool(p) for e, s, p in (await conn.execute(sa.text(query))).all()}


async def test_a_recreated_streams_earlier_epoch_is_emptied_once_the_delay_has_passed(
    app: eop.App, engine: AsyncEngine, failing: Failing
) -> None:
    """Rows of an earlier epoch stay while the current one is younger than
    ``epoch_sweep_after_s``. Past it, a round raises the earlier watermark past every
    sequence, deletes its rows but a msg-id within its retention and a parked retry's
    claim, forgets its run counts but the parked retry's, and logs it once; the current
    epoch's rows above its floor stay. A delivery of the earlier epoch claimed after the
    sweep (fetched before the stream was deleted) is a duplicate, its handler not run,
    whether its row was swept or it never had one. The parked retry still runs, once,
    from its own copy of the message, and its row goes at the next sweep."""
    async with engine.begin() as conn:
        await insert_inbox(conn, [*old_rows(OLD), row(7, CURRENT)])
    failing.seqs.add(6)
    assert await worker(app, OLD).handle(delivery(6), time.monotonic()) is Outcome.RETRY
    await bed.count_a_run(
        app, message.from_nats(delivery(8, 2), subscription=SUB, stream_epoch=OLD)
    )
    assert await retry_rows(engine) == {(OLD, 6): True, (OLD, 8): False}
    before = {OLD: {1, 2, 3, 4, 5, 6}, CURRENT: {7}}
    assert await inbox(engine) == before

    young = Readings(CURRENT, current_for_s=DELAY_S - 1)
    assert await compactor(app, young, floor=0).compact_once() is None
    assert await inbox(engine) == before
    assert (await watermarks(engine))[OLD] == 0

    old_enough = Readings(CURRENT, current_for_s=DELAY_S + 1)
    with capture_logs() as logs:
        await compactor(app, old_enough, floor=0).compact_once()
    assert await inbox(engine) == {OLD: {2, 4, 6}, CURRENT: {7}}
    assert (await watermarks(engine))[OLD] == compaction.SWEPT
    assert await retry_rows(engine) == {(OLD, 6): True}
    swept = [e for e in logs if e["event"] == "inbox.superseded_epoch_swept"]
    assert [(e["epoch"], e["raised"], e["deleted"], e["runs_forgotten"]) for e in swept] == [
        (OLD, True, 3, 1)
    ]

    stale = worker(app, OLD)
    assert await stale.handle(delivery(1, 2), time.monotonic()) is Outcome.DUPLICATE
    assert await stale.handle(delivery(9), time.monotonic()) is Outcome.DUPLICATE
    assert await effects_by_body(engine) == {}

    # The parked retry still runs from its own copy of the message, once, and its row
    # goes at the next sweep.
    failing.seqs.clear()
    async with engine.begin() as conn:
        await conn.execute(sa.text("UPDATE eop.retries SET due_at = now() WHERE parked"))
    spec = app.handlers[SUB]
    due = await retries.take_due(stale.store, spec, 10, stale.ack_wait_s)
    assert [p.message.seq for p in due] == [6]
    assert await retry_batch.RetryBatch(stale).run(due) == [Outcome.PROCESSED]
    assert await effects_by_body(engine) == {"m6": 1}
    assert await retry_rows(engine) == {}
    await compactor(app, old_enough, floor=0).compact_once()
    assert await inbox(engine) == {OLD: {2, 4}, CURRENT: {7}}


async def test_epochs_read_as_superseded_are_left_when_the_stream_changed_meanwhile(
    app: eop.App, engine: AsyncEngine
) -> None:
    """The stream is recreated between a round's two readings, and another worker has
    already filed messages under the newest epoch: the round lists that epoch among those
    other than the one it read first, so it must sweep nothing (it would skip every
    message of the live stream); the next round, reading the newest epoch twice, sweeps
    the two earlier ones."""
    async with engine.begin() as conn:
        await insert_inbox(conn, [*old_rows(CURRENT), *old_rows(NEWER)])
    before = await inbox(engine)

    changed = Readings(CURRENT, NEWER, current_for_s=DELAY_S + 1)
    assert await compactor(app, changed, floor=0).compact_once() is None
    assert await inbox(engine) == before
    assert set((await watermarks(engine)).values()) == {0}

    settled = Readings(NEWER, current_for_s=DELAY_S + 1)
    await compactor(app, settled, floor=0).compact_once()
    assert await inbox(engine) == {CURRENT: {2, 4}, NEWER: {1, 2, 3, 4, 5}}
    assert await watermarks(engine) == {CURRENT: compaction.SWEPT, NEWER: 0}


async def test_a_worker_sweeps_the_old_incarnation_of_a_stream_recreated_under_it(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """End to end, with real servers: messages with and without a msg-id are processed,
    the stream is deleted and the worker recreates it; with ``epoch_sweep_after_s`` at 0
    its compactor soon empties the old lane of the rows that may go (the msg-id's row
    stays its retention) and raises its watermark past every sequence; the new
    incarnation's messages are processed once, the old ones were once."""
    await create_effects_table(engine)
    settings = bed.bed_settings(
        database_url, nats_url, epoch_sweep_after_s=0.0, compaction_interval_s=0.2
    )
    app = eop.App(settings=settings)
    app.stream(bed.STREAM, subjects=["ORDERS.>"], storage="file")

    @app.handler(stream=bed.STREAM, subject=bed.SUBJECT, name=SUB)
    async def swept(msg: eop.Message, session: AsyncSession) -> None:
        """Records its message."""
        await record_effect(session, SUB, msg)

    durable = app.handlers[SUB].durable
    async with bed.running(app):
        for body in ("a", "b"):
            await bed.publish(js, body)
        await bed.publish(js, "c", msg_id="c-1")
        await bed.wait_for(lambda: bed.drained(js, durable), what="the first incarnation")
        old = await watermarks(engine)
        assert len(old) == 1
        await js.delete_stream(bed.STREAM)
        await bed.wait_for(
            lambda: bed.drained(js, durable), what="the worker to recreate it", timeout_s=30
        )
        await bed.publish(js, "d")
        await bed.wait_for(lambda: bed.drained(js, durable), what="the new incarnation")
        [old_epoch] = old

        async def swept_old() -> bool:
            return (await watermarks(engine)).get(old_epoch) == compaction.SWEPT

        await bed.wait_for(swept_old, what="the sweep of the old incarnation")
        await asyncio.sleep(0.5)  # a round more: nothing else of it goes
        assert (await inbox(engine)).get(old_epoch) == {3}
    assert await effects_by_body(engine) == {"a": 1, "b": 1, "c": 1, "d": 1}
    marks = await watermarks(engine)
    assert len(marks) == 2
    assert all(v < compaction.SWEPT for e, v in marks.items() if e != old_epoch)
