"""Handler transactions on Django's connection: the claim, the ORM's writes and COMMIT in one.

Django keeps one connection per thread. So each transaction takes a *lane*,
a thread of its own holding one Django connection, for its whole life: every
step (the claim, the handler, eop's bookkeeping, COMMIT) runs there, inside
one ``transaction.atomic()`` block, eop's statements (:mod:`eop.pg.sql`)
through a cursor of Django's connection. A sync handler is called in the lane; an async one
through ``async_to_sync`` from the lane, so that the ORM's async methods
(``sync_to_async`` with ``thread_sensitive=True``) run back in the lane, on
its connection, in its transaction.

The lanes bound the transactions: as many as the app's share of
``db_connections`` for threads (:meth:`eop.App.connection_shares`), each
holding its connection between messages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
import sqlalchemy as sa

from eop import errors, log, redaction
from eop.pg import failures, statements, transactions
from eop.pg.sql import base as base_sql
from eop.pg.store import Database, PostgresStore

if TYPE_CHECKING:
    from eop.handler import HandlerSpec
    from eop.message import Message
    from eop.pg.contract import Transaction

T = TypeVar("T")

# PostgreSQL's type oids of json and jsonb.
_JSON_OIDS = (114, 3802)


class Lane:
    """One thread and the Django connection it holds; one transaction's at a time."""

    def __init__(self, index: int) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"eop-django-{index}"
        )
        self.busy = False

    def submit(self, func: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``func(*args)`` in the lane's thread, in a copy of the caller's context
        (the message's log fields and tracing span)."""
        context = contextvars.copy_context()
        return self._executor.submit(self._run, context, func, *args)

    def _run(self, context: contextvars.Context, func: Callable[..., T], *args: Any) -> T:
        self.busy = True
        try:
            return context.run(func, *args)
        finally:
            self.busy = False

    def close(self, alias: str) -> None:
        """Close the lane's Django connection (once its step ends) and let the thread go."""
        with contextlib.suppress(RuntimeError):
            self._executor.submit(_close_connection, alias)
        self._executor.shutdown(wait=False)


def _close_connection(alias: str) -> None:
    from django.db import connections

    with contextlib.suppress(Exception):
        connections[alias].close()


class Lanes:
    """The lanes of a store, handed out whole and given back from any thread."""

    def __init__(self, size: int) -> None:
        self.all = [Lane(i) for i in range(size)]
        self._free: asyncio.Queue[Lane] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def take(self) -> Lane:
        """A free lane: wait until a transaction gives one back."""
        if self._free is None:
            self._loop = asyncio.get_running_loop()
            self._free = asyncio.Queue()
            for lane in self.all:
                self._free.put_nowait(lane)
        return await self._free.get()

    def give_back(self, lane: Lane) -> None:
        """Return ``lane``, from the event loop or from a lane's thread."""
        free, loop = self._free, self._loop
        assert free is not None
        assert loop is not None
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            free.put_nowait(lane)
            return
        # A closed loop has nobody waiting for the lane any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(free.put_nowait, lane)

    @property
    def busy(self) -> int:
        """Lanes running a step right now."""
        return sum(lane.busy for lane in self.all)


class DjangoStore(PostgresStore):
    """A :class:`PostgresStore` whose handler transactions run on Django's connection.

    eop's own bookkeeping (compaction, the retry loop's reads, the check after
    an ambiguous COMMIT) stays on the app's async engine, at the same database.
    """

    def __init__(self, app: Database, alias: str) -> None:
        """The store of ``app``: its handlers' transactions on the connection of
        ``DATABASES[alias]``, as many at once as the app's share for threads."""
        super().__init__(app)
        self.alias = alias
        _check_same_database(app.settings.database_url, alias)
        self._lanes = Lanes(app.sync_transactions())

    def transaction(self, spec: HandlerSpec) -> contextlib.AbstractAsyncContextManager[Transaction]:
        """Take a lane, begin ``transaction.atomic()`` there, set the local timeouts."""
        return self._open_django(spec)

    @contextlib.asynccontextmanager
    async def _open_django(self, spec: HandlerSpec) -> AsyncIterator[DjangoTransaction]:
        lane = await self._lanes.take()
        tx = DjangoTransaction(self, spec, lane)
        try:
            await failures.connected(tx.begin())
            yield tx
        finally:
            await tx.close()

    @property
    def abandoned_threads(self) -> int:
        """Lanes still running a step after :meth:`close` (a handler that did not return)."""
        return self._lanes.busy

    def close(self) -> None:
        """Take no more steps; close each lane's connection once its step ends."""
        for lane in self._lanes.all:
            lane.close(self.alias)


def _check_same_database(url: str, alias: str) -> None:
    """eop's engines must reach the database the lanes write to: the claim on one and the
    bookkeeping (compaction, parked retries, the check after an ambiguous COMMIT) on
    another would each see half of the inbox."""
    from django.db import connections

    from eop.contrib.django import conf

    def where(u: sa.URL) -> tuple[object, ...]:
        return (u.host or u.query.get("host"), u.port or 5432, u.database, u.username)

    django_url = conf.database_url(connections.databases[alias])
    if where(sa.make_url(url)) != where(django_url):
        raise errors.ConfigurationError(
            f"eop's database_url ({redaction.redact_url(url)}) is not DATABASES[{alias!r}] "
            f"({redaction.redact_url(django_url.render_as_string(hide_password=False))}): "
            "with Django, leave database_url unset (no EOP_DATABASE_URL, no --database-url)"
        )


class _RollingBack(Exception):
    """Handed to ``Atomic.__exit__`` to make it roll back."""


class DjangoTransaction(statements.Statements):
    """One handler transaction in one lane, inside ``transaction.atomic(using=alias)``.

    Steps run one after another in the lane's thread. A step cancelled while
    it runs (a stop past its grace) keeps the lane until it returns; then the
    transaction is rolled back there and the lane given back.
    """

    def __init__(self, store: DjangoStore, spec: HandlerSpec, lane: Lane) -> None:
        super().__init__(store.tables, spec)
        self.alias = store.alias
        self._store = store
        self._lane = lane
        self._atomic: Any = None
        self._done = False

    async def _step(self, func: Callable[..., T], *args: Any) -> T:
        if self._done:
            raise RuntimeError("this transaction has given its lane back")
        future = self._lane.submit(func, *args)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.done():
                self._abandon(future)
            raise

    def _abandon(self, future: concurrent.futures.Future[Any]) -> None:
        """The cancelled step still runs: roll back after it, in the lane, then free it."""
        self._done = True
        lane, lanes = self._lane, self._store._lanes

        def finish(_: object) -> None:
            # The thread that ran the step: the next submitted job runs after it.
            with contextlib.suppress(RuntimeError):
                lane.submit(self._end).add_done_callback(lambda _: lanes.give_back(lane))

        future.add_done_callback(finish)

    # -- in the lane's thread

    def _connection(self) -> Any:
        from django.db import connections

        return connections[self.alias]

    def _begin(self) -> None:
        from django.db import transaction

        connection = self._connection()
        if connection.settings_dict.get("CONN_MAX_AGE") == 0:
            # Django's default closes the connection after each request; a lane keeps
            # its connection for the next message instead (errors still drop it).
            connection.close_at = None
        # What Django does between requests: drop a connection that failed or aged out.
        connection.close_if_unusable_or_obsolete()
        atomic = transaction.atomic(using=self.alias)
        atomic.__enter__()  # connects (a failure leaves no block to leave)
        self._atomic = atomic
        s = self._store.app.settings
        self._run_sql(
            base_sql.set_local_timeouts(
                int(s.lock_timeout_s * 1000), int(s.statement_timeout_s * 1000)
            )
        )

    def _run_sql(
        self, stmt: sa.Executable, bound: dict[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        text, params = base_sql.for_psycopg(stmt, bound)
        connection = self._connection()
        connection.ensure_connection()
        # Django's own cursors bind client-side unless OPTIONS says otherwise: a batch's
        # claim (nine arrays) would be quoted into its text and planned anew each
        # time. A plain psycopg cursor on Django's connection binds
        # server-side (and prepares, as the connection's prepare_threshold allows); the
        # wrapper keeps Django's error translation and its errors_occurred flag.
        with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
            cursor.execute(text, params)
            if not cursor.description:
                return []
            # Django has psycopg load json and jsonb as text (its JSONField decodes
            # them itself): decode them as a SQLAlchemy session would have.
            decoded = [i for i, c in enumerate(cursor.description) if c.type_code in _JSON_OIDS]
            rows = [list(row) for row in cursor.fetchall()]
        for row in rows:
            for i in decoded:
                if isinstance(row[i], str):
                    row[i] = json.loads(row[i])
        return [tuple(row) for row in rows]

    def _call(self, messages: list[Message]) -> None:
        from asgiref.sync import async_to_sync

        arg, extra = self.spec.arguments(messages)
        connection = self._connection()
        func: Any = self.spec.func  # the handler, given the message and Django's connection
        if self.spec.is_async:
            async_to_sync(func)(arg, connection, **extra)
        else:
            func(arg, connection, **extra)
        self._check_intact(messages)
        self._check_usable()

    def _check_intact(self, messages: list[Message]) -> None:
        """After the handler of ``messages``: when the server no longer holds eop's
        transaction, log it (``transaction.ended_by_handler``) and fail the handler with
        :class:`eop.errors.TransactionEndedByHandler` (``ended``).

        Django refuses ``connection.commit()`` and ``rollback()`` inside eop's
        ``atomic()`` block, but not a ``COMMIT`` or ``ROLLBACK`` statement on a
        cursor, which only psycopg's status shows: what the handler wrote before,
        and the claims, may be committed already. As on a SQLAlchemy session, a
        ``COMMIT`` statement followed by more statements is not seen (psycopg
        begins a transaction again by itself).
        """
        if transactions.driver_in_transaction(self._connection().connection) is not False:
            return
        transactions.log_ended(self.spec.name, messages)
        raise errors.TransactionEndedByHandler(
            "the handler ended eop's transaction past Django's atomic() block (a COMMIT "
            "or ROLLBACK statement on its cursor): what it wrote before may be committed "
            "with the message's claim; remove the statement (transaction.atomic() inside "
            "the handler makes a savepoint)",
            ended=True,
        )

    def _check_usable(self) -> None:
        if self._connection().needs_rollback:
            # Atomic.__exit__ would roll back quietly where eop expects a COMMIT (or a
            # savepoint's release): the claim would commit without the handler's writes.
            raise errors.TransactionAborted()

    def _isolated(self, messages: list[Message]) -> Exception | None:
        from django.db import transaction

        try:
            with transaction.atomic(using=self.alias):  # a savepoint
                self._call(messages)
        except Exception as exc:
            if failures.classify(exc) in failures.INFRASTRUCTURE:
                raise
            return exc
        return None

    def _commit(self) -> None:
        self._check_usable()
        atomic, self._atomic = self._atomic, None
        try:
            atomic.__exit__(None, None, None)
        except Exception as exc:
            connection = self._connection()
            # Django sets this flag once COMMIT went through, and clears it after the
            # transaction.on_commit() callbacks ran: still set, one of them raised.
            if not (connection.autocommit and connection.run_commit_hooks_on_set_autocommit_on):
                raise
            connection.run_commit_hooks_on_set_autocommit_on = False
            # The messages' effects are committed: they are acked as processed. Counted as
            # a failure, the retry found them done and the callback's error went unseen.
            log.get_logger(handler=self.spec.name).error(
                log.Event.ON_COMMIT_FAILED,
                error=log.bounded_error(exc),
                traceback=log.format_traceback(exc),
            )

    def _end(self) -> None:
        """Roll back what is open; Django closes a connection that cannot."""
        atomic, self._atomic = self._atomic, None
        if atomic is not None:
            with contextlib.suppress(Exception):
                atomic.__exit__(_RollingBack, _RollingBack(), None)

    # -- the Transaction protocol

    async def begin(self) -> None:
        """Enter ``transaction.atomic()`` in the lane and set eop's local timeouts."""
        await self._step(self._begin)

    async def _rows(
        self, stmt: sa.Executable, params: dict[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        return await self._step(self._run_sql, stmt, params)

    async def _execute(self, stmt: sa.Executable, params: dict[str, Any] | None = None) -> None:
        await self._step(self._run_sql, stmt, params)

    async def run(self, message: Message, *, flush: bool = True) -> None:
        """Call the handler in the lane (an async one through ``async_to_sync``)."""
        await self._step(self._call, [message])

    async def run_many(self, messages: list[Message], *, flush: bool = True) -> None:
        """Call a batch handler in the lane with the messages of a batch."""
        await self._step(self._call, messages)

    async def flush(self) -> None:
        """Nothing is held back: the ORM writes as the handler calls it."""

    async def run_isolated(self, messages: list[Message]) -> Exception | None:
        """Run the handler inside a nested ``transaction.atomic()`` (a savepoint)."""
        return await self._step(self._isolated, messages)

    async def commit(self) -> None:
        """Leave the ``atomic()`` block: COMMIT; a connection lost during it is ambiguous."""
        await transactions.translate_commit(lambda: self._step(self._commit))
        self.committed = True

    async def rollback(self) -> None:
        """Roll back (never raises: Django closes a connection that cannot)."""
        with contextlib.suppress(Exception):
            await self._step(self._end)

    async def close(self) -> None:
        """Roll back what is still open and give the lane back."""
        if self._done:
            return
        await self.rollback()
        if not self._done:
            self._done = True
            self._store._lanes.give_back(self._lane)
