"""Fakes for testing handlers, and eop itself, without NATS or PostgreSQL.

Like procrastinate's ``testing`` module or dramatiq's stub broker, these run
the real protocol (:class:`eop.processor.Processor`) against in-memory stand-ins
that keep the semantics that matter and can be told to fail::

    from eop import Settings, testing
    from eop.processor import Outcome, Processor

    store = testing.MemoryStore()
    processor = Processor(spec=app.handlers["orders"], settings=Settings(),
                          store=store, epochs=testing.FakeEpochs())
    delivery = testing.FakeDelivery.make(data=b'{"id": 1}', subject="orders.new")
    assert await processor.handle(delivery, processor.clock()) is Outcome.PROCESSED
    assert delivery.acked and store.effects == [...]  # what the handler session.add()-ed

- :class:`FakeDelivery`: one JetStream delivery; records ack/nak/term and
  heartbeats, and can lose ack replies.
- :class:`MemoryStore`: the inbox with PostgreSQL's semantics (claims wait on
  each other, rows are visible after COMMIT only, a rollback discards); handlers
  get a :class:`FakeSession` whose ``add()`` calls become ``store.effects`` at
  COMMIT.
- :class:`FakeEpochs`: stream epochs from a dict.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import inspect
from collections.abc import AsyncIterator, Generator, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Union

import nats.errors

from eop import errors, log, models
from eop.inbox import DeadLetter, Existing

if TYPE_CHECKING:
    from eop import ack, inbox, processor
    from eop.handler import HandlerSpec
    from eop.message import Message

__all__ = [
    "DeadLetterRow",
    "FakeDelivery",
    "FakeEpochs",
    "FakeMetadata",
    "FakeSession",
    "InboxKey",
    "InboxRow",
    "LockNotAvailable",
    "MemoryStore",
    "MemoryTransaction",
    "SequencePair",
]

ErrorSpec = Union[BaseException, "type[BaseException]"]  # a runtime alias: no `X | Y` on 3.10
"""An exception to raise: an instance, or a class called without arguments."""

Operation = Literal["ack_sync", "nak", "term", "in_progress"]

DEFAULT_TIMESTAMP = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)


def _instantiate(error: ErrorSpec) -> BaseException:
    return error() if isinstance(error, type) else error


# --------------------------------------------------------------------------- NATS


@dataclasses.dataclass(frozen=True)
class SequencePair:
    """The consumer and stream sequences of a delivery (as in nats-py)."""

    consumer: int
    stream: int


@dataclasses.dataclass(frozen=True)
class FakeMetadata:
    """The JetStream metadata of a :class:`FakeDelivery`, shaped like nats-py's."""

    sequence: SequencePair
    num_delivered: int
    stream: str
    consumer: str
    timestamp: datetime.datetime
    num_pending: int = 0
    domain: str | None = None


class FakeDelivery:
    """An in-memory JetStream delivery implementing :class:`eop.ack.Delivery`.

    It settles like nats-py's ``Msg``: once an ack, nak or term went through,
    any further one raises ``nats.errors.MsgAlreadyAckdError``. What happened
    is recorded in :attr:`acked`, :attr:`naked` (with :attr:`nak_delay`),
    :attr:`termed` and :attr:`in_progress_calls`; :meth:`fail_acks` makes the
    next ``ack_sync`` calls raise (a lost ack reply is a
    ``nats.errors.TimeoutError``, the default).
    """

    def __init__(
        self,
        *,
        subject: str,
        data: bytes,
        stream: str,
        seq: int,
        num_delivered: int = 1,
        headers: dict[str, str] | None = None,
        consumer: str = "eop-test",
        consumer_seq: int | None = None,
        timestamp: datetime.datetime = DEFAULT_TIMESTAMP,
    ) -> None:
        cseq = seq if consumer_seq is None else consumer_seq
        self.subject = subject
        self.data = data
        self.headers = headers
        # The reply subject nats-py parses the metadata from.
        nanos = int(timestamp.timestamp() * 1_000_000_000)
        self.reply = f"$JS.ACK.{stream}.{consumer}.{num_delivered}.{seq}.{cseq}.{nanos}.0"
        self._metadata = FakeMetadata(
            sequence=SequencePair(consumer=cseq, stream=seq),
            num_delivered=num_delivered,
            stream=stream,
            consumer=consumer,
            timestamp=timestamp,
        )
        self.acked = False
        """An ``ack_sync`` went through."""
        self.naked = False
        """A ``nak`` went through."""
        self.nak_delay: float | None = None
        """The delay of the nak that went through."""
        self.termed = False
        """A ``term`` went through."""
        self.ack_attempts = 0
        """``ack_sync`` calls, failed ones included."""
        self.in_progress_calls = 0
        """``in_progress`` calls (heartbeats)."""
        self._failures: dict[Operation, list[ErrorSpec]] = {
            "ack_sync": [],
            "nak": [],
            "term": [],
            "in_progress": [],
        }
        self._progress = asyncio.Event()

    @classmethod
    def make(
        cls,
        data: bytes = b"{}",
        subject: str = "s",
        stream: str = "S",
        seq: int = 1,
        num_delivered: int = 1,
        headers: dict[str, str] | None = None,
        *,
        consumer: str = "eop-test",
        consumer_seq: int | None = None,
        timestamp: datetime.datetime = DEFAULT_TIMESTAMP,
    ) -> FakeDelivery:
        """A delivery of ``data`` on ``subject``, stored in ``stream`` at ``seq``."""
        return cls(
            subject=subject,
            data=data,
            stream=stream,
            seq=seq,
            num_delivered=num_delivered,
            headers=headers,
            consumer=consumer,
            consumer_seq=consumer_seq,
            timestamp=timestamp,
        )

    @property
    def metadata(self) -> FakeMetadata:
        """JetStream metadata: stream, sequences, delivery count, timestamp, consumer."""
        return self._metadata

    @property
    def settled(self) -> bool:
        """An ack, nak or term went through: any further one raises, as in nats-py."""
        return self.acked or self.naked or self.termed

    def redeliver(self) -> FakeDelivery:
        """The next delivery of the same stored message (``num_delivered`` + 1)."""
        meta = self._metadata
        return FakeDelivery(
            subject=self.subject,
            data=self.data,
            stream=meta.stream,
            seq=meta.sequence.stream,
            num_delivered=meta.num_delivered + 1,
            headers=None if self.headers is None else dict(self.headers),
            consumer=meta.consumer,
            consumer_seq=meta.sequence.consumer + 1,
            timestamp=meta.timestamp,
        )

    def fail_acks(
        self, times: int = 1, error: ErrorSpec = nats.errors.TimeoutError
    ) -> FakeDelivery:
        """Make the next ``times`` ``ack_sync`` calls raise ``error`` (default: a lost reply)."""
        return self.fail("ack_sync", times, error)

    def fail(
        self, operation: Operation, times: int = 1, error: ErrorSpec = nats.errors.TimeoutError
    ) -> FakeDelivery:
        """Make the next ``times`` calls of ``operation`` raise ``error``."""
        self._failures[operation].extend([error] * times)
        return self

    def _maybe_fail(self, operation: Operation) -> None:
        failures = self._failures[operation]
        if failures:
            raise _instantiate(failures.pop(0))

    def _check_unsettled(self) -> None:
        if self.settled:
            raise nats.errors.MsgAlreadyAckdError(self)

    async def ack_sync(self, timeout: float = 1.0) -> FakeDelivery:
        """Ack and "wait" for the server's confirmation."""
        self.ack_attempts += 1
        self._check_unsettled()
        self._maybe_fail("ack_sync")
        self.acked = True
        return self

    async def ack(self) -> None:
        """Ack without waiting for a confirmation."""
        self._check_unsettled()
        self._maybe_fail("ack_sync")
        self.acked = True

    async def nak(self, delay: float | None = None) -> None:
        """Ask for a redelivery after ``delay`` seconds."""
        self._check_unsettled()
        self._maybe_fail("nak")
        self.naked = True
        self.nak_delay = delay

    async def term(self) -> None:
        """Tell the server never to redeliver."""
        self._check_unsettled()
        self._maybe_fail("term")
        self.termed = True

    async def in_progress(self) -> None:
        """Reset the AckWait timer (may be called any number of times)."""
        self._maybe_fail("in_progress")
        self.in_progress_calls += 1
        self._progress.set()

    async def wait_for_in_progress(self, count: int = 1) -> None:
        """Wait until ``in_progress`` has been called ``count`` times in all."""
        while self.in_progress_calls < count:
            self._progress.clear()
            await self._progress.wait()

    def __repr__(self) -> str:
        meta = self._metadata
        return (
            f"<FakeDelivery {meta.stream}#{meta.sequence.stream} subject={self.subject!r} "
            f"delivered={meta.num_delivered}>"
        )


class FakeEpochs:
    """Stream epochs from a dict, implementing :class:`eop.processor.Epochs`.

    :attr:`current` is what the server says; :meth:`get` answers from a cache
    filled on first use, like the real :class:`eop.jetstream.StreamEpochs`, so
    changing :attr:`current` (:meth:`set`, a recreated stream) is only seen
    after :meth:`refresh`. Streams missing from :attr:`current` have
    :attr:`default`.
    """

    def __init__(
        self, epochs: Mapping[str, str] | None = None, *, default: str = "epoch-1"
    ) -> None:
        self.current: dict[str, str] = dict(epochs or {})
        """The epoch of each stream on the (fake) server."""
        self.default = default
        self.refreshes = 0
        """How many times :meth:`refresh` was called."""
        self._cache: dict[str, str] = {}

    def set(self, stream: str, epoch: str) -> None:
        """The stream was recreated: the server now reports ``epoch``."""
        self.current[stream] = epoch

    async def get(self, stream: str) -> str:
        """The cached epoch of ``stream``."""
        if stream not in self._cache:
            self._cache[stream] = self.current.get(stream, self.default)
        return self._cache[stream]

    async def epoch_of(self, stream: str, stored_at: datetime.datetime | None) -> str | None:
        """The cached epoch of ``stream``, whenever the message was stored."""
        return await self.get(stream)

    async def refresh(self, stream: str) -> str:
        """Re-read the epoch of ``stream`` from :attr:`current`."""
        self.refreshes += 1
        self._cache[stream] = self.current.get(stream, self.default)
        return self._cache[stream]


# ----------------------------------------------------------------------- the inbox

InboxKey = tuple[str, str, str, int]
"""``(subscription, stream, stream_epoch, stream_seq)``."""


def inbox_key(message: Message) -> InboxKey:
    """The inbox key of a message."""
    return (message.subscription, message.stream, message.stream_epoch, message.seq)


@dataclasses.dataclass(frozen=True)
class InboxRow:
    """A committed (or pending) inbox row."""

    subscription: str
    stream: str
    stream_epoch: str
    stream_seq: int
    fingerprint: bytes
    msg_id: str | None
    subject: str
    outcome: str
    delivery_count: int

    @classmethod
    def of(cls, message: Message, outcome: str, msg_id: str | None) -> InboxRow:
        """The row a claim of ``message`` inserts (``msg_id`` None without the guard)."""
        return cls(
            subscription=message.subscription,
            stream=message.stream,
            stream_epoch=message.stream_epoch,
            stream_seq=message.seq,
            fingerprint=message.fingerprint,
            msg_id=msg_id,
            subject=message.subject,
            outcome=outcome,
            delivery_count=message.num_delivered,
        )

    @property
    def key(self) -> InboxKey:
        """The inbox key of the row."""
        return (self.subscription, self.stream, self.stream_epoch, self.stream_seq)


@dataclasses.dataclass(frozen=True)
class DeadLetterRow:
    """A dead letter, as the real store writes it (headers without secrets)."""

    subscription: str
    stream: str
    stream_epoch: str
    stream_seq: int
    fingerprint: bytes
    msg_id: str | None
    subject: str
    headers: dict[str, str]
    payload: bytes
    reason: str
    error: str
    traceback: str | None
    delivery_count: int

    @property
    def unique_key(self) -> tuple[str, str, str, int, bytes]:
        """What makes a dead letter unique: its message's key and fingerprint."""
        return (
            self.subscription,
            self.stream,
            self.stream_epoch,
            self.stream_seq,
            self.fingerprint,
        )


class LockNotAvailable(Exception):
    """PostgreSQL's ``lock_not_available``: ``lock_timeout`` expired (sqlstate 55P03).

    :func:`eop.inbox.classify` reads its :attr:`sqlstate` as LOCK_TIMEOUT.
    """

    sqlstate = "55P03"

    def __init__(self, message: str = "canceling statement due to lock timeout") -> None:
        super().__init__(message)


class FakeSession:
    """The session a handler gets from :class:`MemoryStore`: it records ``add()`` calls.

    What is added becomes :attr:`MemoryStore.effects` when the transaction
    commits, and is discarded when it rolls back.
    """

    def __init__(self) -> None:
        self.added: list[object] = []
        """Objects added in this transaction, in order."""
        self.flushes = 0
        """``flush()`` calls."""

    def add(self, instance: object) -> None:
        """Record ``instance`` as a write of this transaction."""
        self.added.append(instance)

    def add_all(self, instances: Iterable[object]) -> None:
        """Record each of ``instances``."""
        self.added.extend(instances)

    def flush(self) -> _Done:
        """Do nothing, as ``session.flush()`` or ``await session.flush()``."""
        self.flushes += 1
        return _Done()


class _Done:
    """An awaitable that is already done."""

    def __await__(self) -> Generator[None, None, None]:
        yield from ()


class MemoryTransaction:
    """One transaction of a :class:`MemoryStore` (implements :class:`eop.inbox.Transaction`)."""

    def __init__(self, store: MemoryStore, spec: HandlerSpec) -> None:
        self.store = store
        self.spec = spec
        self.session = FakeSession()
        """The session handed to the handler."""
        self.committed = False
        self._rows: list[InboxRow] = []
        self._dead_letters: list[DeadLetterRow] = []
        self._ended = asyncio.Event()
        self._committing = False

    @property
    def ended(self) -> bool:
        """Committed or rolled back."""
        return self._ended.is_set()

    async def claim(self, message: Message, outcome: str) -> bool:
        """Insert the inbox row unless its key (or, with the msg-id guard, msg-id) is taken.

        Like ``INSERT ... ON CONFLICT DO NOTHING`` under READ COMMITTED, a key
        held by another open transaction makes this wait for it to end; the
        store's ``lock_timeout_s`` bounds that wait (:class:`LockNotAvailable`).
        """
        self._check_open()
        self.store._maybe_fail("claim")
        key = inbox_key(message)
        msg_id = message.msg_id if self.spec.msg_id_guard else None
        id_key = None if msg_id is None else (message.subscription, msg_id)
        holder = await self.store._wait_for_holders(self, key, id_key)
        if holder is self:
            return False
        if key in self.store.inbox or (id_key is not None and id_key in self.store._by_msg_id):
            return False
        row = InboxRow.of(message, outcome, msg_id)
        self._rows.append(row)
        self.store._claims[key] = self
        if id_key is not None:
            self.store._msg_id_claims[id_key] = self
        return True

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
        self._dead_letters.append(
            DeadLetterRow(
                subscription=message.subscription,
                stream=message.stream,
                stream_epoch=message.stream_epoch,
                stream_seq=message.seq,
                fingerprint=message.fingerprint,
                msg_id=message.msg_id,
                subject=message.subject,
                headers=log.redact_headers(message.headers),
                payload=message.data,
                reason=dead.reason,
                error=dead.error,
                traceback=dead.traceback,
                delivery_count=message.num_delivered,
            )
        )

    async def run(self, message: Message) -> None:
        """Call ``spec.func(message, session)``, awaiting it when it returns an awaitable.

        A plain ``def`` handler runs on the event loop here (the real store
        runs it in a worker thread).
        """
        self._check_open()
        if self.spec.payload is None:
            result = self.spec.func(message, self.session)  # type: ignore[arg-type]  # a fake session
        else:
            typed: Any = self.spec.func  # called with the decoded payload
            value, extra = self.spec.payload.arguments([message])
            result = typed(value, self.session, **extra)
        if inspect.isawaitable(result):
            await result

    async def commit(self) -> None:
        """COMMIT, unless the store was told to fail it (see :class:`MemoryStore`)."""
        self._check_open()
        self._committing = True
        try:
            await self.store._before_commit()
            failure = self.store._next_commit_failure()
            if isinstance(failure, _Ambiguous):
                if failure.committed:
                    self._apply()
                else:
                    self._end()
                raise errors.AmbiguousCommit()
            if failure is not None:
                self._end()
                raise _instantiate(failure)
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
        store.effects.extend(self.session.added)
        store.commits += 1
        self.committed = True
        self._end()

    def _end(self) -> None:
        if self.ended:
            return
        if not self.committed:
            self.session.added.clear()
        self._rows.clear()
        self._dead_letters.clear()
        self.store._release(self)
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


@dataclasses.dataclass(frozen=True)
class _Ambiguous:
    committed: bool


class MemoryStore:
    """An in-memory inbox implementing :class:`eop.inbox.Store` with PostgreSQL's semantics.

    - a claim inserts the inbox row unless its key, or (with the handler's
      ``msg_id_guard``) its ``Nats-Msg-Id``, is taken; a claim held by another
      open transaction makes it wait, up to ``lock_timeout_s`` (None: forever);
    - rows, dead letters and the handler's writes (:attr:`effects`) are
      visible to others after COMMIT only; a rollback discards them;
    - one dead letter per (key, fingerprint).

    Knobs inject the failures the protocol must survive: :meth:`fail_transactions`,
    :meth:`fail_claims`, :meth:`lock_timeout_claims`, :meth:`conflict_commits`,
    :meth:`fail_commits`, :meth:`ambiguous_commit`, :meth:`fail_has_outcome`,
    and :meth:`pause_commits` to hold COMMITs until :meth:`resume_commits`.
    """

    def __init__(self, *, lock_timeout_s: float | None = None) -> None:
        self.lock_timeout_s = lock_timeout_s
        self.inbox: dict[InboxKey, InboxRow] = {}
        """Committed inbox rows by key."""
        self.dead_letters: list[DeadLetterRow] = []
        """Committed dead letters, in commit order."""
        self.effects: list[object] = []
        """What handlers ``add()``-ed to their session, for committed transactions only."""
        self.misuse: list[str] = []
        """Misuses a real database session would reject (e.g. closing it mid-COMMIT)."""
        self.transactions = 0
        """Transactions opened."""
        self.commits = 0
        """Transactions committed (an ambiguous COMMIT that went through included)."""
        self.commit_started = asyncio.Event()
        """Set when a COMMIT starts while commits are paused."""
        self._by_msg_id: dict[tuple[str, str], InboxKey] = {}
        self._claims: dict[InboxKey, MemoryTransaction] = {}
        self._msg_id_claims: dict[tuple[str, str], MemoryTransaction] = {}
        self._failures: dict[str, list[ErrorSpec]] = {"open": [], "claim": [], "has_outcome": []}
        self._commit_failures: list[ErrorSpec | _Ambiguous] = []
        self._commit_gate: asyncio.Event | None = None

    # -- the Store protocol

    def transaction(
        self, spec: HandlerSpec
    ) -> contextlib.AbstractAsyncContextManager[MemoryTransaction]:
        """A transaction, rolled back on exit unless committed."""
        return self._transaction(spec)

    @contextlib.asynccontextmanager
    async def _transaction(self, spec: HandlerSpec) -> AsyncIterator[MemoryTransaction]:
        self._maybe_fail("open")
        self.transactions += 1
        tx = MemoryTransaction(self, spec)
        try:
            yield tx
        finally:
            tx._close()

    async def has_outcome(self, spec: HandlerSpec, message: Message) -> bool:
        """Whether this very message (key and fingerprint) has a committed outcome."""
        self._maybe_fail("has_outcome")
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
        self._failures["open"].extend([error] * times)
        return self

    def fail_claims(self, times: int = 1, error: ErrorSpec = LockNotAvailable) -> MemoryStore:
        """Make the next ``times`` claims raise ``error`` (default: a lock timeout)."""
        self._failures["claim"].extend([error] * times)
        return self

    def lock_timeout_claims(self, times: int = 1) -> MemoryStore:
        """Make the next ``times`` claims time out on the row lock (sqlstate 55P03)."""
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
        self._commit_failures.append(_Ambiguous(committed=committed))
        return self

    def fail_has_outcome(
        self, times: int = 1, error: ErrorSpec = errors.DatabaseUnavailable
    ) -> MemoryStore:
        """Make the next ``times`` :meth:`has_outcome` calls raise ``error``."""
        self._failures["has_outcome"].extend([error] * times)
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

    # -- internals

    def _maybe_fail(self, what: str) -> None:
        failures = self._failures[what]
        if failures:
            raise _instantiate(failures.pop(0))

    def _next_commit_failure(self) -> ErrorSpec | _Ambiguous | None:
        return self._commit_failures.pop(0) if self._commit_failures else None

    async def _before_commit(self) -> None:
        gate = self._commit_gate
        if gate is not None:
            self.commit_started.set()
            await gate.wait()

    async def _wait_for_holders(
        self, tx: MemoryTransaction, key: InboxKey, id_key: tuple[str, str] | None
    ) -> MemoryTransaction | None:
        """Wait while another open transaction holds the key or msg-id; the holder left."""
        while True:
            holder = self._claims.get(key)
            if holder is None and id_key is not None:
                holder = self._msg_id_claims.get(id_key)
            if holder is None or holder is tx:
                return holder
            try:
                await asyncio.wait_for(holder._ended.wait(), self.lock_timeout_s)
            except asyncio.TimeoutError:
                raise LockNotAvailable() from None

    def _release(self, tx: MemoryTransaction) -> None:
        self._claims = {k: holder for k, holder in self._claims.items() if holder is not tx}
        self._msg_id_claims = {
            k: holder for k, holder in self._msg_id_claims.items() if holder is not tx
        }


if TYPE_CHECKING:

    def _conforms(
        store: MemoryStore, delivery: FakeDelivery, epochs: FakeEpochs
    ) -> tuple[inbox.Store, ack.Delivery, processor.Epochs]:
        """Let mypy check that the fakes implement eop's protocols."""
        return store, delivery, epochs
