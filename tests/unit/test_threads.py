"""Sync transactions' threads and permits, and how the App shares its connections."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import orm

import eop
from eop import errors
from eop import settings as settings_mod
from eop.handler import HandlerSpec
from eop.pg import models, session_guard, transactions
from eop.pg.threads import SyncThreads


class FakeSession:
    """A sync Session stand-in: records its calls; ``rollback`` may block until released."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.info: dict[str, object] = {}
        self.new: list[object] = []  # nothing added: no flush of eop's own (eop.pg.pending)
        self.gate = threading.Event()
        self.gate.set()
        self.closed = threading.Event()

    def rollback(self) -> None:
        self.gate.wait()
        self.calls.append("rollback")

    def commit(self) -> None:
        self.calls.append("commit")

    def close(self) -> None:
        self.calls.append("close")
        self.closed.set()


def sync_spec() -> HandlerSpec:
    def handler(msg: Any, session: Any) -> None: ...

    return HandlerSpec(func=handler, name="h", stream="S", subject="s", durable="eop-h")


def transaction(threads: SyncThreads, session: FakeSession) -> transactions.SyncTransaction:
    return transactions.SyncTransaction(session, models.tables(), sync_spec(), threads)  # type: ignore[arg-type]


async def test_a_permit_is_held_from_the_first_step_until_the_connection_is_given_back() -> None:
    """A step takes the permit; COMMIT gives it back; a close without a connection sends nothing."""
    threads = SyncThreads(1)
    session = FakeSession()
    tx = transaction(threads, session)
    await tx._step(lambda: None)
    other = asyncio.ensure_future(transaction(threads, FakeSession())._step(lambda: None))
    await asyncio.sleep(0.05)
    assert not other.done()  # the only permit is taken
    await tx.commit()
    await asyncio.wait_for(other, 5)
    await tx.close()
    assert session.calls == ["commit", "close"]
    threads.close()


async def test_a_cancelled_step_keeps_its_permit_until_its_thread_has_closed_the_session() -> None:
    """Cancelling a step does not free the session under its thread: the thread closes it
    when the step returns, and only then is the permit given back."""
    threads = SyncThreads(1)
    session = FakeSession()
    session.gate.clear()
    tx = transaction(threads, session)
    step = asyncio.ensure_future(tx._step(session_guard.end, session, "rollback"))
    await asyncio.sleep(0.05)
    step.cancel()
    with pytest.raises(asyncio.CancelledError):
        await step
    await tx.close()  # returns at once; the session is the thread's
    assert session.calls == []
    waiting = asyncio.ensure_future(transaction(threads, FakeSession())._step(lambda: None))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    session.gate.set()
    await asyncio.wait_for(waiting, 5)
    assert session.calls == ["rollback", "close"]
    threads.close()


class CountingThreads(SyncThreads):
    """SyncThreads that count the steps submitted to them."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.steps = 0

    def submit(self, func: Any, *args: Any) -> Any:
        self.steps += 1
        return super().submit(func, *args)


async def test_a_batchs_sync_handlers_run_in_one_thread_step_at_flush() -> None:
    """run(flush=False) leaves a sync handler's call to flush, which runs every waiting
    handler in order and flushes the session in one thread step, not a step per message."""
    called: list[int] = []

    def handler(msg: eop.Message, session: Any) -> None:
        called.append(msg.seq)

    spec = HandlerSpec(func=handler, name="h", stream="S", subject="s", durable="eop-h")
    session = FakeSession()
    session.flush = lambda: session.calls.append("flush")  # type: ignore[attr-defined]
    threads = CountingThreads(1)
    tx = transactions.SyncTransaction(session, models.tables(), spec, threads)  # type: ignore[arg-type]
    messages = [
        eop.Message(
            subscription="h",
            subject="s",
            data=b"",
            headers={},
            stream="S",
            stream_epoch="e",
            seq=seq,
            num_delivered=1,
        )
        for seq in (1, 2, 3)
    ]
    for message in messages:
        await tx.run(message, flush=False)
    assert called == []
    assert threads.steps == 0
    await tx.flush()
    assert called == [1, 2, 3]
    assert threads.steps == 1
    assert session.calls == ["flush"]
    await tx.commit()
    assert session.calls == ["flush", "commit"]
    await tx.close()
    threads.close()


def app_with(*kinds: str, given: bool = False, **settings: Any) -> eop.App:
    """An app with handlers of ``kinds``; ``given``: with a psycopg ``sync_sessionmaker``
    of eop's making given to it, so its sync handlers do not run on the async engine."""
    app = eop.App(settings=settings_mod.Settings(**settings))
    _register(app, kinds)
    if given:
        app = eop.App(settings=app.settings, sync_sessionmaker=app.sync_sessionmaker)
        _register(app, kinds)
    return app


def _register(app: eop.App, kinds: tuple[str, ...]) -> None:
    for i, kind in enumerate(kinds):
        if kind == "sync":

            def handler(msg: Any, session: Any) -> None: ...

        else:

            async def handler(msg: Any, session: Any) -> None: ...  # type: ignore[misc]

        app.handler(stream="S", subject=f"s.{i}", name=f"h{i}")(handler)


@pytest.mark.parametrize(
    ("kinds", "pool", "shares"),
    [
        (("async",), 16, (16, 0)),
        (("async", "sync"), 16, (8, 8)),
        (("async", "sync"), 5, (3, 2)),
        (("sync",), 16, (2, 14)),
        (("sync",), 4, (1, 3)),
        (("sync",), 2, (1, 1)),
    ],
)
def test_the_pools_share_one_bound(
    kinds: tuple[str, ...], pool: int, shares: tuple[int, int]
) -> None:
    """With sync handlers on a sync pool, db_pool_size bounds both pools together; the sync
    pool has as many connections as sync transactions may be open, and neither pool
    overflows."""
    app = app_with(*kinds, given=True, db_pool_size=pool)
    assert app.connection_shares() == shares
    assert sum(shares) == pool
    if shares[1]:
        engine = app.sync_sessionmaker.kw["bind"]
        assert engine.pool.size() == app.sync_transactions() == shares[1]
        assert engine.pool._max_overflow == 0
    assert app.engine.pool.size() == shares[0]  # type: ignore[attr-defined]
    assert app.engine.pool._max_overflow == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("kinds", [("async", "sync"), ("sync",)])
def test_sync_handlers_on_the_async_engine_share_its_pool(kinds: tuple[str, ...]) -> None:
    """By default sync handlers' transactions are the async pool's: it has every connection,
    and as many sync transactions (and threads) may be open as it holds."""
    app = app_with(*kinds, db_pool_size=6)
    assert app.bridges_sync_handlers()
    assert app.connection_shares() == (6, 0)
    assert app.sync_transactions() == 6
    assert app.engine.pool.size() == 6  # type: ignore[attr-defined]
    # One connection serves both kinds then.
    assert app_with(*kinds, db_pool_size=1).connection_shares() == (1, 0)


def test_sync_handlers_need_two_connections() -> None:
    """With a sync pool, one connection cannot serve two pools: a clear error, naming the
    setting."""
    with pytest.raises(errors.ConfigurationError, match="db_pool_size"):
        app_with("sync", given=True, db_pool_size=1).connection_shares()


def test_a_given_sync_pool_bounds_the_sync_transactions() -> None:
    """With the user's sync_sessionmaker, eop opens at most pool_size + max_overflow."""
    engine = sa.create_engine("postgresql+psycopg://x@127.0.0.1/x", pool_size=3, max_overflow=2)
    app = eop.App(
        settings=settings_mod.Settings(db_pool_size=16),
        sync_sessionmaker=orm.sessionmaker(engine),
    )
    app.handler(stream="S", subject="s", name="h")(lambda msg, session: None)
    assert app.sync_transactions() == 5
