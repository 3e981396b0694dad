"""The contract a store implements: what the protocol asks of the inbox's database.

:class:`Store` and :class:`Transaction` are the seam between the protocol
(:mod:`eop.protocol.processor`, and :mod:`eop.protocol.batch` for fetched
batches) and the database: a message is claimed, found, or dead-lettered
through them (the inbox's SQL is :mod:`eop.pg.sql.inbox`).
:class:`eop.pg.store.PostgresStore` is the real store (its transactions are
:mod:`eop.pg.transactions`), :class:`eop.testing.MemoryStore` a fake for unit
tests. Driver errors are classified at the edge by
:func:`eop.pg.failures.classify`; a claim raises its own in eop's terms
(:meth:`Transaction.claim`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Protocol

from eop import message as message_mod

if TYPE_CHECKING:
    from eop.handler import HandlerSpec
    from eop.message import Message


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

    async def take_turn(self) -> None:
        """Wait for this transaction's turn among the fleet's contended ones (every
        handler's, on eop's schema), held until it ends: after a deadlock, processes that
        each run one transaction at a time would still cross each other (the SQL:
        ``eop.pg.sql.turns``). Before the claim."""

    async def claim(self, message: Message, outcome: str) -> bool:
        """Insert the message's inbox row; False when it (or its msg-id) is taken.

        Raises :class:`eop.errors.ClaimTimeout` when another delivery of the
        message holds its key (or msg-id) past the lock timeout, and
        :class:`eop.errors.UnclaimableMessage` when the database refuses its
        row (a value it cannot store or index); other failures as the driver
        raised them (:func:`eop.pg.failures.translate_claim_errors`).
        """

    async def claim_many(self, messages: list[Message], outcome: str) -> set[int]:
        """Claim a batch in one statement; the stream sequences of the rows inserted.

        Each row as :meth:`claim` would insert it, in order: a row whose key or
        msg-id is taken (committed, held by this transaction, or by an earlier
        row of the same batch), or which lies at or below the watermark, is
        skipped; one held by another open transaction makes the statement wait
        for it. The statement fails whole (a lock timeout, a refused value,
        raised as the driver raised them, unlike :meth:`claim`'s): then nothing
        of it is claimed, and the transaction is aborted.
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

    async def count_run(self, message: Message) -> int:
        """Count a run of a redelivered message, before its handler starts (the caller
        commits it on its own); its runs without an outcome, 0 if it has its outcome."""

    async def count_first_run(self, message: Message) -> bool:
        """:meth:`count_run` when it is the message's first run without an outcome (no
        failure or run counted, no outcome); False, nothing written, otherwise."""

    async def forget_failures(self, message: Message) -> None:
        """Drop the message's failure count and parked copy (it has its outcome)."""

    async def forget_runs(self, message: Message) -> None:
        """Drop the message's run count (an ordered handler's failure count with it), found
        settled by a redelivery; a parked retry's row stays."""

    async def reschedule(self, message: Message, due_in_s: float) -> None:
        """Run a parked message again ``due_in_s`` from now."""

    async def lock_run(self, message: Message, runs: int) -> bool:
        """Lock a parked message for the run that took it as run ``runs``; False if another
        run took it since, or it settled."""

    async def settle_retrying(self, message: Message, outcome: str) -> bool:
        """Give a retrying message its outcome; False when it is not retrying (any more)."""

    async def lock_runs(self, messages: list[Message], runs: list[int]) -> set[int]:
        """:meth:`lock_run` for the parked messages of one poll (one subscription, stream and
        epoch; ``runs`` element by element) in one statement; the sequences locked."""

    async def count_parked_failures(
        self, messages: list[Message], errors: list[str], due_in_s: list[float]
    ) -> dict[int, int]:
        """Add one handler failure to each locked parked message (one subscription, stream
        and epoch), its next run ``due_in_s`` from now, in one statement; each one's new
        count by sequence."""

    async def settle_retrying_many(self, messages: list[Message], outcomes: list[str]) -> set[int]:
        """:meth:`settle_retrying` for many (one subscription, stream and epoch) in one
        statement; the sequences of those that were retrying."""

    async def forget_failures_many(self, messages: list[Message]) -> None:
        """:meth:`forget_failures` for many (one subscription, stream and epoch)."""

    async def add_dead_letters(self, messages: list[Message], dead: list[DeadLetter]) -> None:
        """:meth:`add_dead_letter` for each message and its dead letter, as one executemany."""

    async def run(self, message: Message, *, flush: bool = True) -> None:
        """Run the handler inside this transaction.

        With ``flush=False`` the handler's queued writes and pending ORM objects
        stay queued, to be sent with the rest of a batch's by :meth:`flush`;
        the call itself may wait for :meth:`flush` too (a sync transaction runs
        a batch's handlers in one thread hop), so the handler's error may come
        from either.
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
