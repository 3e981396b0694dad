"""The in-memory inbox's state: its committed rows and writes, the locks its open
transactions hold, and the failures it was told to inject.

:class:`~eop.testing.store.MemoryStore` is one (it adds the ``Store`` protocol and the
knobs); its :class:`~eop.testing.transaction.MemoryTransaction` waits on, reads and
commits into it. A lock is held by a transaction's end event: a claim that finds
another's waits for that event, and the transaction sets it once it commits or rolls back.
"""

from __future__ import annotations

import asyncio

from eop.outbox.outgoing import Outgoing
from eop.testing.failures import Ambiguous, ErrorSpec, Failures, LockNotAvailable
from eop.testing.rows import DeadLetterRow, InboxKey, InboxRow
from eop.testing.session import Statement


class MemoryInbox:
    """What an in-memory inbox holds: committed rows and effects, open claims, failures to come."""

    def __init__(self, *, lock_timeout_s: float | None = None) -> None:
        self.lock_timeout_s = lock_timeout_s
        self.inbox: dict[InboxKey, InboxRow] = {}
        """Committed inbox rows by key."""
        self.dead_letters: list[DeadLetterRow] = []
        """Committed dead letters, in commit order."""
        self.effects: list[object] = []
        """What handlers ``add()``-ed to their session, for committed transactions only."""
        self.outbox: list[Outgoing] = []
        """What handlers added to the outbox (``eop.outbox.add``), committed transactions only."""
        self.statements: list[Statement] = []
        """What ``eop.Writes`` handlers queued (statement, parameters), committed only."""
        self.attempts: dict[InboxKey, int] = {}
        """Committed handler failures per message key (dropped once it has its outcome)."""
        self.parked: set[InboxKey] = set()
        """Keys of messages whose retry is held in the store (acked, inbox row ``retrying``)."""
        self.runs: dict[InboxKey, int] = {}
        """Committed runs of redelivered messages per key (dropped with its failures)."""
        self.misuse: list[str] = []
        """Misuses a real database session would reject (e.g. closing it mid-COMMIT)."""
        self.commits = 0
        """Transactions committed (an ambiguous COMMIT that went through included)."""
        self.commit_started = asyncio.Event()
        """Set when a COMMIT starts while commits are paused."""
        self._by_msg_id: dict[tuple[str, str], InboxKey] = {}
        self._claims: dict[InboxKey, asyncio.Event] = {}
        """Keys claimed by open transactions, each to the end event of its holder."""
        self._msg_id_claims: dict[tuple[str, str], asyncio.Event] = {}
        self._turn: asyncio.Event | None = None
        """The end event of the open transaction holding the contended transactions' turn."""
        self._failures = Failures("open", "claim", "has_outcome")
        self._commit_failures: list[ErrorSpec | Ambiguous] = []
        self._commit_gate: asyncio.Event | None = None

    def _next_commit_failure(self) -> ErrorSpec | Ambiguous | None:
        return self._commit_failures.pop(0) if self._commit_failures else None

    async def _before_commit(self) -> None:
        gate = self._commit_gate
        if gate is not None:
            self.commit_started.set()
            await gate.wait()

    async def _wait_for_holders(
        self, ended: asyncio.Event, key: InboxKey, id_key: tuple[str, str] | None
    ) -> asyncio.Event | None:
        """Wait while another open transaction (not the one that ends with ``ended``) holds
        the key or msg-id; the end event of the holder left, if any."""
        while True:
            holder = self._claims.get(key)
            if holder is None and id_key is not None:
                holder = self._msg_id_claims.get(id_key)
            if holder is None or holder is ended:
                return holder
            try:
                await asyncio.wait_for(holder.wait(), self.lock_timeout_s)
            except asyncio.TimeoutError:
                raise LockNotAvailable() from None

    async def _take_turn(self, ended: asyncio.Event) -> None:
        """Wait for the contended transactions' turn, then hold it for the transaction that
        ends with ``ended``; as the advisory lock of the real store, bounded by the lock timeout."""
        while self._turn is not None and self._turn is not ended:
            try:
                await asyncio.wait_for(self._turn.wait(), self.lock_timeout_s)
            except asyncio.TimeoutError:
                raise LockNotAvailable() from None
        self._turn = ended

    def _committed(self, key: InboxKey, id_key: tuple[str, str] | None) -> bool:
        """Whether a committed inbox row has ``key`` or (the guard's) ``id_key``."""
        return key in self.inbox or (id_key is not None and id_key in self._by_msg_id)

    def _release(self, ended: asyncio.Event) -> None:
        """Drop the locks (and the turn) of the transaction that ends with ``ended``."""
        self._claims = {k: holder for k, holder in self._claims.items() if holder is not ended}
        self._msg_id_claims = {
            k: holder for k, holder in self._msg_id_claims.items() if holder is not ended
        }
        if self._turn is ended:
            self._turn = None
