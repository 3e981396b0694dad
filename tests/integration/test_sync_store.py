"""Sync transactions through the real store, on the async engine (the default) and on a
psycopg ``sync_sessionmaker``: the claim on the driver's connection, the ORM's flush.

These drive :class:`eop.pg.store.PostgresStore` as the batch protocol does
(claim, each handler with ``flush=False``, one flush, COMMIT), without NATS.
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncEngine

import eop
from eop import settings as settings_mod
from eop.handler import HandlerSpec
from eop.pg import models
from eop.pg.store import PostgresStore

from .bed import scalar, wait_for

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)


class _Base(orm.DeclarativeBase):
    pass


class Parent(_Base):
    """A row whose key the database makes, with children pointing at it."""

    __tablename__ = "sync_parents"
    id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, primary_key=True, autoincrement=True)
    seq: orm.Mapped[int] = orm.mapped_column(sa.BigInteger)
    children: orm.Mapped[list[Child]] = orm.relationship(back_populates="parent")


class Child(_Base):
    """A row that needs its parent's generated key before it can be inserted."""

    __tablename__ = "sync_children"
    id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, primary_key=True, autoincrement=True)
    parent_id: orm.Mapped[int] = orm.mapped_column(sa.ForeignKey("sync_parents.id"))
    seq: orm.Mapped[int] = orm.mapped_column(sa.BigInteger)
    parent: orm.Mapped[Parent] = orm.relationship(back_populates="children")


def message(seq: int, **changes: Any) -> eop.Message:
    fields: dict[str, Any] = {
        "subscription": "h",
        "subject": "orders.new",
        "data": b"{}",
        "headers": {},
        "stream": "ORDERS",
        "stream_epoch": "e1",
        "seq": seq,
        "num_delivered": 1,
        "timestamp": NOW,
    }
    fields.update(changes)
    return eop.Message(**fields)


@pytest.fixture(params=["bridged", "psycopg"])
async def app(
    request: pytest.FixtureRequest, database_url: str, engine: AsyncEngine
) -> AsyncIterator[eop.App]:
    """An app whose sync handlers run on its async engine (the default), or on a psycopg
    ``sync_sessionmaker`` given to it (eop's own, so with its pages of parameters)."""
    async with engine.begin() as conn:
        await conn.run_sync(_Base.metadata.create_all)
    settings = settings_mod.Settings(database_url=database_url)
    app = eop.App(settings=settings)
    if request.param == "psycopg":
        app = eop.App(settings=settings, sync_sessionmaker=app.sync_sessionmaker)
        assert not app.bridges_sync_handlers()
    yield app
    await app.dispose()


def sync_engine_of(app: eop.App) -> sa.Engine:
    """The engine a sync handler's statements go through."""
    if app.bridges_sync_handlers():
        return app.engine.sync_engine
    bind = app.sync_sessionmaker.kw["bind"]
    assert isinstance(bind, sa.Engine)
    return bind


@pytest.fixture
async def store(app: eop.App) -> AsyncIterator[PostgresStore]:
    store = app.make_store()
    yield store
    store.close()


async def run_batch(store: PostgresStore, spec: HandlerSpec, msgs: list[eop.Message]) -> set[int]:
    """One batch transaction as :class:`eop.protocol.batch.BatchProcessor` runs it."""
    async with store.transaction(spec) as tx:
        claimed = await tx.claim_many(msgs, models.OUTCOME_PROCESSED)
        for msg in msgs:
            if msg.seq in claimed:
                await tx.run(msg, flush=False)
        await tx.flush()
        await tx.commit()
    return claimed


async def inbox_rows(engine: AsyncEngine, subscription: str) -> list[tuple[Any, ...]]:
    async with engine.connect() as conn:
        result = await conn.execute(
            sa.text(
                "SELECT i.stream_seq, w.stream_epoch, i.delivery_count, i.msg_id, i.fingerprint,"
                " i.outcome FROM eop.inbox AS i JOIN eop.watermarks AS w USING (lane)"
                " WHERE i.subscription = :s ORDER BY i.stream_seq"
            ),
            {"s": subscription},
        )
        return [tuple(row) for row in result]


def odd_batch(subscription: str) -> list[eop.Message]:
    """Messages whose per-row values all differ, in ways an array's text must escape."""
    subjects = ['orders."quoted"', "orders.back\\slash", "orders.{brace},comma", "orders.ünï"]
    epochs = ['e"quoted"{brace},ünï', "e\\back\\slash"]
    return [
        message(
            seq,
            subscription=subscription,
            subject=subjects[seq % 4],
            stream_epoch=epochs[seq % 2],
            num_delivered=1 + seq % 3,
            headers={"Nats-Msg-Id": f'id "{seq}" \\'} if seq % 2 else {},
            data=f'{{"n": {seq}}}'.encode(),
        )
        for seq in range(1, 9)
    ]


async def test_a_sync_claim_stores_the_rows_an_async_claim_stores(
    app: eop.App, store: PostgresStore, engine: AsyncEngine
) -> None:
    """The sync claim (on psycopg: its arrays as array text): two epochs
    with quotes, backslashes, braces and non-ASCII (each its own lane, made by the claim),
    varied delivery counts and a mix of msg-ids and none are stored exactly as the async
    claim stores them."""

    @app.handler(stream="ORDERS", subject="orders.>", name="by_sync")
    def by_sync(msg: eop.Message, session: orm.Session) -> None: ...

    @app.handler(stream="ORDERS", subject="orders.>", name="by_async")
    async def by_async(msg: eop.Message, session: Any) -> None: ...

    sync_claimed = await run_batch(store, app.handlers["by_sync"], odd_batch("by_sync"))
    async_claimed = await run_batch(store, app.handlers["by_async"], odd_batch("by_async"))
    assert sync_claimed == async_claimed == set(range(1, 9))
    sync_rows = await inbox_rows(engine, "by_sync")
    assert sync_rows == await inbox_rows(engine, "by_async")
    assert [row[1] for row in sync_rows[:3]] == [
        "e\\back\\slash",
        'e"quoted"{brace},ünï',
        "e\\back\\slash",
    ]
    # Claimed once: the same batch again claims nothing.
    assert await run_batch(store, app.handlers["by_sync"], odd_batch("by_sync")) == set()


async def test_a_sync_claim_claims_nothing_at_or_below_the_watermark(
    app: eop.App, store: PostgresStore, engine: AsyncEngine
) -> None:
    """A compacted sequence (at or below the watermark) is not claimed again."""

    @app.handler(stream="ORDERS", subject="orders.>", name="h")
    def h(msg: eop.Message, session: orm.Session) -> None: ...

    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "INSERT INTO eop.watermarks (subscription, stream, stream_epoch, watermark)"
                " VALUES ('h', 'ORDERS', 'e1', 5)"
            )
        )
    claimed = await run_batch(store, app.handlers["h"], [message(seq) for seq in range(3, 9)])
    assert claimed == {6, 7, 8}


async def test_a_claim_holds_each_row_to_its_own_epochs_watermark_on_both_drivers(
    app: eop.App, store: PostgresStore, engine: AsyncEngine
) -> None:
    """A batch of one epoch reads its watermark once; a batch spanning two reads each row's
    own: on psycopg and on asyncpg alike, a sequence at or below its epoch's watermark is
    not claimed, one above it is, and an epoch without a watermark row claims all."""

    @app.handler(stream="ORDERS", subject="orders.>", name="h")
    def by_sync(msg: eop.Message, session: orm.Session) -> None: ...

    @app.handler(stream="ORDERS", subject="orders.>", name="h_async")
    async def by_async(msg: eop.Message, session: Any) -> None: ...

    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "INSERT INTO eop.watermarks (subscription, stream, stream_epoch, watermark)"
                " VALUES (:s, 'ORDERS', 'e1', 5), (:s, 'ORDERS', 'e2', 12)"
            ),
            [{"s": "h"}, {"s": "h_async"}],
        )
    for name in ("h", "h_async"):
        spec = app.handlers[name]
        one = [message(seq, subscription=name) for seq in range(3, 9)]
        assert await run_batch(store, spec, one) == {6, 7, 8}
        two = [message(seq, subscription=name, stream_epoch="e2") for seq in range(10, 15)]
        two += [message(seq, subscription=name, stream_epoch="e3") for seq in (1, 2)]
        two += [message(seq, subscription=name) for seq in (4, 9)]
        assert await run_batch(store, spec, two) == {13, 14, 1, 2, 9}


async def test_a_sync_batch_flushes_generated_keys_relationships_and_events(
    app: eop.App, store: PostgresStore, engine: AsyncEngine
) -> None:
    """64 parents with database-made keys and a child each, added by a sync handler: after
    the batch every parent has its key, every child points at its own parent (the flush
    sends the parents in two pages and reads their keys back in order), and the ORM's
    flush and mapper events fire for each object."""
    added: list[Parent] = []
    events: list[str] = []

    @app.handler(stream="ORDERS", subject="orders.>", name="family")
    def family(msg: eop.Message, session: orm.Session) -> None:
        parent = Parent(seq=msg.seq, children=[Child(seq=msg.seq)])
        session.add(parent)
        added.append(parent)

    def before_flush(session: orm.Session, context: Any, instances: Any) -> None:
        events.append("before_flush")

    def after_insert(mapper: Any, connection: Any, target: Parent) -> None:
        assert target.id is not None
        events.append("after_insert")

    pages: list[int] = []

    def before_cursor_execute(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        if statement.startswith("INSERT INTO sync_parents"):
            pages.append(len(params))

    sync_engine = sync_engine_of(app)
    sa.event.listen(orm.Session, "before_flush", before_flush)
    sa.event.listen(Parent, "after_insert", after_insert)
    sa.event.listen(sync_engine, "before_cursor_execute", before_cursor_execute)
    try:
        claimed = await run_batch(store, app.handlers["family"], [message(s) for s in range(1, 65)])
    finally:
        sa.event.remove(orm.Session, "before_flush", before_flush)
        sa.event.remove(Parent, "after_insert", after_insert)
        sa.event.remove(sync_engine, "before_cursor_execute", before_cursor_execute)
    assert claimed == set(range(1, 65))
    if app.bridges_sync_handlers():
        # asyncpg's statements of many rows: one page of SQLAlchemy's.
        assert pages == [64]
    else:
        # Statements of at most 50 parameters, which psycopg parses once.
        assert pages == [50, 14]
    assert events.count("after_insert") == 64
    assert "before_flush" in events
    keys = [parent.id for parent in added]
    assert None not in keys
    assert len(set(keys)) == 64
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.text(
                    "SELECT p.id, p.seq, c.seq FROM sync_parents p"
                    " JOIN sync_children c ON c.parent_id = p.id ORDER BY p.seq"
                )
            )
        ).all()
    assert [(row[0], row[1]) for row in rows] == [(p.id, p.seq) for p in added]
    assert all(row[1] == row[2] for row in rows)


async def test_a_failing_sync_handler_rolls_back_its_claim_and_the_batchs_writes(
    app: eop.App, store: PostgresStore, engine: AsyncEngine
) -> None:
    """The claim runs on the session's own connection, inside its transaction: when a
    handler of the batch fails at flush and the transaction is rolled back, neither the
    inbox rows nor the other handlers' rows remain."""

    @app.handler(stream="ORDERS", subject="orders.>", name="fails")
    def fails(msg: eop.Message, session: orm.Session) -> None:
        session.add(Parent(seq=msg.seq))
        if msg.seq == 3:
            raise RuntimeError("handler failed")

    spec = app.handlers["fails"]
    msgs = [message(seq) for seq in range(1, 5)]
    async with store.transaction(spec) as tx:
        assert await tx.claim_many(msgs, models.OUTCOME_PROCESSED) == {1, 2, 3, 4}
        for msg in msgs:
            await tx.run(msg, flush=False)
        with pytest.raises(RuntimeError, match="handler failed"):
            await tx.flush()
        await tx.rollback()
    assert await inbox_rows(engine, "fails") == []
    async with engine.connect() as conn:
        assert (await conn.execute(sa.text("SELECT count(*) FROM sync_parents"))).scalar() == 0
    # The connection went back to the pool clean: the batch claims again and commits.
    assert await run_batch(store, spec, [m for m in msgs if m.seq != 3]) == {1, 2, 4}


WIDE_COLUMNS = 60


class Wide(_Base):
    """A row of more parameters than psycopg keeps parsed statements for (50)."""

    __tablename__ = "sync_wide"
    id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, primary_key=True, autoincrement=True)
    seq: orm.Mapped[int] = orm.mapped_column(sa.BigInteger)
    __table_args__ = tuple(sa.Column(f"c{i}", sa.Integer) for i in range(WIDE_COLUMNS))


async def test_a_sync_batch_flushes_rows_wider_than_a_page(
    app: eop.App, store: PostgresStore, engine: AsyncEngine
) -> None:
    """Objects of 61 columns with database-made keys: no page of 50 parameters holds one,
    and the flush still sends them all and reads every key back. An ``after_insert``
    listener wants the keys, so the flush is SQLAlchemy's (:mod:`eop.pg.pending`)."""
    added: list[Wide] = []
    inserted: list[int] = []

    def after_insert(mapper: Any, connection: Any, target: Wide) -> None:
        inserted.append(target.id)

    @app.handler(stream="ORDERS", subject="orders.>", name="wide")
    def wide(msg: eop.Message, session: orm.Session) -> None:
        row = Wide(seq=msg.seq)
        for i in range(WIDE_COLUMNS):
            setattr(row, f"c{i}", msg.seq)
        session.add(row)
        added.append(row)

    sa.event.listen(Wide, "after_insert", after_insert)
    try:
        claimed = await run_batch(store, app.handlers["wide"], [message(s) for s in range(1, 9)])
    finally:
        sa.event.remove(Wide, "after_insert", after_insert)
    assert claimed == set(range(1, 9))
    assert len({row.id for row in added if row.id is not None}) == 8
    assert inserted == [row.id for row in added]
    async with engine.connect() as conn:
        rows = (
            await conn.execute(sa.text("SELECT id, seq, c59 FROM sync_wide ORDER BY seq"))
        ).all()
    assert [tuple(row) for row in rows] == [(row.id, row.seq, row.seq) for row in added]


async def test_a_sync_handler_cancelled_mid_run_sends_nothing_more_and_keeps_its_transaction(
    database_url: str, engine: AsyncEngine
) -> None:
    """On the async engine, a sync handler still running code of its own in its thread
    when its batch was cancelled (a stop) sends nothing more: its next statement raises
    asyncio.CancelledError in it. Its session and connection stay its own until it
    returns (never a connection the pool handed to another), and are rolled back then.
    Then no row of it and no inbox row exist, and the pool's one connection serves the
    next batch."""
    async with engine.begin() as conn:
        await conn.run_sync(_Base.metadata.create_all)
    app = eop.App(settings=settings_mod.Settings(database_url=database_url, db_pool_size=1))
    started, go, refused = threading.Event(), threading.Event(), threading.Event()

    @app.handler(stream="ORDERS", subject="orders.>", name="late")
    def late(msg: eop.Message, session: orm.Session) -> None:
        if msg.seq != 1:
            session.add(Parent(seq=msg.seq))
            return
        started.set()
        go.wait(10)
        try:
            session.execute(sa.text("INSERT INTO sync_parents (seq) VALUES (99)"))
        except asyncio.CancelledError:
            refused.set()
            raise

    assert app.bridges_sync_handlers()
    store = app.make_store()
    try:
        spec = app.handlers["late"]
        batch = asyncio.ensure_future(run_batch(store, spec, [message(1)]))
        await asyncio.to_thread(started.wait, 10)
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
        go.set()
        # Waits for the pool's one connection: back once the handler returned.
        assert await asyncio.wait_for(run_batch(store, spec, [message(2)]), 30) == {2}
        assert refused.is_set()
        async with engine.connect() as conn:
            seqs = (await conn.execute(sa.text("SELECT seq FROM sync_parents"))).scalars()
            assert list(seqs) == [2]
        assert [row[0] for row in await inbox_rows(engine, "h")] == [2]
    finally:
        go.set()
        store.close()
        await app.dispose()


async def test_a_connection_invalidated_in_a_sync_handlers_thread_is_terminated_on_the_loop(
    database_url: str,
    engine: AsyncEngine,
    caplog: pytest.LogCaptureFixture,
    recwarn: pytest.WarningsRecorder,
) -> None:
    """On the async engine, a connection SQLAlchemy invalidates in a sync handler's thread
    (as it does on a dead server or a cancelled statement) is terminated from the event
    loop: its server process ends, SQLAlchemy's pool logs no error ("no current event
    loop" in the thread) and no coroutine is left unawaited. The pool's one connection is
    made anew for the next batch."""
    async with engine.begin() as conn:
        await conn.run_sync(_Base.metadata.create_all)
    app = eop.App(settings=settings_mod.Settings(database_url=database_url, db_pool_size=1))
    pids: list[int] = []

    @app.handler(stream="ORDERS", subject="orders.>", name="invalidates")
    def invalidates(msg: eop.Message, session: orm.Session) -> None:
        if msg.seq != 1:
            session.add(Parent(seq=msg.seq))
            return
        connection = session.connection()
        pids.append(connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
        connection.invalidate()
        raise LookupError("after the invalidation")

    async def ended(pid: int) -> bool:
        count = await scalar(engine, "SELECT count(*) FROM pg_stat_activity WHERE pid = :p", p=pid)
        return bool(count == 0)

    store = app.make_store()
    try:
        spec = app.handlers["invalidates"]
        with pytest.raises(LookupError, match="after the invalidation"):
            await run_batch(store, spec, [message(1)])
        await wait_for(lambda: ended(pids[0]), what="the invalidated connection's backend")
        assert await asyncio.wait_for(run_batch(store, spec, [message(2)]), 30) == {2}
    finally:
        store.close()
        await app.dispose()
    gc.collect()  # a coroutine never awaited warns when it is collected
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert [str(w.message) for w in recwarn if "never awaited" in str(w.message)] == []
