"""A handler cannot end eop's transaction: ``commit()``, ``rollback()`` and ``close()`` on
the session eop gives it fail the handler, before they do anything.

Before the guard, a handler's ``commit()`` committed the claim with the writes made so
far (a failure after it was never retried), and its ``rollback()`` dropped the claim
while its later writes committed without it (applied again on redelivery).
"""

from __future__ import annotations

import collections
from collections.abc import MutableMapping
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import eop

from .bed import (
    STREAM,
    SUBJECT,
    bed_settings,
    create_effects_table,
    debug_logs,
    drained,
    effects_by_body,
    publish,
    record_effect,
    running,
    wait_for,
)

_INSERT = sa.text("INSERT INTO effects (handler, msg_key, body) VALUES (:h, :k, :b)")


def _row(handler: str, msg: eop.Message, suffix: str = "") -> dict[str, str]:
    return {"h": handler, "k": msg.idempotency_key + suffix, "b": msg.data.decode() + suffix}


async def _misuse_async(session: AsyncSession, msg: eop.Message) -> None:
    """An async handler's misuse, by the message's body: end the transaction mid-way."""
    body = msg.data.decode()
    if body.startswith("commit"):
        await session.commit()
    elif body.startswith("rollback"):
        await session.rollback()
    elif body.startswith("close"):
        await session.close()


def _misuse_sync(session: Session, msg: eop.Message) -> None:
    """The same on a sync handler's ``Session``."""
    body = msg.data.decode()
    if body.startswith("commit"):
        session.commit()
    elif body.startswith("rollback"):
        session.rollback()
    elif body.startswith("close"):
        session.close()


@pytest.mark.parametrize("sync_path", ["bridged", "psycopg"])
async def test_a_handler_ending_the_transaction_fails_and_commits_nothing_of_its_own(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, sync_path: str
) -> None:
    """Async ORM, sync ``def`` and ``eop.Writes`` (through ``writes.session``) handlers that
    call commit(), rollback() or close() between two writes: each such message is
    dead-lettered after max_attempts with the reason in its error, none of its writes is
    committed (not the one before the call, not the one after), and the good messages
    fetched in the same batches take effect once each. The sync handler runs on the async
    session (the default) and on a psycopg ``sync_sessionmaker`` given to the app."""
    await create_effects_table(engine)
    settings = bed_settings(database_url, nats_url, max_attempts=2, batch=16)
    app = eop.App(settings=settings)
    if sync_path == "psycopg":
        app = eop.App(settings=settings, sync_sessionmaker=app.sync_sessionmaker)

    @app.handler(stream=STREAM, subject=SUBJECT, name="async_orm")
    async def on_async(msg: eop.Message, session: AsyncSession) -> None:
        await session.execute(_INSERT, _row("async_orm", msg, "-before"))
        await _misuse_async(session, msg)
        await record_effect(session, "async_orm", msg)

    @app.handler(stream=STREAM, subject=SUBJECT, name="sync")
    def on_sync(msg: eop.Message, session: Session) -> None:
        session.execute(_INSERT, _row("sync", msg, "-before"))
        _misuse_sync(session, msg)
        session.execute(_INSERT, _row("sync", msg))

    @app.handler(stream=STREAM, subject=SUBJECT, name="writes")
    async def on_writes(msg: eop.Message, writes: eop.Writes) -> None:
        session = writes.session
        await session.execute(_INSERT, _row("writes", msg, "-before"))
        await _misuse_async(session, msg)
        writes.add(_INSERT, _row("writes", msg))

    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    bad = [f"{how}-{i}" for i in range(3) for how in ("commit", "rollback", "close")]
    good = [f"good-{i}" for i in range(12)]
    for i, body in enumerate(good):
        await publish(js, body)
        if i < len(bad):
            await publish(js, bad[i])

    async def settled() -> bool:
        durables = ("eop-async_orm", "eop-sync", "eop-writes")
        done = [await drained(js, durable, engine=engine) for durable in durables]
        return all(done)

    async with running(app):
        await wait_for(settled, timeout_s=60, what="every message settled")

    # Each good message once per handler; of a misusing one, nothing at all.
    assert await effects_by_body(engine) == {
        **{body: 3 for body in good},
        **{f"{body}-before": 3 for body in good},
    }
    async with engine.connect() as conn:
        found = await conn.execute(sa.text("SELECT reason, error FROM eop.dead_letters"))
        letters = [(str(reason), str(error)) for reason, error in found]
    assert len(letters) == 3 * len(bad)  # each misusing message, once per handler
    assert {reason for reason, _ in letters} == {"attempts_exhausted"}
    for how in ("commit", "rollback", "close"):
        named = [
            error for _, error in letters if f"the handler called {how}() on the session" in error
        ]
        assert len(named) == 3 * 3, (how, letters[:3])


async def test_a_handler_may_flush_and_roll_back_its_own_savepoint(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """What the guard's error points to works: flush() sends writes early, and a savepoint
    (begin_nested) whose part failed rolls back alone, on the async and the sync session
    and on ``writes.session``, where the writes queued before the savepoint (this
    message's, and in a batch an earlier message's) are sent before it and so kept; each
    message takes effect once, nothing is dead-lettered."""
    await create_effects_table(engine)
    app = eop.App(settings=bed_settings(database_url, nats_url, max_attempts=2, batch=16))
    failing = sa.text("SELECT 1 / 0")

    @app.handler(stream=STREAM, subject=SUBJECT, name="async_orm")
    async def on_async(msg: eop.Message, session: AsyncSession) -> None:
        await session.flush()
        try:
            async with session.begin_nested():
                await session.execute(_INSERT, _row("async_orm", msg, "-undone"))
                await session.execute(failing)
        except sa.exc.DBAPIError:
            pass
        await record_effect(session, "async_orm", msg)

    @app.handler(stream=STREAM, subject=SUBJECT, name="sync")
    def on_sync(msg: eop.Message, session: Session) -> None:
        session.flush()
        try:
            with session.begin_nested():
                session.execute(_INSERT, _row("sync", msg, "-undone"))
                session.execute(failing)
        except sa.exc.DBAPIError:
            pass
        session.execute(_INSERT, _row("sync", msg))

    @app.handler(stream=STREAM, subject=SUBJECT, name="writes")
    async def on_writes(msg: eop.Message, writes: eop.Writes) -> None:
        writes.add(_INSERT, _row("writes", msg))  # queued before the savepoint: kept
        session = writes.session
        try:
            async with session.begin_nested():
                await session.execute(_INSERT, _row("writes", msg, "-undone"))
                await session.execute(failing)
        except sa.exc.DBAPIError:
            pass
        writes.add(_INSERT, _row("writes", msg, "-after"))

    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    bodies = [f"m-{i}" for i in range(10)]
    for body in bodies:
        await publish(js, body)

    async def settled() -> bool:
        durables = ("eop-async_orm", "eop-sync", "eop-writes")
        return all([await drained(js, d, engine=engine) for d in durables])

    async with running(app):
        await wait_for(settled, timeout_s=60, what="every message settled")
    assert await effects_by_body(engine) == {
        **{body: 3 for body in bodies},
        **{f"{body}-after": 1 for body in bodies},
    }
    async with engine.connect() as conn:
        assert (await conn.execute(sa.text("SELECT count(*) FROM eop.dead_letters"))).scalar() == 0


async def _past_the_guard_async(session: AsyncSession, msg: eop.Message) -> None:
    """End the transaction where the session's own methods are not involved."""
    body = msg.data.decode()
    if body.startswith("conn-commit"):
        await (await session.connection()).commit()
    elif body.startswith("tx-commit"):
        transaction = session.get_transaction()
        assert transaction is not None
        await transaction.commit()
    elif body.startswith("sql-commit"):
        await session.execute(sa.text("COMMIT"))
    elif body.startswith("conn-rollback"):
        await (await session.connection()).rollback()


def _past_the_guard_sync(session: Session, msg: eop.Message) -> bool:
    """End the transaction past the session; whether the handler must stop there (a
    COMMIT statement on psycopg, which a later statement would hide by beginning a
    transaction again: that case is documented as unseen)."""
    body = msg.data.decode()
    if body.startswith("conn-commit"):
        session.connection().commit()
    elif body.startswith("conn-rollback"):
        session.connection().rollback()
    elif body.startswith("sql-commit"):
        session.execute(sa.text("COMMIT"))
        return True
    return False


async def _settled_logs(
    app: eop.App, js: Any, engine: AsyncEngine
) -> list[MutableMapping[str, Any]]:
    """Run ``app`` until its async_orm and sync handlers' messages are all settled: every
    line it logged meanwhile."""

    async def settled() -> bool:
        return all([await drained(js, d, engine=engine) for d in ("eop-async_orm", "eop-sync")])

    with debug_logs() as logs:
        async with running(app):
            await wait_for(settled, timeout_s=60, what="every message settled")
    return logs


async def test_a_transaction_ended_past_the_guard_is_found_before_eops_commit(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A handler that ends eop's transaction through its connection, its transaction
    object or a COMMIT statement is found out before eop's COMMIT: it fails with
    TransactionEndedByHandler, logged with the message, instead of eop committing its
    later writes apart from the claim (and, after a rollback, acking a message whose
    claim was dropped). A commit past the guard committed the claim with the writes
    before it, so its redelivery is a duplicate; a rollback's message fails each run and
    is dead-lettered with that error. Good messages take effect once each."""
    await create_effects_table(engine)
    # A batch of one: the error of each message is its own (in a batch, the first
    # handler to commit its transaction commits the claims of all the batch's messages).
    settings = bed_settings(database_url, nats_url, max_attempts=2, batch=1)
    base = eop.App(settings=settings)
    app = eop.App(settings=settings, sync_sessionmaker=base.sync_sessionmaker)

    @app.handler(stream=STREAM, subject=SUBJECT, name="async_orm")
    async def on_async(msg: eop.Message, session: AsyncSession) -> None:
        await session.execute(_INSERT, _row("async_orm", msg, "-before"))
        await _past_the_guard_async(session, msg)
        await session.execute(_INSERT, _row("async_orm", msg, "-after"))

    @app.handler(stream=STREAM, subject="ORDERS.sync", name="sync")
    def on_sync(msg: eop.Message, session: Session) -> None:
        session.execute(_INSERT, _row("sync", msg, "-before"))
        if _past_the_guard_sync(session, msg):
            return
        session.execute(_INSERT, _row("sync", msg, "-after"))

    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    ways = ("conn-commit", "tx-commit", "sql-commit", "conn-rollback")
    sync_ways = ("conn-commit", "sql-commit", "conn-rollback")
    for i in range(2):
        for body in (f"good-{i}", *(f"{way}-{i}" for way in ways)):
            await publish(js, body)
        for body in (f"good-s{i}", *(f"{way}-s{i}" for way in sync_ways)):
            await js.publish("ORDERS.sync", body.encode(), headers={"Nats-Msg-Id": body})

    logs = await _settled_logs(app, js, engine)
    ended = [entry for entry in logs if entry["event"] == "transaction.ended_by_handler"]
    caught = {(entry["handler"], entry["first_seq"]) for entry in ended}
    # Every misusing message, and only those (a rollback's, at each of its runs).
    assert len(caught) == 2 * len(ways) + 2 * len(sync_ways), ended
    effects = await effects_by_body(engine)
    for i in range(2):
        for suffix in ("", "s"):
            assert effects[f"good-{suffix}{i}-before"] == 1
            assert effects[f"good-{suffix}{i}-after"] == 1
            # Committed by the handler with the claim: never run again.
            assert effects[f"conn-commit-{suffix}{i}-before"] == 1
            assert f"conn-commit-{suffix}{i}-after" not in effects
            assert f"conn-rollback-{suffix}{i}-before" not in effects
            assert f"conn-rollback-{suffix}{i}-after" not in effects
        assert effects[f"tx-commit-{i}-before"] == 1
        assert f"tx-commit-{i}-after" not in effects
        assert effects[f"sql-commit-{i}-before"] == 1
        assert effects[f"sql-commit-s{i}-before"] == 1
    async with engine.connect() as conn:
        found_letters = await conn.execute(sa.text("SELECT error FROM eop.dead_letters"))
        letters = [str(error) for (error,) in found_letters]
    assert len(letters) == 4  # the rollbacks', each run failing
    assert all("ended eop's transaction past the session" in error for error in letters)


class _Base(DeclarativeBase):
    pass


class _Taken(_Base):
    """A row whose key a handler may try to insert twice."""

    __tablename__ = "guard_taken"
    key: Mapped[str] = mapped_column(sa.Text, primary_key=True)


async def test_a_handler_that_catches_a_failed_flush_is_told_its_transaction_was_rolled_back(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A handler that catches its flush's IntegrityError and carries on fails, async and
    sync, with an error that names the failed flush (SQLAlchemy rolled eop's transaction,
    or the savepoint eop ran it in, back with it), not one that blames a commit() or
    rollback() it never called nor SQLAlchemy's PendingRollbackError; each run logs
    transaction.ended_by_handler with failed_flush and no batch.failed (eop's own
    failures'); the message is dead-lettered with that error, the flush's error (its
    value masked) as the cause in its traceback, nothing of it committed; the good
    messages beside it take effect once."""
    await create_effects_table(engine)
    async with engine.begin() as conn:
        await conn.run_sync(_Base.metadata.create_all)
        await conn.execute(sa.insert(_Taken.__table__).values(key="taken"))
    app = eop.App(settings=bed_settings(database_url, nats_url, max_attempts=2, batch=8))

    @app.handler(stream=STREAM, subject=SUBJECT, name="async_orm")
    async def on_async(msg: eop.Message, session: AsyncSession) -> None:
        if msg.data.startswith(b"dup"):
            session.add(_Taken(key="taken"))
            try:
                await session.flush()
            except sa.exc.IntegrityError:
                return  # (a statement here would raise SQLAlchemy's PendingRollbackError)
        await session.execute(_INSERT, _row("async_orm", msg))

    @app.handler(stream=STREAM, subject=SUBJECT, name="sync")
    def on_sync(msg: eop.Message, session: Session) -> None:
        if msg.data.startswith(b"dup"):
            session.add(_Taken(key="taken"))
            try:
                session.flush()
            except sa.exc.IntegrityError:
                return
        session.execute(_INSERT, _row("sync", msg))

    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    bodies = ["good-0", "dup-0", "good-1", "dup-1", "good-2"]
    for body in bodies:
        await publish(js, body)

    logs = await _settled_logs(app, js, engine)
    ended = [entry for entry in logs if entry["event"] == "transaction.ended_by_handler"]
    assert all(entry["failed_flush"] == "IntegrityError" for entry in ended), ended
    # Each colliding message's runs say so (a batch's line names its sequences' range),
    # the batch's and the lone ones alike, and no line covers only good messages.
    covers = [
        {(e["handler"], seq) for seq in (2, 4) if e["first_seq"] <= seq <= e["last_seq"]}
        for e in ended
    ]
    assert all(covers), ended
    runs = collections.Counter(pair for covered in covers for pair in covered)
    assert set(runs) == {(h, seq) for h in ("async_orm", "sync") for seq in (2, 4)}
    assert min(runs.values()) >= 2, runs  # each of its two attempts (max_attempts)
    assert not [entry for entry in logs if entry["event"] == "batch.failed"]
    assert await effects_by_body(engine) == {"good-0": 2, "good-1": 2, "good-2": 2}
    async with engine.connect() as conn:
        found = await conn.execute(
            sa.text("SELECT subscription, error, traceback FROM eop.dead_letters")
        )
        letters = sorted((str(name), str(error), str(tb)) for name, error, tb in found)
    assert [name for name, _, _ in letters] == ["async_orm", "async_orm", "sync", "sync"]
    for _, error, tb in letters:
        assert "caught the error of a flush that failed (IntegrityError: " in error, error
        assert "rolled back the savepoint eop ran the handler in" in error, error
        # The flush's own error is the cause, its key's value masked.
        assert "duplicate key value violates unique constraint" in tb, tb
        assert "(taken)" not in tb
