"""One transaction of the in-memory inbox: an :class:`eop.pg.contract.Transaction` whose
claims wait on, and whose COMMIT lands in, its store's :class:`~eop.testing.inbox.MemoryInbox`
(:class:`~eop.testing.store.MemoryStore` opens it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from typing import TYPE_CHECKING, Any

from eop import errors
from eop.pg import models
from eop.pg.contract import DeadLetter, Existing
from eop.pg.failures import INFRASTRUCTURE, classify, translate_claim_errors
from eop.testing.failures import Ambiguous, instantiate
from eop.testing.inbox import MemoryInbox
from eop.testing.rows import DeadLetterRow, InboxKey, InboxRow, inbox_key
from eop.testing.session import FakeSession, FakeWrites

if TYPE_CHECKING:
    from eop.handler import HandlerSpec
    from eop.message import Message


class MemoryTransaction:
    """One transaction of a :class:`~eop.testing.store.MemoryStore`: an
    :class:`eop.pg.contract.Transaction`."""

    def __init__(self, store: MemoryInbox, spec: HandlerSpec) -> None:
        self.store = store
        self.spec = spec
        self.session = FakeSession()
        """The session handed to the handler."""
        self.committed = False
        self._rows: list[InboxRow] = []
        self._dead_letters: list[DeadLetterRow] = []
        self._ended = asyncio.Event()
        self._committing = False
        self._counts: dict[InboxKey, tuple[int, bool]] = {}
        self._runs: dict[InboxKey, int] = {}
        self._forgotten: set[InboxKey] = set()
        self._runs_forgotten: set[InboxKey] = set()
        self._settled: dict[InboxKey, str] = {}

    @property
    def ended(self) -> bool:
        """Committed or rolled back."""
        return self._ended.is_set()

    async def take_turn(self) -> None:
        """Wait for the turn of the store's contended transactions (every handler's), held
        until this one ends, as the real store's advisory lock is; a wait past the store's
        ``lock_timeout_s`` raises ``LockNotAvailable``, which eop retries."""
        self._check_open()
        await self.store._take_turn(self._ended)

    async def claim(self, message: Message, outcome: str) -> bool:
        """Insert the inbox row unless its key (or, with the msg-id guard, msg-id) is taken.

        Like ``INSERT ... ON CONFLICT DO NOTHING`` under READ COMMITTED, a key
        held by another open transaction makes this wait for it to end; the
        store's ``lock_timeout_s`` bounds that wait. Its failures are translated
        as the real store's are (:func:`eop.pg.failures.translate_claim_errors`):
        a lock timeout (:class:`LockNotAvailable`) is :class:`eop.errors.ClaimTimeout`,
        a refused row (an error of :meth:`MemoryStore.fail_claims`)
        :class:`eop.errors.UnclaimableMessage`.
        """
        return bool(await translate_claim_errors(self.claim_many([message], outcome)))

    async def claim_many(self, messages: list[Message], outcome: str) -> set[int]:
        """Claim a batch as one ``INSERT ... ON CONFLICT DO NOTHING`` would; the sequences claimed.

        The rows go in in order, each as :meth:`claim`'s: one whose key or
        msg-id is taken (by a committed row, by this transaction, or by an
        earlier row of the batch) is skipped; one held by another open
        transaction makes the statement wait for it. A claim that fails (a lock
        timeout, :meth:`MemoryStore.fail_claims`) fails whole, as a statement
        does in PostgreSQL: none of its rows stay (the keys it reached stay
        locked until the transaction ends). Unlike PostgreSQL, the fake does not
        abort the transaction: later statements still run.
        """
        self._check_open()
        rows_before = len(self._rows)
        claimed: set[int] = set()
        try:
            self.store._failures.raise_next("claim")
            for message in messages:
                key = inbox_key(message)
                msg_id = message.msg_id if self.spec.msg_id_guard else None
                id_key = None if msg_id is None else (message.subscription, msg_id)
                await self.store._wait_for_holders(self._ended, key, id_key)
                if self._holds(key, id_key) or self.store._committed(key, id_key):
                    continue
                self._rows.append(InboxRow.of(message, outcome, msg_id))
                self.store._claims[key] = self._ended
                if id_key is not None:
                    self.store._msg_id_claims[id_key] = self._ended
                claimed.add(message.seq)
        except BaseException:
            del self._rows[rows_before:]
            raise
        return claimed

    async def unclaim(self, message: Message) -> None:
        """Drop this transaction's inbox row of ``message``, as ``DELETE`` of it would.

        The key (and msg-id) stays locked until this transaction ends: a
        concurrent claim keeps waiting, as on a row PostgreSQL saw inserted
        and deleted by a transaction still open.
        """
        self._check_open()
        key = inbox_key(message)
        self._rows = [row for row in self._rows if row.key != key]

    def _holds(self, key: InboxKey, id_key: tuple[str, str] | None) -> bool:
        """Whether a row of this transaction has ``key`` or (the guard's) ``id_key``."""
        return any(
            row.key == key or (id_key is not None and (row.subscription, row.msg_id) == id_key)
            for row in self._rows
        )

    async def find(self, message: Message) -> Existing | None:
        """What the inbox holds (committed, or claimed by this transaction) for the message."""
        self._check_open()
        key = inbox_key(message)
        visible = {row.key: row for row in self._rows}
        visible.update(self.store.inbox)
        row = visible.get(key)
        if row is not None:
            return Existing(by="key", fingerprint=row.fingerprint, outcome=row.outcome)
        if message.msg_id is not None and self.spec.msg_id_guard:
            id_key = (message.subscription, message.msg_id)
            by_id = {(r.subscription, r.msg_id): r for r in self._rows if r.msg_id is not None}
            found = by_id.get(id_key)
            if found is None and id_key in self.store._by_msg_id:
                found = self.store.inbox[self.store._by_msg_id[id_key]]
            if found is not None:
                return Existing(by="msg_id", fingerprint=None, outcome=found.outcome)
        return None

    async def add_dead_letter(self, message: Message, dead: DeadLetter) -> None:
        """Record a dead letter; one for the same key and fingerprint is dropped."""
        self._check_open()
        self._dead_letters.append(DeadLetterRow.of(message, dead))

    async def count_failure(
        self, message: Message, error: str, *, parked: bool, due_in_s: float
    ) -> int:
        """Count one more handler failure of ``message`` (visible to others after COMMIT)."""
        self._check_open()
        key = inbox_key(message)
        if key in self._counts:
            before = self._counts[key][0]
        else:
            before = 0 if key in self._forgotten else self.store.attempts.get(key, 0)
        self._counts[key] = (before + 1, parked)
        self._forgotten.discard(key)
        return before + 1

    async def count_run(self, message: Message) -> int:
        """Count a run of the redelivered ``message`` (at COMMIT); its runs less failures,
        0 when its inbox row is committed."""
        self._check_open()
        key = inbox_key(message)
        if key in self.store.inbox:
            return 0
        runs = self._runs.get(key, self.store.runs.get(key, 0)) + 1
        self._runs[key] = runs
        return runs - self.store.attempts.get(key, 0)

    async def count_first_run(self, message: Message) -> bool:
        """:meth:`count_run` only when ``message`` has no run or failure counted and no
        inbox row; False otherwise."""
        self._check_open()
        key = inbox_key(message)
        counted = self._runs.get(key, self.store.runs.get(key, 0))
        if key in self.store.inbox or counted or self.store.attempts.get(key, 0):
            return False
        self._runs[key] = 1
        return True

    async def forget_failures(self, message: Message) -> None:
        """Drop the failure count of ``message`` at COMMIT."""
        self._check_open()
        key = inbox_key(message)
        self._counts.pop(key, None)
        self._forgotten.add(key)

    async def forget_runs(self, message: Message) -> None:
        """Drop the run and failure counts of ``message`` at COMMIT, unless it is parked."""
        self._check_open()
        self._runs_forgotten.add(inbox_key(message))

    async def reschedule(self, message: Message, due_in_s: float) -> None:
        """Nothing to keep: the fake store runs no retry loop of its own."""
        self._check_open()

    async def lock_run(self, message: Message, runs: int) -> bool:
        """Whether ``message`` is still parked (the fake keeps no run leases)."""
        self._check_open()
        return inbox_key(message) in self.store.parked

    async def settle_retrying(self, message: Message, outcome: str) -> bool:
        """Give a retrying inbox row ``outcome`` at COMMIT; False when it is not retrying."""
        self._check_open()
        key = inbox_key(message)
        row = self.store.inbox.get(key)
        if row is None or self._settled.get(key, row.outcome) != models.OUTCOME_RETRYING:
            return False
        self._settled[key] = outcome
        return True

    async def lock_runs(self, messages: list[Message], runs: list[int]) -> set[int]:
        """The sequences of ``messages`` still parked (the fake keeps no run leases)."""
        self._check_open()
        return {m.seq for m in messages if inbox_key(m) in self.store.parked}

    async def count_parked_failures(
        self, messages: list[Message], errors: list[str], due_in_s: list[float]
    ) -> dict[int, int]:
        """:meth:`count_failure` of each parked message; the new counts by sequence."""
        counts = {}
        for message, error, due in zip(messages, errors, due_in_s, strict=True):
            counts[message.seq] = await self.count_failure(
                message, error, parked=True, due_in_s=due
            )
        return counts

    async def settle_retrying_many(self, messages: list[Message], outcomes: list[str]) -> set[int]:
        """:meth:`settle_retrying` of each; the sequences of those that were retrying."""
        return {
            m.seq
            for m, outcome in zip(messages, outcomes, strict=True)
            if await self.settle_retrying(m, outcome)
        }

    async def forget_failures_many(self, messages: list[Message]) -> None:
        """:meth:`forget_failures` of each."""
        for message in messages:
            await self.forget_failures(message)

    async def add_dead_letters(self, messages: list[Message], dead: list[DeadLetter]) -> None:
        """:meth:`add_dead_letter` of each."""
        for message, letter in zip(messages, dead, strict=True):
            await self.add_dead_letter(message, letter)

    async def run(self, message: Message, *, flush: bool = True) -> None:
        """Call ``spec.func(message, session)``, awaiting it when it returns an awaitable.

        A plain ``def`` handler runs in a thread, as the real store runs it:
        what it may not do on the event loop (``asyncio.run``, a blocking
        client that checks) behaves as in production. ``flush=False`` is
        accepted for the batch path; the fake session sends nothing before
        COMMIT either way.
        """
        await self.run_many([message], flush=flush)

    async def run_many(self, messages: list[Message], *, flush: bool = True) -> None:
        """Call a batch handler (``spec.batch``) with ``messages``, as :meth:`run` does one."""
        self._check_open()
        arg, extra = self.spec.arguments(messages)
        func: Any = self.spec.func  # given a fake session
        second = FakeWrites(self.session) if self.spec.takes_writes else self.session
        if self.spec.is_async:
            result = func(arg, second, **extra)
        else:
            result = await asyncio.to_thread(func, arg, second, **extra)
        if inspect.isawaitable(result):
            await result
        if flush:
            await self.flush()

    async def flush(self) -> None:
        """Nothing to send: the fake session keeps what the handlers added until COMMIT.

        Not counted in :attr:`FakeSession.flushes`, which counts the handler's own.
        """
        self._check_open()

    async def run_isolated(self, messages: list[Message]) -> Exception | None:
        """Run the handler on ``messages`` as inside a savepoint; its error, or None.

        A handler error rolls back what the handler added (the rest of the
        transaction stays) and is returned; a failure of the database
        (:data:`eop.pg.failures.INFRASTRUCTURE`) is raised, as the real
        transactions do.
        """
        self._check_open()
        savepoint = len(self.session.added)
        sent = len(self.session.outbox)
        queued = len(self.session.statements)
        try:
            await self.run_many(messages)
        except Exception as exc:
            if classify(exc) in INFRASTRUCTURE:
                raise
            del self.session.added[savepoint:]
            del self.session.outbox[sent:]
            del self.session.statements[queued:]
            return exc
        return None

    async def commit(self) -> None:
        """COMMIT, unless the store was told to fail it (see :class:`MemoryStore`)."""
        self._check_open()
        self._committing = True
        try:
            await self.store._before_commit()
            failure = self.store._next_commit_failure()
            if isinstance(failure, Ambiguous):
                if failure.committed:
                    self._apply()
                else:
                    self._end()
                raise errors.AmbiguousCommit()
            if failure is not None:
                self._end()
                raise instantiate(failure)
            self._apply()
        finally:
            self._committing = False

    async def rollback(self) -> None:
        """ROLLBACK: discard the claim, the dead letters and the handler's writes."""
        self._end()

    def _check_open(self) -> None:
        if self.ended:
            raise RuntimeError("this MemoryTransaction has already committed or rolled back")

    def _apply(self) -> None:
        store = self.store
        for row in self._rows:
            store.inbox[row.key] = row
            if row.msg_id is not None:
                store._by_msg_id[(row.subscription, row.msg_id)] = row.key
        known = {dead.unique_key for dead in store.dead_letters}
        for dead in self._dead_letters:
            if dead.unique_key not in known:
                known.add(dead.unique_key)
                store.dead_letters.append(dead)
        for key, outcome in self._settled.items():
            store.inbox[key] = dataclasses.replace(store.inbox[key], outcome=outcome)
        store.runs.update(self._runs)
        for key in self._forgotten:
            store.attempts.pop(key, None)
            store.runs.pop(key, None)
            store.parked.discard(key)
        for key in self._runs_forgotten - store.parked:
            store.attempts.pop(key, None)
            store.runs.pop(key, None)
        for key, (count, parked) in self._counts.items():
            store.attempts[key] = count
            if parked:
                store.parked.add(key)
        store.effects.extend(self.session.added)
        store.outbox.extend(self.session.outbox)
        store.statements.extend(self.session.statements)
        store.commits += 1
        self.committed = True
        self._end()

    def _end(self) -> None:
        if self.ended:
            return
        if not self.committed:
            self.session.added.clear()
            self.session.outbox.clear()
            self.session.statements.clear()
        self._rows.clear()
        self._dead_letters.clear()
        if not self.committed:
            self._counts.clear()
            self._runs.clear()
            self._forgotten.clear()
            self._runs_forgotten.clear()
            self._settled.clear()
        self.store._release(self._ended)
        self._ended.set()

    def _close(self) -> None:
        """The transaction's scope is left: roll back what is not committed."""
        if self._committing:
            # A real session would refuse (SQLAlchemy raises IllegalStateChangeError)
            # or break the connection under the running COMMIT.
            self.store.misuse.append(
                f"transaction of {self.spec.name!r} closed while its COMMIT was in progress"
            )
            return
        self._end()
