"""The test kit's entry point: an app's handlers run through eop's real protocol, in a test.

::

    async with eop.testing.TestApp(app) as t:               # in memory
        delivered = await t.deliver("ORDERS.created", {"id": 1})
        assert delivered.processed

    async with eop.testing.TestApp(app, database=engine) as t:  # eop's tables in PostgreSQL
        ...

Each delivery goes through :class:`eop.protocol.processor.Processor` (claim,
handler, COMMIT, ack; retries parked, dead letters), on a fake JetStream
delivery: no NATS server is involved. The inbox is a
:class:`~eop.testing.store.MemoryStore`, or with ``database=`` the real
:class:`~eop.pg.store.PostgresStore` on eop's tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from eop import errors, message
from eop.broker import consumers
from eop.handler import HandlerSpec
from eop.pg import migrate
from eop.protocol import misconfiguration
from eop.protocol.batch import BatchProcessor
from eop.protocol.processor import Processor
from eop.testing.backends import Backend, MemoryBackend, PostgresBackend
from eop.testing.deliveries import FakeDelivery
from eop.testing.epochs import FakeEpochs
from eop.testing.lanes import Lanes
from eop.testing.results import (
    Delivered,
    Recorder,
    Result,
    describe_handlers,
    payload_bytes,
    raise_unexpected,
)
from eop.testing.rows import InboxKey, inbox_key
from eop.types import Outcome

if TYPE_CHECKING:
    from types import TracebackType

    from eop.app import App
    from eop.outbox.outgoing import Outgoing
    from eop.testing.rows import DeadLetterRow
    from eop.testing.store import MemoryStore
    from eop.types import Delivery

Database = str | sa.URL | AsyncEngine

# Rounds of retries `settle` runs at most: far above any max_attempts, so that a
# handler retried for ever (ordered, on a nak) ends the test instead of hanging it.
_SETTLE_ROUNDS = 1000


class TestApp:
    """Runs an app's handlers on test deliveries through eop's protocol (:mod:`eop.testing.app`).

    - without ``database``: the inbox, the handlers' writes (``session.add``,
      ``eop.Writes``) and the outbox are kept in memory (:attr:`store`); the
      handlers get a fake session that runs no SQL;
    - with ``database`` (a URL or an ``AsyncEngine``): the real store on eop's
      tables in that database (in ``schema``, default the app's), migrated to
      head first unless ``migrate=False``; the handlers get real sessions.

    An ``order_by`` handler's deliveries run in their keys' lanes, as a
    worker runs them: behind a retried message, the later ones of its key
    are held back, unrun (:attr:`held`), until it has an outcome.

    A handler error other than ``eop.Retry`` and ``eop.Reject`` is raised
    after its delivery settled, as :class:`eop.errors.HandlerFailed` from
    the error, unless ``raise_errors=False`` (here, or per call). A delivery
    that does not settle within ``timeout_s`` (a database that keeps failing,
    a handler that hangs) raises :class:`eop.errors.DeliveryStalled`; one
    that meets a failure only a change of configuration ends (a table no
    migration created: :mod:`eop.protocol.misconfiguration`) raises the
    :class:`eop.errors.ConfigurationError` ``eop worker`` would exit with.
    """

    __test__ = False  # a test kit, not a test class for pytest to collect

    def __init__(
        self,
        app: App,
        *,
        database: Database | None = None,
        schema: str | None = None,
        migrate: bool = True,
        raise_errors: bool = True,
        timeout_s: float = 30.0,
        store: MemoryStore | None = None,
    ) -> None:
        self.source = app
        """The app as given."""
        self.app = app
        """The app the handlers run in (in database mode: on ``database``)."""
        self._database = database
        self._schema = schema
        self._migrate = migrate
        self._store = store
        self.raise_errors = raise_errors
        self.timeout_s = timeout_s
        self.epochs = FakeEpochs()
        """The streams' epochs (one per stream unless a test changes them)."""
        self.outbox: list[Outgoing] = []
        """Every outbox message committed by this test's deliveries, in order."""
        self.results: list[Result] = []
        """Every result of this test's deliveries and retries, in order."""
        self._backend: Backend | None = None
        self._recorder = Recorder()
        self._processors: dict[str, Processor] = {}
        self._misconfigured = misconfiguration.Watch(stop=self._stop_deliveries)
        self._seqs: dict[str, int] = {}
        self._messages: dict[InboxKey, message.Message] = {}
        self._naked: list[tuple[HandlerSpec, FakeDelivery]] = []
        self._lanes = Lanes(self._run, self._held)

    # -- set-up

    async def __aenter__(self) -> TestApp:
        if self._database is None:
            backend: Backend = MemoryBackend(self._store)
        else:
            self.app = self.source.with_database(_as_database(self._database), schema=self._schema)
            s = self.app.settings
            if self._migrate:
                await asyncio.to_thread(migrate.upgrade, s.database_url, s.schema)
            else:
                await migrate.ensure_ready(self.app.engine, s.schema)
            backend = PostgresBackend(self.app)
        await backend.start()
        self._backend = backend
        for spec in self.app.handlers.values():
            self._processors[spec.name] = Processor(
                spec=spec,
                settings=self.app.settings,
                store=backend.store,
                epochs=self.epochs,
                observer=self._recorder,
                misconfigured=self._misconfigured,
            )
        return self

    def _stop_deliveries(self, error: errors.ConfigurationError) -> None:
        # As the worker stops: whatever waits to be retried is handed back at once.
        for proc in self._processors.values():
            proc.stopping.set()

    def _raise_misconfiguration(self) -> None:
        error = self._misconfigured.error
        if error is None:
            return
        self._misconfigured.reset()
        for proc in self._processors.values():
            proc.stopping = asyncio.Event()
        raise error

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for proc in self._processors.values():
            await proc.critical.drain()
        if self._backend is not None:
            await self._backend.close()

    # -- what a test reads

    @property
    def store(self) -> Any:
        """The store: a :class:`~eop.testing.store.MemoryStore` (``effects``, ``statements``,
        ``inbox``...), or the :class:`~eop.pg.store.PostgresStore` in database mode."""
        return self._ready().store

    @property
    def effects(self) -> list[object]:
        """In memory: what the handlers ``session.add()``-ed, committed transactions only."""
        return list(self._memory().effects)

    @property
    def statements(self) -> list[tuple[sa.Executable, dict[str, Any]]]:
        """In memory: what ``eop.Writes`` handlers queued, committed transactions only."""
        return list(self._memory().statements)

    async def dead_letters(self) -> list[DeadLetterRow]:
        """The dead letters this test's deliveries wrote, oldest first."""
        return await self._ready().dead_letters()

    @property
    def held(self) -> list[Result]:
        """The deliveries ``order_by`` handlers hold back now, in the order they were held.

        Each waits, unrun, behind the retried message of its key (its
        :attr:`~eop.testing.results.Result.held_behind`), as a worker's lane
        keeps it: once that message has an outcome (processed,
        dead-lettered...), they run in order, within the call that settled it
        (:meth:`retry`, :meth:`settle` or :meth:`redeliver`).
        """
        return self._lanes.held()

    # -- deliveries

    async def deliver(
        self,
        subject: str,
        data: Any = b"",
        *,
        headers: Mapping[str, str] | None = None,
        msg_id: str | None = None,
        handler: str | None = None,
        raise_errors: bool | None = None,
    ) -> Delivered:
        """Store a message on ``subject`` and deliver it to every handler it matches.

        ``data`` is bytes, text, or anything JSON can encode (a dict, a
        dataclass, a pydantic model). ``msg_id`` becomes its ``Nats-Msg-Id``.
        ``handler`` delivers it to that handler only. Each call is a new
        message in its stream (the next sequence): the same ``msg_id`` again
        is a republish, which the inbox skips.
        """
        [delivered] = await self.deliver_batch(
            subject,
            [data],
            headers=headers,
            msg_ids=[msg_id],
            handler=handler,
            raise_errors=raise_errors,
        )
        return delivered

    async def deliver_batch(
        self,
        subject: str,
        items: Sequence[Any],
        *,
        headers: Mapping[str, str] | None = None,
        msg_ids: Sequence[str | None] | None = None,
        handler: str | None = None,
        raise_errors: bool | None = None,
    ) -> list[Delivered]:
        """Store one message per item and deliver them as one fetched batch to each handler.

        ``msg_ids``, when given, holds each item's ``Nats-Msg-Id`` (or None).

        A batch runs as a worker runs it: one transaction for all (unless
        ``batch_transactions`` is off), a batch handler called once with the
        list. The outbox messages of a batch's transaction are in
        :attr:`outbox`, not in the results of its messages.
        """
        specs = self._matching(subject, handler)
        body = [payload_bytes(item) for item in items]
        ids = list(msg_ids) if msg_ids is not None else [None] * len(body)
        if len(ids) != len(body):
            raise ValueError(f"{len(ids)} msg_ids for {len(body)} items")
        first = {stream: self._next_seqs(stream, len(body)) for stream in {s.stream for s in specs}}
        now = datetime.datetime.now(datetime.timezone.utc)
        per_handler: list[list[Result]] = []
        for spec in specs:
            deliveries = [
                FakeDelivery.make(
                    data=data,
                    subject=subject,
                    stream=spec.stream,
                    seq=first[spec.stream] + i,
                    headers=_headers(headers, ids[i]),
                    consumer=spec.durable,
                    timestamp=now,
                )
                for i, data in enumerate(body)
            ]
            per_handler.append(await self._run_batch(spec, deliveries))
        delivered = [
            Delivered(subject, [results[i] for results in per_handler]) for i in range(len(body))
        ]
        ran = [r for d in delivered for r in d.values()]
        self._check(ran + self._lanes.take_released(), raise_errors)
        return delivered

    async def redeliver(
        self, delivered: Delivered | Result, *, raise_errors: bool | None = None
    ) -> Delivered:
        """Deliver the same stored message again (same stream sequence, one more delivery),
        as the server does after a lost ack or a crash: the inbox skips it once it has an
        outcome.

        For an ``order_by`` handler it goes through its key's lane: held back
        behind a retried message of its key, unless it is that message; when
        it settles that message, the deliveries held behind it run (their
        results are in :attr:`results`).
        """
        previous = list(delivered.values()) if isinstance(delivered, Delivered) else [delivered]
        results = []
        for result in previous:
            spec = self._spec(result.handler)
            results.append(await self._deliver(spec, _again(result.message, spec)))
        again = Delivered(previous[0].message.subject, results)
        self._check(results + self._lanes.take_released(), raise_errors)
        return again

    async def retry(self, *, raise_errors: bool | None = None) -> list[Result]:
        """Run every message waiting for its retry once, now, whenever it is due.

        Those are the parked messages (a handler failed; they wait in the
        retries table) and, for ``order_by`` handlers, the nak'ed ones (the
        server would deliver them again). When a nak'ed message has an outcome
        (processed, dead-lettered), the deliveries of its key held back behind
        it (:attr:`held`) run next, in order, until one of them is retried in
        turn: the results are in the order the handlers ran.
        """
        results: list[Result] = []
        backend = self._ready()
        for spec in self.app.handlers.values():
            proc = self._processors[spec.name]
            if not proc.parks:
                continue
            for parked in await backend.take_parked(spec, self._messages):
                outcome = await self._bounded(proc.retry_parked(parked), proc, parked)
                results.append(await self._result(spec, parked, parked.message, outcome))
        naked, self._naked = self._naked, []
        for spec, delivery in naked:
            results.append(await self._deliver(spec, delivery.redeliver()))
            results += self._lanes.take_released()
        # A message left for the server's AckWait (no nak), which the kit does not model, is
        # not redelivered: the kit stops holding its key, as a worker does after a while.
        results += await self._lanes.unhold(self._naked)
        self._check(results, raise_errors)
        return results

    async def settle(self, *, raise_errors: bool | None = None) -> list[Result]:
        """:meth:`retry` until no message waits: each one processed or dead-lettered, the held
        ones of ``order_by`` handlers included."""
        results: list[Result] = []
        for _ in range(_SETTLE_ROUNDS):
            round_ = await self.retry(raise_errors=raise_errors)
            if not round_:
                return results
            results += round_
        raise errors.DeliveryStalled(
            f"messages still wait for a retry after {_SETTLE_ROUNDS} rounds: "
            f"{', '.join(str(r) for r in results[-3:])}"
        )

    # -- internals

    def _ready(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("use TestApp as `async with TestApp(app) as t:`")
        return self._backend

    def _memory(self) -> MemoryStore:
        backend = self._ready()
        if not isinstance(backend, MemoryBackend):
            raise AttributeError(
                "effects and statements are kept in memory mode only: with a database, "
                "query your tables"
            )
        return backend.memory

    def _spec(self, name: str) -> HandlerSpec:
        try:
            return self.app.handlers[name]
        except KeyError:
            known = describe_handlers(list(self.app.handlers.values()))
            raise errors.ConfigurationError(f"no handler {name!r}; the app has: {known}") from None

    def _matching(self, subject: str, handler: str | None) -> list[HandlerSpec]:
        self._ready()
        if handler is not None:
            return [self._spec(handler)]
        specs = [
            s for s in self.app.handlers.values() if consumers.subject_matches(s.subject, subject)
        ]
        if not specs:
            known = describe_handlers(list(self.app.handlers.values()))
            raise errors.ConfigurationError(f"no handler takes {subject!r}; the app has: {known}")
        return specs

    def _next_seqs(self, stream: str, count: int) -> int:
        first = self._seqs.get(stream, 0) + 1
        self._seqs[stream] = first + count - 1
        return first

    async def _run_batch(self, spec: HandlerSpec, deliveries: list[FakeDelivery]) -> list[Result]:
        proc = self._processors[spec.name]
        # A worker runs an ordered handler's messages one by one, in their keys' lanes.
        if len(deliveries) == 1 or not self.app.settings.batch_transactions or spec.order_by:
            return [await self._deliver(spec, d) for d in deliveries]
        msgs = [await self._message(spec, d) for d in deliveries]
        batch = BatchProcessor(proc)
        await self._bounded(batch.handle_batch(deliveries, proc.clock()), proc, *deliveries)
        # One transaction: its outbox messages are the batch's, not one message's.
        self.outbox += await self._ready().new_outbox()
        return [
            await self._result(spec, d, m, Outcome.LEFT, outbox=False)
            for d, m in zip(deliveries, msgs, strict=True)
        ]

    async def _deliver(self, spec: HandlerSpec, delivery: FakeDelivery) -> Result:
        """Run one delivery; an ordered handler's in its key's lane (:mod:`eop.testing.lanes`)."""
        if spec.order_by is None:
            return await self._run(spec, delivery)
        return await self._lanes.deliver(spec, delivery)

    async def _held(self, spec: HandlerSpec, delivery: FakeDelivery, behind: int) -> Result:
        """The result of a delivery its key's lane holds back behind sequence ``behind``."""
        msg = await self._message(spec, delivery)
        result = Result(handler=spec.name, outcome=None, message=msg, held_behind=behind)
        self.results.append(result)
        return result

    async def _run(self, spec: HandlerSpec, delivery: FakeDelivery) -> Result:
        proc = self._processors[spec.name]
        msg = await self._message(spec, delivery)
        outcome = await self._bounded(proc.handle(delivery, proc.clock()), proc, delivery)
        return await self._result(spec, delivery, msg, outcome)

    async def _message(self, spec: HandlerSpec, delivery: FakeDelivery) -> message.Message:
        epoch = await self.epochs.get(spec.stream)
        msg = message.from_nats(delivery, subscription=spec.name, stream_epoch=epoch)
        self._messages[inbox_key(msg)] = msg
        return msg

    async def _result(
        self,
        spec: HandlerSpec,
        delivery: Delivery,
        msg: message.Message,
        outcome: Outcome,
        *,
        outbox: bool = True,
    ) -> Result:
        settled, error = self._recorder.take(delivery)
        if settled is not None:
            outcome = settled.outcome
        added = await self._ready().new_outbox() if outbox else []
        self.outbox += added
        if isinstance(delivery, FakeDelivery) and delivery.naked:
            self._naked.append((spec, delivery))
        result = Result(
            handler=spec.name,
            outcome=outcome,
            message=msg,
            error=error,
            reason=None if settled is None else settled.reason,
            outbox=tuple(added),
        )
        self.results.append(result)
        return result

    async def _bounded(self, work: Awaitable[Any], proc: Processor, *deliveries: Delivery) -> Any:
        """``work``, or :class:`DeliveryStalled` if it does not end within :attr:`timeout_s`."""
        task = asyncio.ensure_future(work)
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if done:
            self._raise_misconfiguration()
            return task.result()
        # As a stopping worker does: a transaction waiting to be retried hands its
        # message back at once; a handler still running is cancelled.
        proc.stopping.set()
        done, _ = await asyncio.wait({task}, timeout=5.0)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        proc.stopping = asyncio.Event()
        what = ", ".join(f"{d.metadata.stream} #{d.metadata.sequence.stream}" for d in deliveries)
        raise errors.DeliveryStalled(
            f"handler {proc.spec.name!r} did not settle {what} within {self.timeout_s:g} s "
            "(raise TestApp(timeout_s=...) if it is slow): the database kept failing, "
            "or the handler hangs; the worker's log lines (transaction.retry) tell which"
        )

    def _check(self, results: Sequence[Result], raise_errors: bool | None) -> None:
        if self.raise_errors if raise_errors is None else raise_errors:
            raise_unexpected(results)


def _as_database(database: Database) -> str | AsyncEngine:
    if isinstance(database, sa.URL):
        return database.render_as_string(hide_password=False)
    return database


def _headers(headers: Mapping[str, str] | None, msg_id: str | None) -> dict[str, str] | None:
    merged = dict(headers or {})
    if msg_id is not None:
        merged["Nats-Msg-Id"] = msg_id
    return merged or None


def _again(msg: message.Message, spec: HandlerSpec) -> FakeDelivery:
    """The next delivery of a stored message."""
    return FakeDelivery.make(
        data=msg.data,
        subject=msg.subject,
        stream=msg.stream,
        seq=msg.seq,
        num_delivered=msg.num_delivered + 1,
        headers=dict(msg.headers) or None,
        consumer=spec.durable,
        timestamp=msg.timestamp or datetime.datetime.now(datetime.timezone.utc),
    )
