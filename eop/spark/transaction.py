"""A partition's transaction: eop's inbox statements, run inline for sync handlers.

:class:`eop.inbox.SqlTransaction` subclasses for Spark tasks: the sync one
never hops to a thread (a task has no event loop to keep free), so its
coroutines never suspend and :func:`drive` runs them without a loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from eop import errors, inbox, models
from eop.handler import HandlerSpec
from eop.message import Message

T = TypeVar("T")


class SyncPartitionTx(inbox.SqlTransaction):
    """A partition's transaction on a sync ``Session``, every step inline.

    Unlike :class:`eop.inbox.SyncTransaction` no step hops to a thread: its
    coroutines never suspend, so :func:`drive` runs them without an event
    loop, and the handler runs as plain code in the Spark task's thread.
    """

    def __init__(self, session: Any, tables: models.Tables, spec: HandlerSpec) -> None:
        super().__init__(tables, spec)
        self.session = session

    async def _rows(self, stmt: Any) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in self.session.execute(stmt)]

    async def run(self, message: Message) -> None:
        """Call the handler and flush its writes, so that their errors are the handler's."""
        self._call([message])

    async def run_many(self, messages: list[Message]) -> None:
        """Call a batch handler with ``messages``."""
        self._call(messages)

    def _call(self, messages: list[Message]) -> None:
        arg, extra = self.spec.arguments(messages)
        func: Any = self.spec.func  # a sync handler, given the Session
        func(arg, self.session, **extra)
        self.session.flush()

    async def run_isolated(self, messages: list[Message]) -> Exception | None:
        """Run the handler inside a savepoint; roll it back alone if it fails."""
        savepoint = self.session.begin_nested()
        try:
            self._call(messages)
            savepoint.commit()
        except Exception as exc:
            if inbox.classify(exc) in (inbox.DbFailure.CONFLICT, inbox.DbFailure.CONNECTION):
                raise
            savepoint.rollback()
            return exc
        return None

    async def commit(self) -> None:
        """COMMIT; a lost connection makes the outcome unknown (:class:`eop.AmbiguousCommit`)."""
        try:
            self.session.commit()
        except Exception as exc:
            failure = inbox.classify(exc)
            # COMMIT runs no handler code: an OSError here is the database's socket.
            if failure is inbox.DbFailure.CONNECTION or isinstance(exc, OSError):
                raise errors.AmbiguousCommit() from exc
            if failure is inbox.DbFailure.CONFLICT:
                raise errors.TransactionConflict() from exc
            raise
        self.committed = True

    async def rollback(self) -> None:
        """ROLLBACK (never raises)."""
        with contextlib.suppress(Exception):
            self.session.rollback()


class AsyncPartitionTx(inbox.AsyncTransaction):
    """A partition's transaction on an ``AsyncSession``, for ``async def`` handlers."""


PartitionTx = SyncPartitionTx | AsyncPartitionTx


def transient(exc: BaseException) -> bool:
    """Errors after which the partition's whole transaction is retried in place."""
    if isinstance(exc, (errors.TransactionConflict, errors.DatabaseUnavailable)):
        return True
    if isinstance(exc, errors.EopError):
        return False
    return inbox.classify(exc) in (
        inbox.DbFailure.CONFLICT,
        inbox.DbFailure.CONNECTION,
        # Another transaction (a live worker, a speculative task) holds a claim.
        inbox.DbFailure.LOCK_TIMEOUT,
    )


def drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (the sync path) to its end, without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a step of a sync partition waited on an event loop")
