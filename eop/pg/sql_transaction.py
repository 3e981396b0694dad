"""What eop's two SQLAlchemy transactions share (:mod:`eop.pg.async_transaction`,
:mod:`eop.pg.sync_transaction`): the statements on a session, the handler's write queue,
the run outside a savepoint of a handler that sends nothing, the handler calls a batch
leaves to its flush, and COMMIT's errors translated.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from eop import errors, log, writes
from eop.outbox import table as outbox
from eop.outbox.outgoing import DEFAULT_MAX_PAYLOAD
from eop.pg import models, session_guard
from eop.pg.failures import INFRASTRUCTURE, DbFailure, classify
from eop.pg.statements import Statements

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

    from eop.handler import HandlerSpec
    from eop.message import Message
    from eop.pg.sql.base import LocalTimeouts


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
        # The handler's session cannot end this transaction: only eop does. An
        # AsyncSession ends its transaction through its sync face, so that is guarded.
        face: Any = session
        self._guarded: Session = getattr(face, "sync_session", face)
        session_guard.guard(self._guarded)
        info = session.info
        info[outbox.WRITES_KEY] = self.writes
        info[outbox.CONTEXT_KEY] = outbox_context or outbox.Context(tables, DEFAULT_MAX_PAYLOAD)
        self._deferred: list[Message] = []
        """Messages whose handler call :meth:`_defer` left to the next flush (or COMMIT)."""
        self._root: sa.engine.Transaction | None = None
        """The connection's transaction eop began (:meth:`begin`): still active after the
        handler unless it ended it past the session's guard (:meth:`_check_intact`)."""
        self._driver_handle: Any = None
        """The driver's connection :meth:`begin` ran on, when the subclass reads its own
        status (:meth:`_driver_in_transaction`), until the transaction ends."""

    def _driver_in_transaction(self, driver: Any) -> bool | None:
        """Whether ``driver`` (:attr:`_driver_handle`) says a transaction is open; None when it
        cannot say."""
        return None

    def _intact(self) -> bool:
        """Whether the transaction eop began is still the connection's, active."""
        root = self._root
        return root is not None and root.is_active and not root.connection.invalidated

    def _check_intact(self, messages: Sequence[Message]) -> None:
        """After the handler of ``messages``: when the transaction eop began has ended, log
        it (``transaction.ended_by_handler``) and raise
        :class:`eop.errors.TransactionEndedByHandler` (``ended``).

        The handler committed or rolled it back past the session's guard
        (:mod:`eop.pg.session_guard`): through its connection (``connection().commit()``,
        ``get_transaction().commit()``) or a ``COMMIT`` or ``ROLLBACK`` statement, which
        only the driver's own status shows (:meth:`_driver_in_transaction`). What it
        wrote before, and the claims, may be committed already: the handler fails, so
        that eop commits nothing more apart from them, and the log line says so even
        when the protocol then finds the messages settled. A ``COMMIT`` statement
        followed by more statements on psycopg, which begins a transaction again by
        itself, is not seen.
        """
        if self._queue_only():
            return  # nothing was sent: nothing to read
        root, driver = self._root, self._driver_handle
        ended = root is not None and not root.is_active and not root.connection.invalidated
        if ended or (driver is not None and self._driver_in_transaction(driver) is False):
            # Reported once: the next handlers of the transaction are not the ones at fault.
            self._root = self._driver_handle = None
            failed_flush = self._failed_flush() if ended else None
            self._log_ended(messages, failed_flush)
            if failed_flush is not None:
                raise _caught_flush(failed_flush, savepoint=False)
            raise errors.TransactionEndedByHandler(
                "the handler ended eop's transaction past the session it was given (a "
                "commit() or rollback() of its connection or transaction, or a COMMIT or "
                "ROLLBACK statement): what it wrote before may be committed with the "
                "message's claim; remove the call (flush() sends pending writes, "
                "begin_nested() makes a savepoint)",
                ended=True,
            )

    def _queue_only(self) -> bool:
        """Whether the handlers were given only the write queue and none asked for
        :attr:`Writes.session`: none sent a statement, so none can have ended the
        transaction, and eop's statements are the only ones on its connection."""
        return self.spec.takes_writes and not self.writes.session_used

    def _log_ended(self, messages: Sequence[Message], failed_flush: BaseException | None) -> None:
        """``transaction.ended_by_handler`` for the handler of ``messages``."""
        log_ended(self.spec.name, messages, failed_flush)

    def _savepoint_failure(
        self, exc: Exception, savepoint: Any, messages: Sequence[Message]
    ) -> Exception:
        """What a handler run in ``savepoint`` (:meth:`run_isolated`) failed with: ``exc``,
        unless the handler caught the error of a failed flush and went on. SQLAlchemy then
        refuses the savepoint's end (``PendingRollbackError``) with advice, a
        ``Session.rollback()``, that eop's session refuses: the error says what happened."""
        failure = _rolled_back_by(getattr(savepoint, "sync_transaction", savepoint))
        if not (isinstance(exc, sa.exc.PendingRollbackError) and failure is not None):
            return exc
        self._log_ended(messages, failure)
        return _caught_flush(failure, savepoint=True)

    def _failed_flush(self) -> BaseException | None:
        """The error of the flush whose failure rolled the session's transaction back, when
        that is how eop's transaction ended: SQLAlchemy rolls back the whole transaction
        (not only the flush) and keeps the error on it until the session rolls back,
        which only eop does."""
        return _rolled_back_by(self._guarded.get_transaction())

    def _defer(self, message: Message, flush: bool) -> bool:
        """Leave ``message``'s handler call to the next flush when ``flush`` is False (a
        batch's handlers, run one after another); whether it was left.

        A handler run in a thread is deferred so that the flush runs every waiting
        call in order in one thread hop: a hop a message cost more than the
        handler and its INSERT. Its error is then the flush's, as its writes' are.
        """
        if flush:
            return False
        self._deferred.append(message)
        return True

    def _take_deferred(self) -> list[Message]:
        """The calls left waiting, in order; none wait after (a ROLLBACK forgets them so)."""
        deferred, self._deferred = self._deferred, []
        return deferred

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
        return self._queue_only() and not self.writes and self.spec not in _SESSION_USERS

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

    async def begin(self, timeouts: LocalTimeouts) -> None:
        """BEGIN and set the transaction's local timeouts (any of ``timeouts``' forms): the
        transaction's first statement, or the first statement's part (the claim's)."""
        await self._rows(timeouts.statement)


def log_ended(
    handler: str, messages: Sequence[Message], failed_flush: BaseException | None = None
) -> None:
    """Log ``transaction.ended_by_handler``: ``handler``, run on ``messages``, ended eop's
    transaction (``failed_flush``: the error of the flush that rolled it back)."""
    log.get_logger(handler=handler).error(
        log.Event.TRANSACTION_ENDED_BY_HANDLER,
        stream=messages[0].stream if messages else None,
        first_seq=messages[0].seq if messages else None,
        last_seq=messages[-1].seq if messages else None,
        messages=len(messages),
        failed_flush=type(failed_flush).__name__ if failed_flush else None,
    )


def driver_in_transaction(driver: Any) -> bool | None:
    """Whether a psycopg connection says a transaction is open (False, IDLE, after a
    ``COMMIT`` or ``ROLLBACK`` statement); None for a driver that cannot say. Read in
    the thread that uses the connection."""
    status = getattr(getattr(driver, "info", None), "transaction_status", None)
    return None if status is None else getattr(status, "name", "") != "IDLE"


def _rolled_back_by(transaction: Any) -> BaseException | None:
    """The error a SQLAlchemy session transaction was rolled back for (a failed flush's),
    which it keeps until the session rolls back; None for any other state."""
    failure = getattr(transaction, "_rollback_exception", None)
    return failure if isinstance(failure, BaseException) else None


def _caught_flush(failure: BaseException, *, savepoint: bool) -> errors.TransactionEndedByHandler:
    """The error of a handler that caught a failed flush's ``failure`` and went on, the
    failure its cause (a dead letter's traceback shows it, its values masked)."""
    rolled_back = (
        "the savepoint eop ran the handler in"
        if savepoint
        else "eop's transaction, with the message's claim"
    )
    exc = errors.TransactionEndedByHandler(
        f"the handler caught the error of a flush that failed ({log.round_error(failure)}) "
        f"and went on, but SQLAlchemy had rolled back {rolled_back} with it: let the error "
        "propagate (the message is retried), or flush what may fail inside begin_nested(), "
        "whose savepoint rolls back alone",
        ended=not savepoint,
    )
    exc.__cause__ = failure
    return exc


_SESSION_USERS: weakref.WeakSet[HandlerSpec] = weakref.WeakSet()
"""``eop.Writes`` handlers seen asking for the session: they always run in a savepoint."""


class _SavepointNeeded(errors.DatabaseUnavailable):
    """An ``eop.Writes`` handler run outside a savepoint (it usually sends nothing) asked for
    the session: whatever it sent cannot be taken back alone, so the transaction is rolled
    back and run again, never counted (a failure of eop's, not the handler's), this time
    with the handler in a savepoint, as it will be from now on."""

    def __init__(self) -> None:
        # The default message would be this docstring, too long for a log line.
        super().__init__(
            "an eop.Writes handler asked for its session outside a savepoint: "
            "run again in one (not counted as a failure)"
        )


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
