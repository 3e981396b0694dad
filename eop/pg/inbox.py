"""The inbox: where a message is claimed, found, or dead-lettered, in PostgreSQL.

:class:`Store` and :class:`Transaction` are the seam between the protocol
(:mod:`eop.protocol.processor`, and :mod:`eop.protocol.batch` for fetched batches)
and the database; :class:`PostgresStore` is the real one, :class:`eop.testing.MemoryStore`
a fake for unit tests. Driver errors are
translated here, at the edge, by :func:`classify`.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from eop import errors, redaction, writes
from eop import message as message_mod
from eop.pg import models, sql
from eop.pg.threads import SyncThreads

if TYPE_CHECKING:
    from sqlalchemy import orm
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
    from sqlalchemy.orm import Session

    from eop.handler import HandlerSpec
    from eop.message import Message
    from eop.settings import Settings

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Existing:
    """What the inbox already holds for a message that could not be claimed."""

    by: str
    """``"key"`` when the inbox key is taken, ``"msg_id"`` when only the msg-id is."""
    fingerprint: bytes | None
    outcome: str


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """Why a message is dead-lettered."""

    reason: str
    error: str
    traceback: str | None = None

    def __post_init__(self) -> None:
        # An error message may quote the payload's NUL bytes; PostgreSQL text refuses them.
        object.__setattr__(self, "error", message_mod.pg_text(self.error))
        if self.traceback is not None:
            object.__setattr__(self, "traceback", message_mod.pg_text(self.traceback))


class Transaction(Protocol):
    """One database transaction of the protocol: per message, or for a fetched batch.

    The batch path (:mod:`eop.protocol.batch`) claims the whole batch in one
    statement (:meth:`claim_many`), runs the handlers with their writes held
    back (``flush=False``, then :meth:`flush`) or each in a savepoint
    (:meth:`run_isolated`), drops the claims of the failed ones
    (:meth:`unclaim`) and commits the rest.
    """

    async def claim(self, message: Message, outcome: str) -> bool:
        """Insert the message's inbox row; False when it (or its msg-id) is taken."""

    async def claim_many(self, messages: list[Message], outcome: str) -> set[int]:
        """Claim a batch in one statement; the stream sequences of the rows inserted.

        Each row as :meth:`claim` would insert it, in order: a row whose key or
        msg-id is taken (committed, held by this transaction, or by an earlier
        row of the same batch), or which lies at or below the watermark, is
        skipped; one held by another open transaction makes the statement wait
        for it. The statement fails whole (a lock timeout, a refused value):
        then nothing of it is claimed, and the transaction is aborted.
        """

    async def unclaim(self, message: Message) -> None:
        """Drop this transaction's claim of ``message`` (its handler failed in a batch).

        Its key stays locked until the transaction ends: a concurrent claim
        of it keeps waiting, as on a row inserted and deleted by an open one.
        """

    async def find(self, message: Message) -> Existing | None:
        """What the inbox holds under the message's key, else under its msg-id."""

    async def add_dead_letter(self, message: Message, dead: DeadLetter) -> None:
        """Record a dead letter for the message."""

    async def count_failure(
        self, message: Message, error: str, *, parked: bool, due_in_s: float
    ) -> int:
        """Add one handler failure to the message's count, keeping the message; the new count.

        ``parked``: the retry is held in the database (run ``due_in_s`` from
        now by a worker's retry loop) rather than by a nak'ed redelivery.
        """

    async def forget_failures(self, message: Message) -> None:
        """Drop the message's failure count and parked copy (it has its outcome)."""

    async def reschedule(self, message: Message, due_in_s: float) -> None:
        """Run a parked message again ``due_in_s`` from now."""

    async def lock_run(self, message: Message, runs: int) -> bool:
        """Lock a parked message for the run that took it as run ``runs``; False if another
        run took it since, or it settled."""

    async def settle_retrying(self, message: Message, outcome: str) -> bool:
        """Give a retrying message its outcome; False when it is not retrying (any more)."""

    async def run(self, message: Message, *, flush: bool = True) -> None:
        """Run the handler inside this transaction.

        With ``flush=False`` the handler's queued writes and pending ORM objects
        stay queued, to be sent with the rest of a batch's by :meth:`flush`.
        """

    async def run_many(self, messages: list[Message], *, flush: bool = True) -> None:
        """Run a batch handler (:attr:`HandlerSpec.batch`) on ``messages`` in this transaction."""

    async def flush(self) -> None:
        """Send the handlers' queued writes, then their pending ORM objects."""

    async def run_isolated(self, messages: list[Message]) -> Exception | None:
        """Run the handler on ``messages`` (one, or a batch handler's list) in a savepoint.

        Its error, with its writes rolled back to the savepoint (the rest of the
        transaction kept), or None. Failures of the database
        (:data:`INFRASTRUCTURE`) are raised, not returned: they are no handler's
        failure, and the transaction is retried whole.
        """

    async def commit(self) -> None:
        """COMMIT; :class:`eop.AmbiguousCommit` when the connection drops during it."""

    async def rollback(self) -> None:
        """ROLLBACK (never raises: a broken connection has rolled back already)."""


class Store(Protocol):
    """Opens transactions for a handler and answers questions about the inbox."""

    def transaction(self, spec: HandlerSpec) -> contextlib.AbstractAsyncContextManager[Transaction]:
        """A transaction with eop's local timeouts set, closed on exit."""

    async def has_outcome(self, spec: HandlerSpec, message: Message) -> bool:
        """Whether this very message (key and fingerprint) has a committed outcome.

        Used after an ambiguous commit: an inbox row with its fingerprint, or
        its dead letter (a quarantined message has only the latter).
        """


class DbFailure(enum.Enum):
    """How the protocol reacts to a database error."""

    CONFLICT = "conflict"
    """40001 / 40P01: retry the whole transaction."""
    LOCK_TIMEOUT = "lock_timeout"
    """55P03: another delivery holds the key; nak with a delay."""
    CONNECTION = "connection"
    """The connection is gone: retry the transaction (or, during COMMIT, the outcome is unknown)."""
    BUSY = "busy"
    """The database cannot serve now (statement timeout, read-only, out of connections or
    resources, a pool with no free connection): retry the transaction later."""
    OTHER = "other"


#: Failures of the database, not of a handler: they never count as a message's attempt.
INFRASTRUCTURE = frozenset(
    {DbFailure.CONFLICT, DbFailure.LOCK_TIMEOUT, DbFailure.CONNECTION, DbFailure.BUSY}
)

_CONFLICT_STATES = {"40001", "40P01"}
# 57014: statement timeout (or a cancel request); 25006: read-only transaction (a
# standby, or default_transaction_read_only); class 53: insufficient resources
# (too many connections, disk full, out of memory); 55006: object in use.
_BUSY_STATES = {"57014", "25006", "55006"}
# 57P01-57P03: the server is shutting down or terminated the backend;
# class 08: connection exceptions.
_CONNECTION_STATES = {"57P01", "57P02", "57P03"}


def classify(exc: BaseException) -> DbFailure:
    """Classify a driver or SQLAlchemy error by what the protocol should do about it.

    A bare ``OSError`` counts as a lost connection only below a database
    error: a handler's own ``FileNotFoundError`` or an HTTP client's refused
    connection is the handler's failure, not the database's.
    """
    seen: set[int] = set()
    from_database = False
    any_state = False
    operational = False
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        operational = operational or type(current).__name__ == "OperationalError"
        if isinstance(current, errors.DatabaseUnavailable):
            return DbFailure.CONNECTION
        # Anything carrying a SQLSTATE is a database error, whatever raised it.
        state = _sqlstate(current)
        any_state = any_state or state is not None
        from_database = from_database or state is not None or _is_database_error(current)
        if isinstance(current, sa_exc.DBAPIError) and current.connection_invalidated:
            return DbFailure.CONNECTION
        if state in _CONFLICT_STATES:
            return DbFailure.CONFLICT
        if state == "55P03":
            return DbFailure.LOCK_TIMEOUT
        if state is not None and (state in _CONNECTION_STATES or state.startswith("08")):
            return DbFailure.CONNECTION
        if state is not None and (state in _BUSY_STATES or state.startswith("53")):
            return DbFailure.BUSY
        if isinstance(current, sa_exc.TimeoutError):
            # QueuePool's "QueuePool limit ... reached, connection timed out".
            return DbFailure.BUSY
        if from_database and isinstance(current, (OSError, sa_exc.DisconnectionError)):
            return DbFailure.CONNECTION
        if from_database and type(current).__name__ in _DRIVER_CONNECTION_ERRORS:
            return DbFailure.CONNECTION
        nxt = current.orig if isinstance(current, sa_exc.DBAPIError) else None
        current = nxt or current.__cause__ or current.__context__
    if from_database and operational and not any_state:
        # psycopg's "connection failed: ... Connection refused" carries no SQLSTATE:
        # an OperationalError without one is the connection's, not a statement's.
        return DbFailure.CONNECTION
    return DbFailure.OTHER


def transient(exc: BaseException, failures: frozenset[DbFailure] = INFRASTRUCTURE) -> bool:
    """Whether ``exc`` is a failure of the database after which the transaction is retried whole.

    Wherever it is raised, in eop's statements or in a handler's, such a
    failure is not the handler's: it never counts as an attempt. eop's own
    :class:`eop.errors.TransactionConflict` and :class:`eop.errors.DatabaseUnavailable`
    always are; its other errors never; anything else by its :func:`classify`
    kind, one of ``failures``.
    """
    if isinstance(exc, (errors.TransactionConflict, errors.DatabaseUnavailable)):
        return True
    if isinstance(exc, errors.EopError):
        return False
    return classify(exc) in failures


_DRIVER_CONNECTION_ERRORS = {"ConnectionDoesNotExistError", "InterfaceError"}

# SQLSTATE classes of a statement whose values PostgreSQL refuses: data
# exceptions (22: a value it cannot convert or accept), integrity constraints
# (23), program limits (54: e.g. an index row too large).
_REFUSED_CLASSES = ("22", "23", "54")


def refuses_values(exc: BaseException) -> bool:
    """Whether ``exc`` says the database (or its driver) refuses the statement's values.

    Unlike a conflict, a timeout or a lost connection, running the same
    statement with the same values again cannot succeed.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        state = _sqlstate(current)
        if (state is not None and state[:2] in _REFUSED_CLASSES) or isinstance(
            current, UnicodeError
        ):
            return True
        nxt = current.orig if isinstance(current, sa_exc.DBAPIError) else None
        current = nxt or current.__cause__ or current.__context__
    return False


def _is_database_error(exc: BaseException) -> bool:
    if isinstance(exc, sa_exc.SQLAlchemyError):
        return True
    module = type(exc).__module__.split(".")[0]
    return module in ("asyncpg", "psycopg", "psycopg2", "sqlalchemy")


def _sqlstate(exc: BaseException) -> str | None:
    for attr in ("sqlstate", "pgcode"):
        value = getattr(exc, attr, None)
        if isinstance(value, str):
            return value
    return None


class SqlTransaction(abc.ABC):
    """The protocol's statements over a SQLAlchemy session (async or sync)."""

    def __init__(self, tables: models.Tables, spec: HandlerSpec) -> None:
        self.tables = tables
        self.spec = spec
        self.committed = False
        self.writes: writes.Writes | None = None
        """The handler's write queue, when it takes one (:attr:`HandlerSpec.takes_writes`)."""

    @abc.abstractmethod
    async def _rows(self, stmt: sa.Executable) -> list[tuple[Any, ...]]: ...

    @abc.abstractmethod
    async def _execute(self, stmt: sa.Executable) -> None: ...

    async def select(self, stmt: sa.Executable) -> list[tuple[Any, ...]]:
        """The rows of one of eop's own statements (:mod:`eop.pg.sql`), run in this transaction."""
        return await self._rows(stmt)

    @abc.abstractmethod
    async def run(self, message: Message, *, flush: bool = True) -> None:
        """Run the handler inside this transaction.

        With ``flush=False`` the handler's queued writes (:class:`eop.Writes`)
        and pending ORM objects stay queued, to be sent with the rest of the
        batch's by :meth:`flush`.
        """

    @abc.abstractmethod
    async def flush(self) -> None:
        """Send the handlers' queued writes, then their pending ORM objects."""

    @abc.abstractmethod
    async def commit(self) -> None:
        """COMMIT; :class:`eop.AmbiguousCommit` when the connection drops during it."""

    @abc.abstractmethod
    async def rollback(self) -> None:
        """ROLLBACK (never raises)."""

    def _second_argument(self, session: Any) -> Any:
        """What the handler gets after the message: its write queue, or the session."""
        return self.writes if self.writes is not None else session

    async def claim(self, message: Message, outcome: str) -> bool:
        """Insert the inbox row; False when the key or the msg-id is taken, or below the
        watermark."""
        return bool(await self.claim_many([message], outcome))

    async def claim_many(self, messages: list[Message], outcome: str) -> set[int]:
        """Claim a batch in one statement; returns the claimed stream sequences.

        The messages of one batch share a subscription and a stream, so the
        sequence identifies each one.
        """
        rows = [self.claim_row(m, outcome) for m in messages]
        return {int(row[0]) for row in await self._rows(sql.claim(self.tables, rows))}

    def claim_row(self, m: Message, outcome: str) -> dict[str, Any]:
        """The inbox row that claims ``m`` with ``outcome``."""
        return {
            "subscription": m.subscription,
            "stream": m.stream,
            "stream_epoch": m.stream_epoch,
            "stream_seq": m.seq,
            "fingerprint": m.fingerprint,
            "msg_id": m.msg_id if self.spec.msg_id_guard else None,
            "subject": m.subject,
            "outcome": outcome,
            "delivery_count": m.num_delivered,
        }

    async def unclaim(self, message: Message) -> None:
        """Drop this transaction's claim of ``message`` (its handler failed in a batch)."""
        await self._rows(
            sql.unclaim(
                self.tables, message.subscription, message.stream, message.stream_epoch, message.seq
            )
        )

    @abc.abstractmethod
    async def run_many(self, messages: list[Message], *, flush: bool = True) -> None:
        """Run a batch handler on ``messages`` inside this transaction."""

    @abc.abstractmethod
    async def run_isolated(self, messages: list[Message]) -> Exception | None:
        """Run the handler on ``messages`` inside a savepoint; its error, rolled back, or None.

        Failures of the database (:data:`INFRASTRUCTURE`: conflicts, lock and
        statement timeouts, a lost connection) are raised, not returned: they
        are no handler's failure, and the transaction is retried whole.
        """

    async def find(self, message: Message) -> Existing | None:
        """What the inbox holds under the message's key, else under its msg-id."""
        rows = await self._rows(
            sql.find_by_key(
                self.tables,
                message.subscription,
                message.stream,
                message.stream_epoch,
                message.seq,
            )
        )
        if rows:
            return Existing(by="key", fingerprint=rows[0][0], outcome=rows[0][1])
        if message.msg_id is not None and self.spec.msg_id_guard:
            rows = await self._rows(
                sql.find_by_msg_id(self.tables, message.subscription, message.msg_id)
            )
            if rows:
                return Existing(by="msg_id", fingerprint=None, outcome=rows[0][3])
        rows = await self._rows(
            sql.watermark(self.tables, message.subscription, message.stream, message.stream_epoch)
        )
        if rows and message.seq <= rows[0][0]:
            # Compacted: its outcome committed before the consumer's ack floor passed it.
            return Existing(by="watermark", fingerprint=None, outcome=models.OUTCOME_PROCESSED)
        return None

    async def has_dead_letter(self, message: Message) -> bool:
        """Whether a dead letter for this message (key and fingerprint) is recorded."""
        stmt = sql.find_dead_letter(
            self.tables,
            message.subscription,
            message.stream,
            message.stream_epoch,
            message.seq,
            message.fingerprint,
        )
        return bool(await self._rows(stmt))

    async def count_failure(
        self, message: Message, error: str, *, parked: bool, due_in_s: float
    ) -> int:
        """Add one handler failure to the message's count, keeping the message; the new count."""
        row = {
            "subscription": message.subscription,
            "stream": message.stream,
            "stream_epoch": message.stream_epoch,
            "stream_seq": message.seq,
            "last_error": message_mod.pg_text(error),
            "parked": parked,
            "due_in_s": due_in_s,
            "subject": message.subject,
            # The handler needs the headers as they were (secrets included) on its
            # retry; JSON in bytea keeps any character, NUL too.
            "headers": json.dumps(dict(message.headers)).encode(),
            "payload": message.data,
            "stored_at": message.timestamp,
        }
        rows = await self._rows(sql.count_failure(self.tables, row))
        return int(rows[0][0])

    async def forget_failures(self, message: Message) -> None:
        """Drop the message's failure count and parked copy (it has its outcome)."""
        await self._execute(sql.forget_failures(self.tables, *_key(message)))

    async def reschedule(self, message: Message, due_in_s: float) -> None:
        """Run a parked message again ``due_in_s`` from now."""
        await self._execute(sql.reschedule(self.tables, *_key(message), due_in_s))

    async def lock_run(self, message: Message, runs: int) -> bool:
        """Lock a parked message for its run number ``runs``; False if another run took it."""
        return bool(await self._rows(sql.lock_run(self.tables, *_key(message), runs)))

    async def settle_retrying(self, message: Message, outcome: str) -> bool:
        """Give a retrying message its outcome; False when it is not retrying (any more)."""
        return bool(await self._rows(sql.settle_retrying(self.tables, *_key(message), outcome)))

    async def add_dead_letter(self, message: Message, dead: DeadLetter) -> None:
        """Record the dead letter: reason, error, headers without secrets, payload."""
        row = {
            "subscription": message.subscription,
            "stream": message.stream,
            "stream_epoch": message.stream_epoch,
            "stream_seq": message.seq,
            "fingerprint": message.fingerprint,
            "msg_id": message.msg_id,
            "subject": message.subject,
            "headers": json.loads(json.dumps(redaction.redact_headers(message.headers))),
            "payload": message.data,
            "reason": dead.reason,
            "error": dead.error,
            "traceback": dead.traceback,
            "delivery_count": message.num_delivered,
        }
        await self._rows(sql.insert_dead_letter(self.tables, row))


class AsyncTransaction(SqlTransaction):
    """A transaction on an ``AsyncSession``, for ``async def`` handlers."""

    def __init__(self, session: AsyncSession, tables: models.Tables, spec: HandlerSpec) -> None:
        super().__init__(tables, spec)
        self.session = session
        if spec.takes_writes:
            self.writes = writes.Writes(session)

    async def _rows(self, stmt: sa.Executable) -> list[tuple[Any, ...]]:
        result = await self.session.execute(stmt)
        return [tuple(row) for row in result]

    async def _execute(self, stmt: sa.Executable) -> None:
        await self.session.execute(stmt)

    async def claim_many(self, messages: list[Message], outcome: str) -> set[int]:
        """Claim a batch in one statement, sent on asyncpg's own connection when it is one.

        The transaction is already open on that connection (the local
        timeouts were set through the session), so the claim is part of it.
        """
        driver = await self._driver()
        if driver is None:
            return await super().claim_many(messages, outcome)
        guard = self.spec.msg_id_guard
        # One list per column, in the order of sql.CLAIM_COLUMNS (the values of claim_row).
        columns = (
            [m.subscription for m in messages],
            [m.stream for m in messages],
            [m.stream_epoch for m in messages],
            [m.seq for m in messages],
            [m.fingerprint for m in messages],
            [m.msg_id if guard else None for m in messages],
            [m.subject for m in messages],
            [outcome] * len(messages),
            [m.num_delivered for m in messages],
        )
        records = await driver.fetch(sql.claim_driver_text(self.tables.schema), *columns)
        return {int(record[0]) for record in records}

    async def _driver(self) -> Any:
        """The asyncpg connection under the session, or None for another driver."""
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
            await self.session.run_sync(self.writes.send)
        if self.session.new or self.session.dirty or self.session.deleted:
            await self.session.flush()

    async def run_isolated(self, messages: list[Message]) -> Exception | None:
        """Run the handler inside a savepoint; roll it back alone if it fails."""
        savepoint = await self.session.begin_nested()
        try:
            await self._call(messages)
            await savepoint.commit()
        except Exception as exc:
            if self.writes is not None:
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
        await _commit(self.session.commit)
        self.committed = True

    async def rollback(self) -> None:
        """ROLLBACK, ignoring a broken connection."""
        with contextlib.suppress(Exception):
            await self.session.rollback()


class SyncTransaction(SqlTransaction):
    """A transaction on a sync ``Session``; each step runs in a worker thread.

    Steps run one after another, never concurrently, so handing the session
    from thread to thread is safe. Where each step runs is :meth:`_step`'s
    choice: with ``threads`` (what :class:`PostgresStore` gives), in those
    threads under a permit held while the session holds a connection (see
    :mod:`eop.pg.threads`); without, in :func:`asyncio.to_thread`'s.
    """

    def __init__(
        self,
        session: Session,
        tables: models.Tables,
        spec: HandlerSpec,
        threads: SyncThreads | None = None,
    ) -> None:
        super().__init__(tables, spec)
        self.session = session
        if spec.takes_writes:
            self.writes = writes.Writes(session)
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
                self.session.close()
            threads.release()

        future.add_done_callback(lambda _: threads.later(close))

    def _release(self) -> None:
        """The session gave its connection back to the pool: give the permit back."""
        if self._threads is not None and self._permit and not self._abandoned:
            self._permit = False
            self._threads.release()

    async def _rows(self, stmt: sa.Executable) -> list[tuple[Any, ...]]:
        def execute() -> list[tuple[Any, ...]]:
            result = self.session.execute(stmt)
            return [tuple(row) for row in result]

        return await self._step(execute)

    async def _execute(self, stmt: sa.Executable) -> None:
        await self._step(self.session.execute, stmt)

    async def run(self, message: Message, *, flush: bool = True) -> None:
        """Call the handler in a worker thread, off the event loop, and flush its writes."""
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
        """Send queued writes, then flush pending ORM objects, in a worker thread."""
        await self._step(self._flush)

    def _flush(self) -> None:
        if self.writes is not None:
            self.writes.send(self.session)
        self.session.flush()

    async def run_isolated(self, messages: list[Message]) -> Exception | None:
        """Run the handler inside a savepoint in a worker thread; roll it back alone if it fails."""
        return await self._step(self._isolated, messages)

    def _isolated(self, messages: list[Message]) -> Exception | None:
        savepoint = self.session.begin_nested()
        try:
            self._call(messages)
            savepoint.commit()
        except Exception as exc:
            if self.writes is not None:
                self.writes.discard()
            if classify(exc) in INFRASTRUCTURE:
                raise
            savepoint.rollback()
            return exc
        return None

    async def commit(self) -> None:
        """COMMIT in a worker thread; a connection lost during it makes the outcome unknown."""
        if self.writes:
            await self.flush()  # never left behind, whoever ran the handler
        await _commit(functools.partial(self._step, self.session.commit))
        self.committed = True
        self._release()

    async def rollback(self) -> None:
        """ROLLBACK, ignoring a broken connection."""
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


def _key(message: Message) -> tuple[str, str, str, int]:
    return (message.subscription, message.stream, message.stream_epoch, message.seq)


async def _commit(commit: Any) -> None:
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


class PostgresStore:
    """The real :class:`Store`: eop's tables in the app's database.

    Sync transactions run in threads of the store's own (:mod:`eop.pg.threads`),
    as many as the app's sync pool hands out connections
    (:meth:`eop.App.sync_transactions`); :meth:`close` lets them go.
    """

    def __init__(self, app: Database) -> None:
        self.app = app
        self.tables = models.tables(app.settings.schema)
        s = app.settings
        self._timeouts = sql.set_local_timeouts(
            int(s.lock_timeout_s * 1000), int(s.statement_timeout_s * 1000)
        )
        self._threads: SyncThreads | None = None

    def transaction(self, spec: HandlerSpec) -> contextlib.AbstractAsyncContextManager[Transaction]:
        """Open a session, begin, set the local timeouts; close (and so roll back) on exit."""
        return self._open(spec)

    @contextlib.asynccontextmanager
    async def _open_async(self, spec: HandlerSpec) -> AsyncIterator[AsyncTransaction]:
        async with self.app.sessionmaker() as session:
            tx = AsyncTransaction(session, self.tables, spec)
            await _connected(tx.select(self._timeouts))
            yield tx

    @contextlib.asynccontextmanager
    async def _open(self, spec: HandlerSpec) -> AsyncIterator[SqlTransaction]:
        if spec.is_async:
            async with self._open_async(spec) as atx:
                yield atx
            return
        if self._threads is None:
            self._threads = SyncThreads(self.app.sync_transactions())
        # Making a session sends nothing: its first statement checks a
        # connection out, in a thread, under the permit.
        tx = SyncTransaction(self.app.sync_sessionmaker(), self.tables, spec, self._threads)
        try:
            await _connected(tx.select(self._timeouts))
            yield tx
        finally:
            await tx.close()

    def session(self) -> AsyncSession:
        """A plain async session for eop's own bookkeeping (compaction, status)."""
        return self.app.sessionmaker()

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


async def _connected(awaitable: Any) -> Any:
    """Await a step that opens a connection; translate 'cannot connect' at the edge."""
    try:
        return await awaitable
    except Exception as exc:
        if unreachable(exc):
            raise errors.DatabaseUnavailable(f"PostgreSQL is unreachable: {_short(exc)}") from exc
        raise


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc``, raised while opening or using a connection, means PostgreSQL is gone.

    Unlike :func:`classify`, a bare ``OSError`` counts too: at this edge (no
    handler code runs) it can only come from reaching the server.
    """
    return isinstance(exc, OSError) or classify(exc) is DbFailure.CONNECTION


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]
