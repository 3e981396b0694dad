"""The inbox transactions on PostgreSQL: async (asyncpg) and sync (psycopg, in threads).

Both implement :class:`eop.pg.contract.Transaction` on a SQLAlchemy session:
eop's statements (:class:`eop.pg.statements.Statements`: the claim, the dead
letters, the retries' bookkeeping), the handler's run, and COMMIT.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa

from eop import errors, writes
from eop.outbox import table as outbox
from eop.outbox.outgoing import DEFAULT_MAX_PAYLOAD
from eop.pg import direct, models
from eop.pg.sql import inbox as inbox_sql
from eop.pg.threads import SyncThreads

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

    from eop.handler import HandlerSpec
    from eop.message import Message

from eop.pg.failures import INFRASTRUCTURE, DbFailure, classify
from eop.pg.statements import Statements

T = TypeVar("T")


class SqlTransaction(Statements):
    """The protocol's statements over a SQLAlchemy session (async or sync)."""

    def __init__(
        self,
        session: AsyncSession | Session,
        tables: models.Tables,
        spec: HandlerSpec,
        outbox_context: outbox.Context | None = None,
    ) -> None:
        super().__init__(tables, spec)
        self.writes = writes.Writes(session)
        """The transaction's write queue: the handler's, when it takes one
        (:attr:`HandlerSpec.takes_writes`), and the rows it adds to the outbox."""
        info = session.info
        info[outbox.WRITES_KEY] = self.writes
        info[outbox.CONTEXT_KEY] = outbox_context or outbox.Context(tables, DEFAULT_MAX_PAYLOAD)

    def _second_argument(self, session: Any) -> Any:
        """What the handler gets after the message: its write queue, or the session."""
        return self.writes if self.spec.takes_writes else session

    def _sends_nothing(self) -> bool:
        """Whether the handler can run outside a savepoint in :meth:`run_isolated`.

        An ``eop.Writes`` handler that does not ask for :attr:`Writes.session`
        sends nothing while it runs: its writes wait in the queue. If it fails,
        there is nothing to roll back (its queue is dropped); if it succeeds,
        only the sending of its writes needs a savepoint. In a flood of failing
        messages that spares two statements (SAVEPOINT, ROLLBACK TO SAVEPOINT) a run.
        """
        return (
            self.spec.takes_writes
            and not self.writes
            and not self.writes.session_used
            and self.spec not in _SESSION_USERS
        )

    def _check_sent_nothing(self) -> None:
        """After a run outside a savepoint: if the handler asked for the session after all,
        it may have sent statements that no savepoint can take back alone."""
        if self.writes.session_used:
            _SESSION_USERS.add(self.spec)
            self.writes.discard()
            raise _SavepointNeeded()

    def _unsent_failure(self, exc: Exception) -> Exception:
        """The error of a handler run outside a savepoint, as :meth:`run_isolated` returns it."""
        self._check_sent_nothing()
        self.writes.discard()
        if classify(exc) in INFRASTRUCTURE:
            raise exc
        return exc

    async def begin(self, timeouts: sa.Executable, timeouts_text: str) -> None:
        """BEGIN and set the transaction's local timeouts
        (:func:`eop.pg.sql.base.set_local_timeouts`, or the same as plain SQL,
        ``timeouts_text``): the transaction's first statement."""
        await self._rows(timeouts)


class AsyncTransaction(SqlTransaction):
    """A transaction on an ``AsyncSession``, for ``async def`` handlers."""

    def __init__(
        self,
        session: AsyncSession,
        tables: models.Tables,
        spec: HandlerSpec,
        outbox_context: outbox.Context | None = None,
    ) -> None:
        super().__init__(session, tables, spec, outbox_context)
        self.session = session
        self._raw: Any = None
        """The asyncpg connection :meth:`begin` ran on, for the first :meth:`_driver` call."""
        self._adapter: Any = None
        """SQLAlchemy's DBAPI connection under the session since :meth:`begin`, when asyncpg's,
        until the transaction ends: where :meth:`flush` sends queued writes itself."""

    async def begin(self, timeouts: sa.Executable, timeouts_text: str) -> None:
        """BEGIN, then the local timeouts as a simple query on asyncpg's own connection.

        Through the session, that statement cost a quarter of a batch
        transaction's own work (an ORM execution, a greenlet hop, a prepared
        statement and its result); the BEGIN is still the dialect's, so
        SQLAlchemy commits and rolls back this transaction as its own. Other
        drivers (or a dialect without that BEGIN) take the session's way.
        """
        connection = await self.session.connection()
        if connection.dialect.driver == "asyncpg":
            raw = await connection.get_raw_connection()
            adapter = raw.dbapi_connection
            driver: Any = raw.driver_connection  # asyncpg.Connection; untyped in SQLAlchemy
            start = getattr(adapter, "_start_transaction", None)
            if start is not None and getattr(adapter, "_transaction", False) is None:
                try:
                    await start()
                    await driver.execute(timeouts_text)
                except Exception as exc:
                    if classify(exc) is DbFailure.CONNECTION:
                        # What SQLAlchemy does to a connection that failed under it:
                        # the pool drops it rather than hand it out again.
                        with contextlib.suppress(Exception):
                            await connection.invalidate(exc)
                    raise
                self._raw = driver
                self._adapter = adapter
                return
        await self._rows(timeouts)

    async def _rows(
        self, stmt: sa.Executable, params: dict[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        result = await self.session.execute(stmt, params)
        return [tuple(row) for row in result]

    async def _execute(self, stmt: sa.Executable, params: dict[str, Any] | None = None) -> None:
        await self.session.execute(stmt, params)

    async def _execute_many(self, stmt: sa.Executable, params: list[dict[str, Any]]) -> None:
        await self.session.execute(stmt, params)

    async def claim_many(self, messages: list[Message], outcome: str) -> set[int]:
        """Claim a batch in one statement, sent on asyncpg's own connection when it is one.

        The transaction is already open on that connection (the local
        timeouts were set through the session), so the claim is part of it.
        """
        driver = await self._driver()
        if driver is None:
            return await super().claim_many(messages, outcome)
        if not messages:
            return set()
        arguments = self.claim_arguments(messages, outcome)
        records = await driver.fetch(inbox_sql.claim_driver_text(self.tables.schema), *arguments)
        return {int(record[0]) for record in records}

    async def _driver(self) -> Any:
        """The asyncpg connection under the session, or None for another driver."""
        # Taken once: by then nothing but eop's statements ran since begin(), so the
        # session still has its first connection; later calls ask the session.
        raw, self._raw = self._raw, None
        if raw is not None:
            return raw
        connection = await self.session.connection()
        if connection.dialect.driver != "asyncpg":
            return None
        raw = await connection.get_raw_connection()
        return raw.driver_connection

    async def run(self, message: Message, *, flush: bool = True) -> None:
        """Await the handler with this transaction's session (or write queue)."""
        await self._call([message], flush=flush)

    async def run_many(self, messages: list[Message], *, flush: bool = True) -> None:
        """Await a batch handler with the messages of a batch."""
        await self._call(messages, flush=flush)

    async def _call(self, messages: list[Message], *, flush: bool = True) -> None:
        arg, extra = self.spec.arguments(messages)
        func: Any = self.spec.func  # an async handler, given the AsyncSession or Writes
        await func(arg, self._second_argument(self.session), **extra)
        if flush:
            await self.flush()

    async def flush(self) -> None:
        """Send queued writes and pending ORM objects, so their errors are the handler's.

        A handler that only executed statements left nothing to send: no
        greenlet hop then.
        """
        if self.writes:
            # A handler given only the write queue cannot have ended the session's
            # transaction (and so changed its connection); one given the session, or
            # that asked for writes.session, may have.
            if (
                self._adapter is not None
                and self.spec.takes_writes
                and not self.writes.session_used
            ):
                await direct.send(self.writes, self.session, self._adapter)
            else:
                await self.session.run_sync(self.writes.send)
        if self.session.new or self.session.dirty or self.session.deleted:
            await self.session.flush()

    async def run_isolated(self, messages: list[Message]) -> Exception | None:
        """Run the handler inside a savepoint; roll it back alone if it fails.

        An ``eop.Writes`` handler that sends nothing while it runs runs before
        the savepoint, which then holds only the sending of its writes
        (:meth:`_sends_nothing`).
        """
        ran = self._sends_nothing()
        if ran:
            try:
                arg, extra = self.spec.arguments(messages)
                func: Any = self.spec.func  # an async handler, given the write queue
                await func(arg, self.writes, **extra)
            except Exception as exc:
                return self._unsent_failure(exc)
            self._check_sent_nothing()
            if not self.writes:
                return None
        savepoint = await self.session.begin_nested()
        try:
            # SQLAlchemy sends the SAVEPOINT with the session's next statement; queued
            # writes sent on asyncpg's own connection (eop.pg.direct) are none, and a
            # failing one would abort the whole transaction: send it now.
            await self.session.connection()
            if ran:
                await self.flush()
            else:
                await self._call(messages)
            await savepoint.commit()
        except Exception as exc:
            self.writes.discard()
            if classify(exc) in INFRASTRUCTURE:
                raise
            await savepoint.rollback()
            return exc
        return None

    async def commit(self) -> None:
        """COMMIT; a connection lost during it makes the outcome unknown."""
        if self.writes:
            await self.flush()  # never left behind, whoever ran the handler
        self._raw = self._adapter = None
        await translate_commit(self.session.commit)
        self.committed = True

    async def rollback(self) -> None:
        """ROLLBACK, ignoring a broken connection."""
        self._raw = self._adapter = None
        with contextlib.suppress(Exception):
            await self.session.rollback()


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
        self._deferred: list[Message] = []
        """Messages whose handler :meth:`run` left to the next :meth:`flush` (or COMMIT)."""

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
                self.session.close()
            threads.release()

        future.add_done_callback(lambda _: threads.later(close))

    def _release(self) -> None:
        """The session gave its connection back to the pool: give the permit back."""
        if self._threads is not None and self._permit and not self._abandoned:
            self._permit = False
            self._threads.release()

    async def begin(self, timeouts: sa.Executable, timeouts_text: str) -> None:
        """BEGIN, then the local timeouts as plain SQL on the session's connection.

        Through ``Session.execute`` that statement took the ORM's execution path
        (its events, a compiled statement, a result to wrap) for a statement
        whose result nobody reads; on the connection it is one driver call. The
        transaction is still the session's: its first statement, its COMMIT.
        """

        def execute() -> None:
            self.session.connection().exec_driver_sql(timeouts_text)

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

    async def claim_many(self, messages: list[Message], outcome: str) -> set[int]:
        """Claim a batch in one statement, as plain SQL on the session's connection when
        its driver is psycopg.

        Through ``Session.execute`` the claim took the ORM's execution path and
        psycopg adapted its arrays element by element: 85,000 instructions a
        message of a 64-message batch (callgrind), of about 100,000 for all of
        eop's own steps of a sync transaction; 41,000 this way. On the
        connection, the claim is still the session's transaction's, and
        ``exec_driver_sql`` keeps SQLAlchemy's error translation and its
        handling of a lost connection.
        """
        if not messages:
            return set()
        arguments = self.claim_arguments(messages, outcome)

        def execute() -> set[int]:
            connection = self.session.connection()
            if connection.dialect.driver != "psycopg":
                rows = self.session.execute(inbox_sql.claim(self.tables, arguments))
            else:
                rows = connection.exec_driver_sql(
                    inbox_sql.claim_pyformat_text(self.tables.schema),
                    inbox_sql.claim_pyformat_parameters(arguments),
                )
            return {int(row[0]) for row in rows}

        return await self._step(execute)

    async def run(self, message: Message, *, flush: bool = True) -> None:
        """Call the handler in a worker thread, off the event loop, and flush its writes.

        With ``flush=False`` (a batch's handlers, run one after another) the call
        itself waits for :meth:`flush`, which runs every waiting handler in
        order, then sends their writes, in one thread hop: a hop per message
        cost more than the handler and its INSERT. A handler's error is raised
        by that :meth:`flush`, as its writes' errors are.
        """
        if not flush:
            self._deferred.append(message)
            return
        await self._step(self._call, [message], flush)

    async def run_many(self, messages: list[Message], *, flush: bool = True) -> None:
        """Call a batch handler in a worker thread with the messages of a batch."""
        await self._step(self._call, messages, flush)

    def _call(self, messages: list[Message], flush: bool = True) -> None:
        arg, extra = self.spec.arguments(messages)
        func: Any = self.spec.func  # a sync handler, given the Session or Writes
        func(arg, self._second_argument(self.session), **extra)
        if flush:
            self._flush()

    async def flush(self) -> None:
        """Run the handlers :meth:`run` left waiting, send queued writes, then flush pending
        ORM objects, in one worker thread step."""
        deferred, self._deferred = self._deferred, []
        await self._step(self._flush, deferred)

    def _flush(self, deferred: Sequence[Message] = ()) -> None:
        for message in deferred:
            self._call([message], flush=False)
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
            if classify(exc) in INFRASTRUCTURE:
                raise
            savepoint.rollback()
            return exc
        return None

    async def commit(self) -> None:
        """COMMIT in a worker thread; a connection lost during it makes the outcome unknown."""
        if self.writes or self._deferred:
            await self.flush()  # never left behind, whoever ran the handler
        await translate_commit(functools.partial(self._step, self.session.commit))
        self.committed = True
        self._release()

    async def rollback(self) -> None:
        """ROLLBACK, ignoring a broken connection."""
        self._deferred = []
        try:
            await self._step(self.session.rollback)
        except Exception:
            return  # the permit stays until close(), which also returns the connection
        self._release()

    async def close(self) -> None:
        """Close the session (rolling back what is open) and give the permit back."""
        if self._abandoned:
            return
        if self._threads is not None and not self._permit:
            # No connection to give back: nothing to send, nothing to wait for.
            self.session.close()
            return
        with contextlib.suppress(Exception):
            await self._step(self.session.close)
        if self._threads is not None and not self._abandoned:
            self._permit = False
            self._threads.release()


_SESSION_USERS: weakref.WeakSet[HandlerSpec] = weakref.WeakSet()
"""``eop.Writes`` handlers seen asking for the session: they always run in a savepoint."""


class _SavepointNeeded(errors.DatabaseUnavailable):
    """An ``eop.Writes`` handler run outside a savepoint (it usually sends nothing) asked for
    the session: whatever it sent cannot be taken back alone, so the transaction is rolled
    back and run again, never counted (a failure of eop's, not the handler's), this time
    with the handler in a savepoint, as it will be from now on."""


async def translate_commit(commit: Callable[[], Awaitable[object]]) -> None:
    """Await ``commit()``; a connection lost during it is :class:`eop.AmbiguousCommit`,
    a serialization failure or deadlock :class:`eop.TransactionConflict`."""
    try:
        await commit()
    except Exception as exc:
        failure = classify(exc)
        # COMMIT runs no handler code: an OSError here is the database's socket.
        if failure is DbFailure.CONNECTION or isinstance(exc, OSError):
            raise errors.AmbiguousCommit() from exc
        if failure is DbFailure.CONFLICT:
            raise errors.TransactionConflict() from exc
        raise
