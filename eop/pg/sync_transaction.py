"""The inbox transaction on a sync ``Session`` of the app's ``sync_sessionmaker`` (psycopg),
for plain ``def`` handlers when the app was given one (otherwise they run on the async
session: :mod:`eop.pg.threaded_transaction`), and for Spark's partitions: each step runs
in a worker thread, bounded by :mod:`eop.pg.threads`, off the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa

from eop import errors
from eop.outbox import table as outbox
from eop.pg import models, pending, session_guard
from eop.pg.failures import INFRASTRUCTURE, classify
from eop.pg.sql import claim as claim_sql
from eop.pg.sql_transaction import SqlTransaction, driver_in_transaction, translate_commit
from eop.pg.threads import SyncThreads

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from eop.handler import HandlerSpec
    from eop.message import Message
    from eop.pg.sql.base import LocalTimeouts

T = TypeVar("T")


class SyncTransaction(SqlTransaction):
    """A transaction on a sync ``Session``; each step runs in a worker thread.

    Steps run one after another, never concurrently, so handing the session
    from thread to thread is safe. Where each step runs is :meth:`_step`'s
    choice: with ``threads`` (what :class:`eop.pg.store.PostgresStore` gives), in those
    threads under a permit held while the session holds a connection (see
    :mod:`eop.pg.threads`); without, in :func:`asyncio.to_thread`'s.
    """

    def __init__(
        self,
        session: Session,
        tables: models.Tables,
        spec: HandlerSpec,
        threads: SyncThreads | None = None,
        outbox_context: outbox.Context | None = None,
    ) -> None:
        super().__init__(session, tables, spec, outbox_context)
        self.session = session
        self._threads = threads
        self._permit = False
        self._abandoned = False

    async def _step(self, func: Callable[..., T], *args: Any) -> T:
        """Run one blocking step of the transaction: in a worker thread, off the event loop."""
        threads = self._threads
        if threads is None:
            return await asyncio.to_thread(func, *args)
        if self._abandoned:
            raise RuntimeError("a cancelled step of this transaction still runs in its thread")
        if not self._permit:
            # Before the step checks a connection out of the pool, never after.
            await threads.acquire()
            self._permit = True
        future = threads.submit(func, *args)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.done():
                self._abandon(threads, future)
            raise

    def _abandon(self, threads: SyncThreads, future: concurrent.futures.Future[Any]) -> None:
        """The step was cancelled but its thread may still use the session: it is that
        thread's until the step returns; then the session is closed (rolling back)
        and the permit given back, there."""
        self._abandoned = True

        def close() -> None:
            with contextlib.suppress(Exception):
                session_guard.end(self.session, "close")
            threads.release()

        future.add_done_callback(lambda _: threads.later(close))

    def _release(self) -> None:
        """The session gave its connection back to the pool: give the permit back."""
        if self._threads is not None and self._permit and not self._abandoned:
            self._permit = False
            self._threads.release()

    async def begin(self, timeouts: LocalTimeouts) -> None:
        """BEGIN, then the local timeouts as plain SQL on the session's connection.

        Through ``Session.execute`` that statement took the ORM's execution path
        (its events, a compiled statement, a result to wrap) for a statement
        whose result nobody reads; on the connection it is one driver call. The
        transaction is still the session's: its first statement, its COMMIT.
        """

        def execute() -> None:
            connection = self.session.connection()
            self._root = connection.get_transaction()
            self._driver_handle = connection.connection.dbapi_connection
            connection.exec_driver_sql(timeouts.text)

        await self._step(execute)

    async def _rows(
        self, stmt: sa.Executable, params: dict[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        def execute() -> list[tuple[Any, ...]]:
            result = self.session.execute(stmt, params)
            return [tuple(row) for row in result]

        return await self._step(execute)

    async def _execute(self, stmt: sa.Executable, params: dict[str, Any] | None = None) -> None:
        await self._step(self.session.execute, stmt, params)

    async def _execute_many(self, stmt: sa.Executable, params: list[dict[str, Any]]) -> None:
        await self._step(self.session.execute, stmt, params)

    async def _claim(self, arguments: tuple[Any, ...]) -> set[int]:
        """Send the claim as plain SQL on the session's connection when its driver is psycopg.

        Through ``Session.execute`` the claim took the ORM's execution path and
        psycopg adapted its arrays element by element: 85,000 instructions a
        message of a 64-message batch (callgrind), of about 100,000 for all of
        eop's own steps of a sync transaction; 41,000 this way. On the
        connection, the claim is still the session's transaction's, and
        ``exec_driver_sql`` keeps SQLAlchemy's error translation and its
        handling of a lost connection.
        """

        def execute() -> set[int]:
            connection = self.session.connection()
            if connection.dialect.driver != "psycopg":
                rows = self.session.execute(claim_sql.claim(self.tables, arguments))
            else:
                rows = connection.exec_driver_sql(
                    claim_sql.claim_pyformat_text(self.tables.schema),
                    claim_sql.claim_pyformat_parameters(arguments),
                )
            return {int(row[0]) for row in rows}

        return await self._step(execute)

    async def run(self, message: Message, *, flush: bool = True) -> None:
        """Call the handler in a worker thread, off the event loop, and flush its writes.

        With ``flush=False`` the call waits for :meth:`flush`, which runs every
        waiting handler, then sends their writes, in one thread hop (:meth:`_defer`).
        """
        if self._defer(message, flush):
            return
        await self._step(self._call, [message], flush)

    async def run_many(self, messages: list[Message], *, flush: bool = True) -> None:
        """Call a batch handler in a worker thread with the messages of a batch."""
        await self._step(self._call, messages, flush)

    def _call(self, messages: list[Message], flush: bool = True) -> None:
        arg, extra = self.spec.arguments(messages)
        func: Any = self.spec.func  # a sync handler, given the Session or Writes
        func(arg, self._second_argument(self.session), **extra)
        self._check_intact(messages)
        if flush:
            self._flush()

    async def flush(self) -> None:
        """Run the handlers :meth:`run` left waiting, send queued writes, then flush pending
        ORM objects, in one worker thread step."""
        await self._step(self._flush, self._take_deferred())

    def _driver_in_transaction(self, driver: Any) -> bool | None:
        """psycopg's own status, read in the handler's thread: IDLE after a ``COMMIT`` or
        ``ROLLBACK`` statement; None for a driver without it."""
        return driver_in_transaction(driver)

    def _flush(self, deferred: Sequence[Message] = ()) -> None:
        for message in deferred:
            self._call([message], flush=False)
        if self.session.new:
            pending.queue(self.session, self.writes)
        if self.writes:
            self.writes.send(self.session)
        self.session.flush()

    async def run_isolated(self, messages: list[Message]) -> Exception | None:
        """Run the handler inside a savepoint in a worker thread; roll it back alone if it fails."""
        return await self._step(self._isolated, messages)

    def _isolated(self, messages: list[Message]) -> Exception | None:
        ran = self._sends_nothing()
        if ran:
            try:
                arg, extra = self.spec.arguments(messages)
                func: Any = self.spec.func  # a sync handler, given the write queue
                func(arg, self.writes, **extra)
                self._check_intact(messages)
            except Exception as exc:
                return self._unsent_failure(exc)
            self._check_sent_nothing()
            if not self.writes:
                return None
        savepoint = self.session.begin_nested()
        try:
            if ran:
                self._flush()
            else:
                self._call(messages)
            savepoint.commit()
        except Exception as exc:
            self.writes.discard()
            if isinstance(exc, errors.TransactionEndedByHandler) and exc.ended:
                return exc  # the savepoint went with the transaction
            if classify(exc) in INFRASTRUCTURE:
                raise
            failure = self._savepoint_failure(exc, savepoint, messages)
            savepoint.rollback()
            return failure
        return None

    async def commit(self) -> None:
        """COMMIT in a worker thread; a connection lost during it makes the outcome unknown."""
        self._driver_handle = None
        if self.writes or self._deferred:
            await self.flush()  # never left behind, whoever ran the handler
        commit = functools.partial(self._step, session_guard.end, self.session, "commit")
        await translate_commit(commit)
        self.committed = True
        self._release()

    async def rollback(self) -> None:
        """ROLLBACK, ignoring a broken connection."""
        self._take_deferred()
        try:
            await self._step(session_guard.end, self.session, "rollback")
        except Exception:
            return  # the permit stays until close(), which also returns the connection
        self._release()

    async def close(self) -> None:
        """Close the session (rolling back what is open) and give the permit back."""
        if self._abandoned:
            return
        if self._threads is not None and not self._permit:
            # No connection to give back: nothing to send, nothing to wait for.
            session_guard.end(self.session, "close")
            return
        with contextlib.suppress(Exception):
            await self._step(session_guard.end, self.session, "close")
        if self._threads is not None and not self._abandoned:
            self._permit = False
            self._threads.release()
