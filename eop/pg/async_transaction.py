"""The inbox transaction on an ``AsyncSession`` (asyncpg), for ``async def`` handlers:
:class:`eop.pg.contract.Transaction` with asyncpg's own connection where SQLAlchemy's
session would only add work (the local timeouts, the batch claim, queued writes).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from eop import errors
from eop.outbox import table as outbox
from eop.pg import direct, models, pending, session_guard
from eop.pg.failures import INFRASTRUCTURE, DbFailure, classify
from eop.pg.sql import claim as claim_sql
from eop.pg.sql_transaction import SqlTransaction, translate_commit

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

    from eop.handler import HandlerSpec
    from eop.message import Message
    from eop.pg.sql.base import LocalTimeouts


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
        self._timeouts_due: tuple[Any, LocalTimeouts] | None = None
        """The asyncpg connection :meth:`begin` ran on and the local timeouts it left for the
        claim to carry, until a statement sets them (:meth:`_set_timeouts`)."""

    async def begin(self, timeouts: LocalTimeouts) -> None:
        """BEGIN on asyncpg's own connection, the local timeouts left to the claim.

        The claim, a transaction's first statement, sets them itself before it
        locks any row (:func:`eop.pg.sql.base.timeouts_first`): a round trip
        fewer a transaction, which at a steady rate is a batch of one or two
        messages. Any other statement that comes first sends them alone
        (:meth:`_set_timeouts`). Through the session, that statement cost a
        quarter of a batch transaction's own work (an ORM execution, a
        greenlet hop, a prepared statement and its result); the BEGIN is still
        the dialect's, so SQLAlchemy commits and rolls back this transaction as
        its own. Other drivers (or a dialect without that BEGIN) take the
        session's way.
        """
        connection = await self.session.connection()
        if connection.sync_connection is not None:
            self._root = connection.sync_connection.get_transaction()
        if connection.dialect.driver == "asyncpg":
            raw = await connection.get_raw_connection()
            adapter = raw.dbapi_connection
            driver: Any = raw.driver_connection  # asyncpg.Connection; untyped in SQLAlchemy
            start = getattr(adapter, "_start_transaction", None)
            if start is not None and getattr(adapter, "_transaction", False) is None:
                try:
                    await start()
                except Exception as exc:
                    if classify(exc) is DbFailure.CONNECTION:
                        # What SQLAlchemy does to a connection that failed under it:
                        # the pool drops it rather than hand it out again.
                        with contextlib.suppress(Exception):
                            await connection.invalidate(exc)
                    raise
                self._raw = driver
                self._driver_handle = driver
                self._adapter = adapter
                self._timeouts_due = (driver, timeouts)
                return
        await self._rows(timeouts.statement)

    async def _set_timeouts(self) -> None:
        """Send the local timeouts :meth:`begin` left to the claim, before a statement that
        is not the claim, or before the handler gets the session."""
        if self._timeouts_due is not None:
            (driver, timeouts), self._timeouts_due = self._timeouts_due, None
            await driver.execute(timeouts.text)

    async def _rows(
        self, stmt: sa.Executable, params: dict[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        await self._set_timeouts()
        result = await self.session.execute(stmt, params)
        return [tuple(row) for row in result]

    async def _execute(self, stmt: sa.Executable, params: dict[str, Any] | None = None) -> None:
        await self._set_timeouts()
        await self.session.execute(stmt, params)

    async def _execute_many(self, stmt: sa.Executable, params: list[dict[str, Any]]) -> None:
        await self._set_timeouts()
        await self.session.execute(stmt, params)

    async def _claim(self, arguments: tuple[Any, ...]) -> set[int]:
        """Send the claim on asyncpg's own connection when it is one.

        The transaction is already open on that connection, so the claim is
        part of it; as its first statement, the claim sets its local timeouts.
        """
        driver = await self._driver()
        if driver is None:
            return await super()._claim(arguments)
        schema = self.tables.schema
        if self._timeouts_due is None:
            records = await driver.fetch(claim_sql.claim_driver_text(schema), *arguments)
        else:
            _, timeouts = self._timeouts_due
            self._timeouts_due = None
            records = await driver.fetch(
                claim_sql.claim_driver_text(schema, timeouts=True), *arguments, *timeouts.values
            )
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
        await self._invoke(messages, self._second_argument(self.session))
        self._check_intact(messages)
        if flush:
            await self.flush()

    def _driver_in_transaction(self, driver: Any) -> bool | None:
        """asyncpg's own status: False after a ``COMMIT`` or ``ROLLBACK`` statement."""
        return bool(driver.is_in_transaction())

    async def _invoke(self, messages: list[Message], second: Any) -> None:
        """Call the handler with ``messages`` and ``second`` (its session or write queue)."""
        await self._set_timeouts()
        arg, extra = self.spec.arguments(messages)
        func: Any = self.spec.func  # an async handler, given the AsyncSession or Writes
        await func(arg, second, **extra)

    async def flush(self) -> None:
        """Send queued writes and pending ORM objects, so their errors are the handler's.

        A handler that only executed statements left nothing to send: no
        greenlet hop then.
        """
        await self._set_timeouts()
        if self.session.new:
            pending.queue(self.session.sync_session, self.writes)
        if self.writes:
            # A handler given only the write queue cannot have ended the session's
            # transaction (and so changed its connection); one given the session, or
            # that asked for writes.session, may have, unless the transaction eop
            # began is still active after it.
            if self._adapter is not None and (self._queue_only() or self._intact()):
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
        await self._set_timeouts()
        ran = self._sends_nothing()
        if ran:
            try:
                await self._invoke(messages, self.writes)
                self._check_intact(messages)
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
            if isinstance(exc, errors.TransactionEndedByHandler) and exc.ended:
                return exc  # the savepoint went with the transaction
            if classify(exc) in INFRASTRUCTURE:
                raise
            failure = self._savepoint_failure(exc, savepoint, messages)
            await savepoint.rollback()
            return failure
        return None

    async def commit(self) -> None:
        """COMMIT; a connection lost during it makes the outcome unknown."""
        self._driver_handle = None
        if self.writes:
            await self.flush()  # never left behind, whoever ran the handler
        self._raw = self._adapter = self._timeouts_due = None
        await translate_commit(functools.partial(session_guard.end_async, self.session, "commit"))
        self.committed = True

    async def rollback(self) -> None:
        """ROLLBACK, ignoring a broken connection."""
        self._raw = self._adapter = self._timeouts_due = self._driver_handle = None
        with contextlib.suppress(Exception):
            await session_guard.end_async(self.session, "rollback")
