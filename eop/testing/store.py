"""An in-memory inbox with PostgreSQL's semantics, and knobs that make it fail.

:class:`MemoryStore` is the ``Store``: the state it shares with its transactions is
:class:`~eop.testing.inbox.MemoryInbox`'s, and each transaction a
:class:`~eop.testing.transaction.MemoryTransaction` (named here too).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from eop import errors
from eop.pg import models
from eop.testing.failures import Ambiguous, ErrorSpec, LockNotAvailable
from eop.testing.inbox import MemoryInbox
from eop.testing.rows import InboxRow, inbox_key
from eop.testing.transaction import MemoryTransaction as MemoryTransaction

if TYPE_CHECKING:
    from eop.handler import HandlerSpec
    from eop.message import Message


class MemoryStore(MemoryInbox):
    """An in-memory inbox implementing :class:`eop.pg.contract.Store` with PostgreSQL's semantics.

    - a claim inserts the inbox row unless its key, or (with the handler's
      ``msg_id_guard``) its ``Nats-Msg-Id``, is taken; a claim held by another
      open transaction makes it wait, up to ``lock_timeout_s`` (None: forever);
    - rows, dead letters and the handler's writes (:attr:`effects`) are
      visible to others after COMMIT only; a rollback discards them;
    - one dead letter per (key, fingerprint);
    - for the batch path, a claim of several rows is one statement (skipping
      taken keys and msg-ids, failing whole), a dropped claim keeps its key
      locked until the transaction ends, and a handler run in a savepoint
      (``run_isolated``) has its writes rolled back alone when it fails.

    Knobs inject the failures the protocol must survive: :meth:`fail_transactions`,
    :meth:`fail_claims`, :meth:`lock_timeout_claims`, :meth:`conflict_commits`,
    :meth:`fail_commits`, :meth:`ambiguous_commit`, :meth:`fail_has_outcome`,
    and :meth:`pause_commits` to hold COMMITs until :meth:`resume_commits`.

    What it holds (:attr:`inbox`, :attr:`effects`, :attr:`statements`...) is its
    :class:`~eop.testing.inbox.MemoryInbox`'s.
    """

    def __init__(self, *, lock_timeout_s: float | None = None) -> None:
        super().__init__(lock_timeout_s=lock_timeout_s)
        self.transactions = 0
        """Transactions opened."""

    # -- the Store protocol

    def transaction(
        self, spec: HandlerSpec
    ) -> contextlib.AbstractAsyncContextManager[MemoryTransaction]:
        """A transaction, rolled back on exit unless committed."""
        return self._transaction(spec)

    @contextlib.asynccontextmanager
    async def _transaction(self, spec: HandlerSpec) -> AsyncIterator[MemoryTransaction]:
        self._failures.raise_next("open")
        self.transactions += 1
        tx = MemoryTransaction(self, spec)
        try:
            yield tx
        finally:
            tx._close()

    async def has_outcome(self, spec: HandlerSpec, message: Message) -> bool:
        """Whether this very message (key and fingerprint) has a committed outcome."""
        self._failures.raise_next("has_outcome")
        row = self.inbox.get(inbox_key(message))
        if row is not None and row.fingerprint == message.fingerprint:
            return True
        return any(
            dead.unique_key == (*inbox_key(message), message.fingerprint)
            for dead in self.dead_letters
        )

    # -- reading

    def outcome_of(self, message: Message) -> str | None:
        """The committed outcome of ``message`` (by key), or None."""
        row = self.inbox.get(inbox_key(message))
        return None if row is None else row.outcome

    def record(
        self,
        message: Message,
        outcome: str = models.OUTCOME_PROCESSED,
        *,
        msg_id_guard: bool = True,
    ) -> InboxRow:
        """Commit an inbox row for ``message`` directly, as if an earlier delivery had."""
        msg_id = message.msg_id if msg_id_guard else None
        row = InboxRow.of(message, outcome, msg_id)
        self.inbox[row.key] = row
        if msg_id is not None:
            self._by_msg_id[(row.subscription, msg_id)] = row.key
        return row

    # -- failure knobs

    def fail_transactions(
        self, times: int = 1, error: ErrorSpec = errors.DatabaseUnavailable
    ) -> MemoryStore:
        """Make opening the next ``times`` transactions raise ``error``."""
        self._failures.add("open", times, error)
        return self

    def fail_claims(self, times: int = 1, error: ErrorSpec = LockNotAvailable) -> MemoryStore:
        """Make the next ``times`` claims raise ``error`` (default: a lock timeout)."""
        self._failures.add("claim", times, error)
        return self

    def lock_timeout_claims(self, times: int = 1) -> MemoryStore:
        """Make the next ``times`` claims time out on the row lock (sqlstate 55P03): a
        :meth:`MemoryTransaction.claim` raises :class:`eop.errors.ClaimTimeout` from it."""
        return self.fail_claims(times, LockNotAvailable)

    def conflict_commits(self, times: int = 1) -> MemoryStore:
        """Make the next ``times`` COMMITs fail with a serialization failure (rolled back)."""
        return self.fail_commits(times, errors.TransactionConflict)

    def fail_commits(
        self, times: int = 1, error: ErrorSpec = errors.TransactionConflict
    ) -> MemoryStore:
        """Make the next ``times`` COMMITs roll back and raise ``error``."""
        self._commit_failures.extend([error] * times)
        return self

    def ambiguous_commit(self, *, committed: bool) -> MemoryStore:
        """Make the next COMMIT raise :class:`eop.AmbiguousCommit`, having ``committed`` or not."""
        self._commit_failures.append(Ambiguous(committed=committed))
        return self

    def fail_has_outcome(
        self, times: int = 1, error: ErrorSpec = errors.DatabaseUnavailable
    ) -> MemoryStore:
        """Make the next ``times`` :meth:`has_outcome` calls raise ``error``."""
        self._failures.add("has_outcome", times, error)
        return self

    def pause_commits(self) -> MemoryStore:
        """Hold every COMMIT (setting :attr:`commit_started`) until :meth:`resume_commits`."""
        self._commit_gate = asyncio.Event()
        self.commit_started.clear()
        return self

    def resume_commits(self) -> None:
        """Let held and later COMMITs proceed."""
        if self._commit_gate is not None:
            self._commit_gate.set()
        self._commit_gate = None
