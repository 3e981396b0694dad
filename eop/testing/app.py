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
import datetime
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from eop import errors
from eop.broker import consumers
from eop.handler import HandlerSpec
from eop.pg import migrate
from eop.testing.backends import Backend, MemoryBackend, PostgresBackend
from eop.testing.deliveries import FakeDelivery
from eop.testing.delivery_loop import DeliveryLoop, delivery_headers, next_delivery
from eop.testing.results import (
    Delivered,
    Result,
    describe_handlers,
    payload_bytes,
)

if TYPE_CHECKING:
    from types import TracebackType

    from eop.app import App
    from eop.testing.rows import DeadLetterRow
    from eop.testing.store import MemoryStore

Database = str | sa.URL | AsyncEngine

# Rounds of retries `settle` runs at most: far above any max_attempts, so that a
# handler retried for ever (ordered, on a nak) ends the test instead of hanging it.
_SETTLE_ROUNDS = 1000


class TestApp(DeliveryLoop):
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
        self._database = database
        self._schema = schema
        self._migrate = migrate
        self._store = store
        super().__init__(app, raise_errors=raise_errors, timeout_s=timeout_s)

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
        await self._start(backend)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()

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
                    headers=delivery_headers(headers, ids[i]),
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
            results.append(await self._deliver(spec, next_delivery(result.message, spec)))
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
            spec = self._spec(handler)
            if not consumers.subject_matches(spec.subject, subject):
                # Its consumer would never receive it: a test must not pass on routing
                # no worker does.
                raise errors.ConfigurationError(
                    f"handler {handler!r} takes {spec.subject!r}, not {subject!r}: its "
                    "consumer would never receive this message"
                )
            return [spec]
        specs = [
            s for s in self.app.handlers.values() if consumers.subject_matches(s.subject, subject)
        ]
        if not specs:
            known = describe_handlers(list(self.app.handlers.values()))
            raise errors.ConfigurationError(f"no handler takes {subject!r}; the app has: {known}")
        return specs


def _as_database(database: Database) -> str | AsyncEngine:
    if isinstance(database, sa.URL):
        return database.render_as_string(hide_password=False)
    return database
