"""The real inbox store: eop's tables in the app's database."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from eop.outbox import table as outbox
from eop.pg import failures, models, session_guard
from eop.pg.sql import base as base_sql
from eop.pg.threads import SyncThreads

if TYPE_CHECKING:
    from sqlalchemy import orm
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
    from sqlalchemy.orm import Session

    from eop.handler import HandlerSpec
    from eop.message import Message
    from eop.settings import Settings

from eop.pg.contract import Transaction
from eop.pg.transactions import (
    AsyncTransaction,
    SqlTransaction,
    SyncTransaction,
    ThreadedTransaction,
)


class Database(Protocol):
    """What the store needs of the app it serves (:class:`eop.App` is one)."""

    @property
    def settings(self) -> Settings:
        """The schema, the timeouts."""

    @property
    def sessionmaker(self) -> async_sessionmaker[AsyncSession]:
        """Async sessions: async handlers' transactions and eop's own bookkeeping."""

    @property
    def sync_sessionmaker(self) -> orm.sessionmaker[Session]:
        """Sync sessions, for sync handlers' transactions."""

    def sync_transactions(self) -> int:
        """How many sync transactions may be open at once."""

    def bridges_sync_handlers(self) -> bool:
        """Whether sync handlers run on the async engine (:mod:`eop.pg.bridge`)."""


class PostgresStore:
    """The real :class:`Store`: eop's tables in the app's database.

    Sync handlers run in threads of the store's own (:mod:`eop.pg.threads`), as
    many as sync transactions may be open (:meth:`eop.App.sync_transactions`):
    by default on the async session (:class:`ThreadedTransaction`), with a
    ``sync_sessionmaker`` given to the app each step on its session
    (:class:`SyncTransaction`); :meth:`close` lets them go.
    """

    def __init__(self, app: Database) -> None:
        self.app = app
        self.tables = models.tables(app.settings.schema)
        s = app.settings
        timeouts_ms = (int(s.lock_timeout_s * 1000), int(s.statement_timeout_s * 1000))
        self._timeouts = base_sql.local_timeouts(*timeouts_ms)
        self._threads: SyncThreads | None = None
        self._outbox = outbox.Context(self.tables, s.outbox_max_payload)

    def transaction(self, spec: HandlerSpec) -> contextlib.AbstractAsyncContextManager[Transaction]:
        """Open a session, begin with the local timeouts; close (and so roll back) on exit."""
        return self._open(spec)

    @contextlib.asynccontextmanager
    async def _open_async(self, spec: HandlerSpec) -> AsyncIterator[AsyncTransaction]:
        async with self.app.sessionmaker() as session:
            tx = AsyncTransaction(session, self.tables, spec, self._outbox)
            try:
                await failures.connected(tx.begin(self._timeouts))
                yield tx
            finally:
                # The handler's coroutine has ended: the session may close itself.
                session_guard.unguard(session.sync_session)

    @contextlib.asynccontextmanager
    async def _open(self, spec: HandlerSpec) -> AsyncIterator[SqlTransaction]:
        if spec.is_async:
            async with self._open_async(spec) as atx:
                yield atx
            return
        if self._threads is None:
            self._threads = SyncThreads(self.app.sync_transactions())
        tx: ThreadedTransaction | SyncTransaction
        if self.app.bridges_sync_handlers():
            tx = ThreadedTransaction(
                self.app.sessionmaker(), self.tables, spec, self._threads, self._outbox
            )
        else:
            # Making a session sends nothing: its first statement checks a
            # connection out, in a thread, under the permit.
            tx = SyncTransaction(
                self.app.sync_sessionmaker(), self.tables, spec, self._threads, self._outbox
            )
        try:
            await failures.connected(tx.begin(self._timeouts))
            yield tx
        finally:
            await tx.close()

    def session(self) -> AsyncSession:
        """A plain async session for eop's own bookkeeping (compaction, status)."""
        return self.app.sessionmaker()

    @contextlib.asynccontextmanager
    async def autocommit(self) -> AsyncIterator[AsyncSession]:
        """A session whose every statement commits by itself: no BEGIN, no COMMIT, so a
        statement holds the row locks it takes only while it runs. The connection goes
        back to the pool in its usual isolation level."""
        async with self.app.sessionmaker() as session:
            await session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
            yield session

    async def has_outcome(self, spec: HandlerSpec, message: Message) -> bool:
        """Whether this very message has a committed outcome, read in a fresh transaction.

        Read on the async engine, whatever the handler's kind: the caller still
        holds its own transaction, and a sync one waiting here for a second sync
        permit could wait for ever once every permit is held that way.
        """
        async with self._open_async(spec) as tx:
            found = await tx.find(message)
            if found is not None and found.by == "key" and found.fingerprint == message.fingerprint:
                return True
            return await tx.has_dead_letter(message)

    @property
    def abandoned_threads(self) -> int:
        """Threads still running a step after :meth:`close` (a handler that did not return)."""
        return self._threads.busy if self._threads is not None else 0

    def close(self) -> None:
        """Take no more sync steps; threads stuck in a handler are left running."""
        if self._threads is not None:
            self._threads.close()
