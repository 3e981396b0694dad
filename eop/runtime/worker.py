"""The worker: pulls each handler's durable consumer and runs the protocol.

Several worker processes may share one durable consumer. An ordered
handler's partitions are shared out among the processes that run it, each
with a consumer of its own (:mod:`eop.runtime.ordered`). A stop (SIGTERM,
SIGINT, or a host's :meth:`~eop.runtime.hosting.Hosted.shutdown`) stops
fetching, lets in-flight messages finish within the grace period, and never
cuts between a COMMIT and its ack.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from eop import backoff, errors, log, redaction
from eop.app import App, select_handlers
from eop.broker import ack, connection, consumers, fetcher, jetstream, leases, partitions
from eop.handler import HandlerSpec
from eop.observe import observer as observe
from eop.outbox import relay
from eop.outbox.jetstream import JetStreamPublisher
from eop.pg import migrate, ownership, retries
from eop.pg.store import PostgresStore
from eop.protocol import (
    batch,
    compaction,
    heads,
    misconfiguration,
    ordering,
    processor,
    retry_batch,
    unacked,
)
from eop.runtime import hosting, ordered, shutdown, slots, startup, telemetry
from eop.types import Delivery, Outcome

if TYPE_CHECKING:
    import prometheus_client

# The waits after failed fetches (counted from 1): 0.2 s, doubling up to 5 s.
_FETCH_RETRY_FIRST_S = 0.2
_FETCH_RETRY_MAX_S = 5.0


class Worker(hosting.Hosted):
    """Runs the handlers of an :class:`eop.App` until stopped.

    ``handlers`` restricts the worker to some handler names (default: all).
    ``report_to`` is for the processes of ``eop worker --processes N``: the
    supervisor's directory, where the worker writes its metrics and readiness
    instead of serving them (:mod:`eop.runtime.telemetry`).

    ``eop worker`` runs one per process. Inside another application's event
    loop (a FastAPI lifespan), ``async with eop.Worker(app).running(): ...``
    runs one as a task of that loop, installing no signal handler
    (:mod:`eop.runtime.hosting`). ``metrics_registry`` puts the worker's
    metrics into the host's prometheus_client registry (its ``REGISTRY``, say),
    so that the host's own ``/metrics`` shows them; one worker per registry.
    """

    def __init__(
        self,
        app: App,
        *,
        handlers: Iterable[str] = (),
        report_to: str | None = None,
        metrics_registry: prometheus_client.CollectorRegistry | None = None,
    ) -> None:
        self.app = app
        self.settings = app.settings
        self.specs = select_handlers(app, handlers)
        if not self.specs:
            raise errors.ConfigurationError(
                "the app has no handlers: register one with @app.handler"
            )
        for spec in self.specs:
            if spec.ack_wait_s is not None and spec.ack_wait_s <= self.settings.lease_margin_s:
                raise errors.ConfigurationError(
                    f"handler {spec.name!r}: ack_wait_s ({spec.ack_wait_s}) must exceed "
                    f"lease_margin_s ({self.settings.lease_margin_s})"
                )
        self.ready = asyncio.Event()
        """Set once every subscription is bound and fetching has started."""
        self._stopping = asyncio.Event()
        self._startup = startup.Patience(self.settings, self._stopping)
        self._force = asyncio.Event()
        self._slots = slots.Slots(self.settings.concurrency)
        self._inflight: set[asyncio.Task[Any]] = set()
        self._critical = processor.Critical()
        self._suspects = asyncio.Lock()
        # Every delivery from its fetch to its settlement: the one place leases are kept.
        self._leases = leases.Leases()
        self._lanes: dict[tuple[str, str], asyncio.Task[Any]] = {}
        self._blocked = ordering.BlockedKeys()
        self._runners: dict[str, ordered.OrderedRunner] = {}
        self._heads: dict[str, heads.Heads] = {}
        self._transforms: dict[str, tuple[str, str]] = {}
        self._compactors: dict[str, compaction.Compactor] = {}
        self._logger = log.get_logger()
        self.processed = 0
        self.nats: Any = None
        """The NATS connection while the worker runs."""
        self._lost: errors.EopError | None = None
        self._watch = misconfiguration.Watch(stop=self._give_up)
        self.telemetry = telemetry.Telemetry(self, report_to=report_to, registry=metrics_registry)
        """Metrics, health endpoints and tracing (see :mod:`eop.runtime.telemetry`)."""
        self._observer = self.telemetry.observer
        self.on_stop: list[Callable[[], None]] = []
        """Called once, when a stop is first asked for (``eop worker`` arms its watchdog)."""
        self.cancelled = 0
        """In-flight messages a stop cancelled after the grace period (left for redelivery)."""
        self.abandoned_threads = 0
        """Threads still running a sync handler after the stop (:mod:`eop.runtime.shutdown`)."""
        self.relay: relay.Relay | None = None
        """The outbox relay of this process (``relay`` setting), once started."""

    def stop(self, *, force: bool = False) -> None:
        """Stop fetching and finish in-flight messages; ``force`` cancels their handlers.

        Even forced, a COMMIT under way is followed by its ack before the
        worker exits.
        """
        if force:
            self._force.set()
        if not self._stopping.is_set():
            self._stopping.set()
            self._slots.close()
            for callback in self.on_stop:
                callback()

    def _give_up(self, error: errors.EopError) -> None:
        """NATS will not take the worker back (credentials refused), or the database is
        misconfigured (:mod:`eop.protocol.misconfiguration`): stop, then raise ``error``.

        The stop is a SIGTERM's: in-flight messages finish or are left for
        redelivery, and none is acked without its COMMIT.
        """
        if self._lost is not None:
            return
        self._lost = error
        if isinstance(error, errors.NatsReauthenticationFailed):
            self._logger.error(
                log.Event.NATS_AUTH_REFUSED, refusals=error.refusals, error=str(error)
            )
        elif isinstance(error, errors.NatsUnavailable):
            self._logger.error(log.Event.NATS_CLOSED, error=str(error))
        self.stop()

    def _on_signal(self, signum: int) -> None:
        # A second Ctrl-C means "now": do not wait for slow handlers. A second
        # SIGTERM does not: systemd, for one, sends it to every process of a
        # supervised worker, and the supervisor passes its own on as well.
        self.stop(force=self._stopping.is_set() and signum == signal.SIGINT)

    @property
    def draining(self) -> bool:
        """True once a stop was asked for."""
        return self._stopping.is_set()

    async def run(self) -> None:
        """Connect, bind the subscriptions, process until stopped, then drain.

        Until ready, every call to PostgreSQL or NATS waits for the servers
        (:mod:`eop.runtime.startup`); a stop meanwhile ends the run at once.
        With ``metrics_port`` set, ``/metrics``, ``/healthz`` and ``/readyz``
        are served from before connecting until the worker has stopped.
        When NATS refuses the worker's credentials on ``nats_auth_refusals``
        reconnects in a row, or closes its connection for good, the worker
        stops as on SIGTERM and raises :class:`~eop.errors.NatsReauthenticationFailed`
        (or :class:`~eop.errors.NatsUnavailable`); misconfigured, a ConfigurationError.
        """
        await self.telemetry.start()
        try:
            await self._run()
        except startup.Stopped:
            startup.stopped("worker")
            await self._dispose()  # its pools closed, as a worker that ran closes them
        except Exception as exc:
            if self._lost is None:
                raise
            # Whatever failed after the worker gave up follows from why it did.
            raise self._lost from exc
        finally:
            await self.telemetry.close()
        if self._lost is not None:
            raise self._lost

    async def _run(self) -> None:
        s = self.settings
        self._logger.info(
            log.Event.WORKER_STARTING,
            nats=redaction.redact_urls(s.nats_url),
            database=redaction.redact_url(s.database_url),
            handlers=[spec.name for spec in self.specs],
            concurrency=s.concurrency,
            batch=s.batch,
        )
        name = f"eop-worker-{'-'.join(sp.name for sp in self.specs)}"
        # Each call to the servers until ready waits for them (eop.runtime.startup).
        wait = self._startup
        await wait(lambda: migrate.ensure_ready(self.app.engine, s.schema))
        nc = await wait(lambda: jetstream.connect(s, name=name, on_lost=self._give_up))
        self.nats = nc
        store = self.app.make_store()
        try:
            js = nc.jetstream()
            epochs = jetstream.StreamEpochs(nc)
            acker = ack.Acker(nc)
            loops = []
            compacting: list[asyncio.Task[None]] = []
            # From every handler of the app, not only this worker's: whichever process
            # creates a stream first must give it the partition transform it needs.
            transforms = self._transforms = partitions.stream_transforms(self.app.handlers.values())
            for spec in self.specs:
                proc = processor.Processor(
                    # The handler as the observer sees it run (timed, traced).
                    spec=observe.instrument(spec, self._observer),
                    settings=s,
                    store=store,
                    epochs=epochs,
                    critical=self._critical,
                    observer=self._observer,
                    acker=acker,
                    leases=self._leases,
                    suspects=self._suspects,
                    stopping=self._stopping,
                    misconfigured=self._watch,
                )
                await wait.streams(js, [self.app.stream_spec(spec.stream)], transforms)
                floor = names = None
                if spec.order_by is not None:
                    runner = await self._ordered(nc, js, spec, proc, store)
                    floor, names = runner.floor, runner.owners.consumers
                compactor = compaction.Compactor(js, store, spec, epochs, floor=floor)
                # The watermark row before fetching; a failure only delays compaction.
                await compactor.quietly(compactor.prepare)
                if spec.order_by is not None:
                    loops.append(asyncio.create_task(self._runners[spec.name].run()))
                else:
                    sub = await wait.bind(nc, js, spec)
                    loops.append(asyncio.create_task(self._fetch_loop(js, spec, sub, proc)))
                if proc.parks:
                    loops.append(asyncio.create_task(self._retry_loop(store, proc)))
                if s.compaction_interval_s > 0:
                    self._compactors[spec.name] = compactor
                    compacting.append(
                        asyncio.create_task(
                            compactor.run_forever(s.compaction_interval_s, self._stopping)
                        )
                    )
                watch = unacked.UnackedWatch(nc, self.app.engine, s, spec, self._observer, names)
                compacting.append(asyncio.create_task(watch.run_forever(self._stopping)))
            # The streams only the outbox publishes to, before anything is published.
            await wait.streams(js, self.app.streams.values(), transforms)
            relaying: list[asyncio.Task[None]] = []
            if s.relay:
                self.relay = relay.Relay(
                    self.app.engine,
                    JetStreamPublisher(nc, s),
                    s,
                    observer=self._observer,
                    misconfigured=self._watch,
                )
                relaying.append(asyncio.create_task(self.relay.run(self._stopping)))
            self._logger.info(log.Event.WORKER_STARTED)
            self.ready.set()
            await self._stopping.wait()
            self._logger.info(log.Event.WORKER_STOPPING, inflight=len(self._inflight))
            # A compaction round raising the watermark waits for every open claim's
            # transaction (they read it FOR SHARE): awaited here, it would hold the
            # grace back for as long as the slowest handler runs. A stopping worker
            # needs no round; a cancelled one rolls back, and the next worker's redoes it.
            for task in compacting:
                task.cancel()
            await asyncio.gather(*loops, *compacting, return_exceptions=True)
            # The relay's last round and its lease run beside the in-flight messages'
            # grace, not before it: a relay waiting on PostgreSQL must not eat the grace.
            await self._finish_inflight()
            # Given up once their lanes are done, so that the other processes take them
            # over at their next tick rather than when the leases run out.
            for runner in self._runners.values():
                await runner.leave(clean=not self.cancelled)
            await asyncio.gather(*relaying, return_exceptions=True)
        finally:
            await self._critical.drain()
            await self._leases.close()
            # Not nc.drain(): it waits on the pull subscriptions' inboxes until its
            # own timeout. Every ack was confirmed already; flush sends the naks
            # (unless NATS gave up on the worker: they could never be sent).
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError, OSError):
                if not isinstance(self._lost, errors.NatsUnavailable):
                    await nc.flush(timeout=2)
            # A connection that is down may fail to write what it still had pending
            # (naks): those messages come back after their AckWait anyway.
            await connection.close_quietly(nc)
            store.close()
            self.abandoned_threads = store.abandoned_threads
            await self._dispose()
        self._logger.info(
            log.Event.WORKER_STOPPED,
            processed=self.processed,
            cancelled=self.cancelled,
            abandoned_threads=self.abandoned_threads,
        )

    async def _dispose(self) -> None:
        """Close the pools, without waiting on a connection that does not answer."""
        # The process is stopping: a connection left open closes with it.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.app.dispose(), shutdown.STOP_MARGIN_S)

    def _count(self, spec: HandlerSpec, settled: int) -> None:
        self.processed += settled
        compactor = self._compactors.get(spec.name)
        if compactor is not None:
            compactor.processed(settled)

    def install_signal_handlers(self) -> None:
        """Stop on SIGTERM and SIGINT (a second SIGINT stops at once)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    async def _ordered(
        self,
        nc: NATS,
        js: JetStreamContext,
        spec: HandlerSpec,
        proc: processor.Processor,
        store: PostgresStore,
    ) -> ordered.OrderedRunner:
        """The runner of an ordered handler's partitions in this process, prepared."""
        owners = ownership.Ownership(
            self.app.engine,
            store.tables,
            spec.name,
            spec.partitions,
            ordered.member(),
            self.settings.partition_lease_s,
        )
        runner = ordered.OrderedRunner(
            spec=spec,
            nc=nc,
            js=js,
            owners=owners,
            settings=self.settings,
            dispatch=functools.partial(self._dispatch_ordered, proc),
            take_slots=self._take_slots,
            give_slots=self._slots.give,
            stopping=self._stopping,
            observer=self._observer,
            blocked=self._blocked,
        )
        await self._startup(functools.partial(ordered.prepare, runner))
        self._runners[spec.name] = runner
        self._heads[spec.name] = heads.Heads(
            proc,
            transactions=max(self.app.connection_shares()),
            most=self.settings.batch,
            spawn=self._spawn,
            together=self.settings.batch_transactions,
        )
        return runner

    async def _fetch_loop(
        self,
        js: JetStreamContext,
        spec: HandlerSpec,
        sub: fetcher.Fetcher,
        proc: processor.Processor,
    ) -> None:
        failures = 0
        while not self._stopping.is_set():
            wanted = await self._take_slots()
            if wanted == 0:
                break
            try:
                msgs = await sub.fetch(wanted, self.settings.fetch_timeout_s)
                failures = 0
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                msgs = []
            except (nats.errors.Error, OSError) as exc:
                msgs = []
                failures += 1
                await self._recover(js, spec, exc, failures, proc)
            received_at = time.monotonic()
            self._leases.hold(msgs, proc.ack_wait_s, at=received_at)
            self._slots.give(wanted - len(msgs))
            groups = [msgs] if self.settings.batch_transactions else [[m] for m in msgs]
            for group in groups:
                if group:
                    self._spawn(self._process(proc, group, received_at))

    async def _retry_loop(self, store: PostgresStore, proc: processor.Processor) -> None:
        """Run the parked messages of ``proc``'s handler whose retry is due.

        Retries share the worker's slots with fetched messages: it waits for
        one (the fetch loop gives back what a pull did not fill), takes the
        others that are free, and looks again at once while it finds as many
        due messages as it could take.
        """
        wait_s = self.settings.retry_poll_s
        failures = 0
        while not await backoff.stopped_within(self._stopping, wait_s):
            wait_s = self.settings.retry_poll_s
            free = await self._take_slots()
            parked: list[retries.ParkedDelivery] = []
            try:
                if free:
                    parked = await retries.take_due(store, proc.spec, free, proc.ack_wait_s)
                failures = 0
            except Exception as exc:
                # The database is away: the parked messages wait there; try later.
                # One warning per outage, not one per poll.
                failures += 1
                proc.misconfigured.note(exc, f"handler {proc.spec.name!r}", self.settings)
                (self._logger.warning if failures == 1 else self._logger.debug)(
                    log.Event.RETRY_LOOP_FAILED,
                    handler=proc.spec.name,
                    failures=failures,
                    error=log.describe_error(exc)[:500],
                )
            self._slots.give(free - len(parked))
            # A poll's due retries run in one transaction (eop.protocol.retry_batch), as a
            # fetched batch does; one transaction each without batch transactions.
            polls = [parked] if self.settings.batch_transactions else [[p] for p in parked]
            taken_at = time.monotonic()
            self._leases.hold(parked, proc.ack_wait_s, at=taken_at)
            for poll in polls:
                if poll:
                    self._spawn(self._process(proc, poll, taken_at))
            if parked and len(parked) == free:
                wait_s = 0.0

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    def _dispatch_ordered(
        self,
        proc: processor.Processor,
        msgs: Sequence[Delivery],
        at: float,
        part: ordered.Partition,
    ) -> None:
        """One lane per key: a key's messages run one after another, in stream order."""
        self._leases.hold(msgs, proc.ack_wait_s, at=at)
        by_key: dict[str, list[Delivery]] = {}
        for msg in msgs:
            by_key.setdefault(ordering.key_of(proc.spec, msg), []).append(msg)
        for key, group in by_key.items():
            lane = self._lanes.get((proc.spec.name, key))
            task = self._spawn(self._process_lane(proc, key, group, at, lane, part))
            self._lanes[(proc.spec.name, key)] = task
            task.add_done_callback(functools.partial(self._end_lane, (proc.spec.name, key)))

    def _end_lane(self, key: tuple[str, str], task: asyncio.Task[Any]) -> None:
        if self._lanes.get(key) is task:
            del self._lanes[key]

    async def _process_lane(
        self,
        proc: processor.Processor,
        key: str,
        msgs: Sequence[Delivery],
        received_at: float,
        previous: asyncio.Task[Any] | None,
        part: ordered.Partition,
    ) -> None:
        """Process a key's messages in order; when one is retried, its followers wait."""
        name = proc.spec.name
        self._observer.received(proc.spec, msgs)
        try:
            # The retried message the previous lane waits for must not wait for it.
            awaited = self._blocked.blocked_seq(name, key)
            first = [m for m in msgs if awaited is not None and _seq(m) <= awaited]
            rest = [m for m in msgs if m not in first]
            if await self._run_lane(proc, key, first, received_at, part):
                while previous is not None and not previous.done():
                    # Past the lookahead they keep their slots, unless the key is blocked.
                    over = part.queued + len(rest) > self._runners[name].lookahead
                    if over and self._blocked.blocked_seq(name, key) is None:
                        await asyncio.wait({previous}, timeout=1.0)
                        continue
                    async with part.held(self._slots, len(rest), queued=True):
                        await asyncio.wait({previous})
                await self._run_lane(proc, key, rest, received_at, part)
        finally:
            # Those it did not run are left for the partition's next consumer.
            self._leases.release(msgs)
            part.inflight -= len(msgs)
            part.room.set()
            self._observer.done(proc.spec, msgs)
            self._slots.give(len(msgs))

    async def _run_lane(
        self,
        proc: processor.Processor,
        key: str,
        msgs: Sequence[Delivery],
        received_at: float,
        part: ordered.Partition,
    ) -> bool:
        """Run ``msgs`` in order; False once the partition is lost (the rest are left
        unacked: the next owner's consumer starts at or below them)."""
        name = proc.spec.name
        runner = self._runners[name]
        hold_s = self.settings.backoff_max_s + proc.ack_wait_s
        for index, msg in enumerate(msgs):
            if part.lost.is_set():
                return False
            awaited = self._blocked.blocked_seq(name, key)
            if awaited is not None and _seq(msg) > awaited:
                held = msgs[index:]
                async with part.held(self._slots, len(held)):
                    # Their leases are kept meanwhile (they are held since their fetch).
                    went_on = await self._blocked.wait(
                        name, key, len(held), lost=part.lost, stored=runner.stored, hold_s=hold_s
                    )
                if not went_on:
                    return False
            outcome = await self._heads[name].handle(msg, received_at)
            self._leases.release([msg])
            self._blocked.update(name, key, msg, outcome)
            if outcome in (Outcome.RETRY, Outcome.LEFT):
                part.keys.add(key)
            if outcome in (Outcome.PROCESSED, Outcome.DEAD_LETTERED):
                self._count(proc.spec, 1)
        return True

    async def _take_slots(self) -> int:
        """Wait for a free slot, then take as many as are free, up to the batch size."""
        if self._stopping.is_set():
            return 0
        return await self._slots.take(self.settings.batch)

    async def _recover(
        self,
        js: JetStreamContext,
        spec: HandlerSpec,
        exc: BaseException,
        failures: int,
        proc: processor.Processor,
    ) -> None:
        """A fetch failed: wait, and when the consumer or stream is gone, provision again."""
        self._logger.warning(
            log.Event.FETCH_FAILED, handler=spec.name, error=type(exc).__name__, failures=failures
        )
        await asyncio.sleep(backoff.backoff_s(failures, _FETCH_RETRY_FIRST_S, _FETCH_RETRY_MAX_S))
        if (
            isinstance(exc, (nats.js.errors.APIError, nats.errors.NoRespondersError))
            or failures > 3
        ):
            with contextlib.suppress(
                errors.EopError, nats.errors.Error, OSError, asyncio.TimeoutError
            ):
                await jetstream.ensure_stream(
                    js,
                    self.app.stream_spec(spec.stream),
                    create=self.settings.create,
                    transform=self._transforms.get(spec.stream),
                )
                await consumers.ensure_consumer(
                    js, spec, self.settings, create=self.settings.create
                )
                await proc.epochs.refresh(spec.stream)
                self._logger.info(log.Event.SUBSCRIPTION_BOUND, handler=spec.name, rebound=True)

    async def _process(
        self, proc: processor.Processor, msgs: Sequence[Delivery], received_at: float
    ) -> None:
        """Process one message, a batch in one transaction, or a poll's due retries in one;
        release their slots."""
        self._observer.received(proc.spec, msgs)
        try:
            parked = [m for m in msgs if isinstance(m, retries.ParkedDelivery)]
            if len(parked) == 1:
                outcomes = [await proc.retry_parked(parked[0])]
            elif parked:
                outcomes = await self._together(proc, retry_batch.RetryBatch(proc).run(parked))
            elif len(msgs) == 1:
                outcomes = [await proc.handle(msgs[0], received_at)]
            else:
                handled = batch.BatchProcessor(proc).handle_batch(msgs, received_at)
                outcomes = await self._together(proc, handled)
            settled = (Outcome.PROCESSED, Outcome.DEAD_LETTERED)
            self._count(proc.spec, sum(1 for o in outcomes if o in settled))
            self._log_batch(proc, msgs, outcomes)
        except Exception as exc:
            await self._failed(proc, msgs, exc)
        finally:
            self._leases.release(msgs)
            self._observer.done(proc.spec, msgs)
            self._slots.give(len(msgs))

    async def _together(
        self, proc: processor.Processor, settling: Awaitable[list[Outcome]]
    ) -> list[Outcome]:
        """The outcomes of a batch (or a poll's retries) settled together; the messages it
        could not settle (:class:`batch.Unsettled`) are nak'ed, each alone."""
        try:
            return await settling
        except batch.Unsettled as unsettled:
            for delivery, exc in unsettled.failed:
                await self._failed(proc, [delivery], exc)
            return unsettled.outcomes

    async def _failed(
        self, proc: processor.Processor, msgs: Sequence[Delivery], exc: Exception
    ) -> None:
        """Not a handler failure (those are settled in the protocol) but eop's own I/O
        failing beyond its retries: log it, and let the messages come back later."""
        self._logger.error(
            log.Event.MESSAGE_FAILED,
            handler=proc.spec.name,
            error=log.describe_error(exc)[:2000],
        )
        self._observer.errored(proc.spec, msgs, exc)
        for msg in msgs:
            await ack.nak(msg, self.settings.backoff_max_s, self._logger)

    def _log_batch(
        self, proc: processor.Processor, msgs: Sequence[Delivery], outcomes: list[Outcome]
    ) -> None:
        """One info line per batch (the per-message lines are debug lines)."""
        if not log.enabled(logging.INFO):
            return
        counts = collections.Counter(o.value for o in outcomes)
        first, last = msgs[0].metadata, msgs[-1].metadata
        self._logger.info(
            log.Event.BATCH_PROCESSED,
            handler=proc.spec.name,
            stream=first.stream,
            first_seq=first.sequence.stream,
            last_seq=last.sequence.stream,
            messages=len(msgs),
            **counts,
        )

    async def _finish_inflight(self) -> None:
        """Wait for in-flight messages, up to the grace period or a second stop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.shutdown_grace_s
        pending: set[asyncio.Future[Any]] = set(self._inflight)
        force = asyncio.ensure_future(self._force.wait())
        try:
            while pending and not force.done() and loop.time() < deadline:
                _, pending = await asyncio.wait(
                    pending | {force},
                    timeout=deadline - loop.time(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                # With the ones started since (an ordered handler's lanes' batches).
                pending = (pending | self._inflight) - {force}
        finally:
            force.cancel()
        # Cancelling a handler rolls its transaction back and leaves the message
        # for redelivery; a COMMIT already under way finishes in Critical. A sync
        # handler's thread cannot be cancelled: its task ends at once all the
        # same, and the thread is left to transactions.SyncTransaction and eop.runtime.shutdown.
        self.cancelled = len(pending)
        for task in pending:
            task.cancel()
        if pending:
            # Bounded: a handler that swallows its cancellation must not hold the stop.
            await asyncio.wait(pending, timeout=shutdown.STOP_MARGIN_S)


def _seq(msg: Delivery) -> int:
    return int(msg.metadata.sequence.stream)


async def run_worker(
    app: App,
    *,
    handlers: Iterable[str] = (),
    exit_hard: bool = False,
    report_to: str | None = None,
) -> int:
    """Run a worker with signal handlers installed; the exit status (:mod:`eop.runtime.shutdown`).

    With ``exit_hard`` (what ``eop worker`` does) a stop always ends the
    process: by :func:`os._exit` when a handler's thread is still running once
    the worker has stopped, or when the stop overruns its deadline.
    """
    worker = Worker(app, handlers=handlers, report_to=report_to)
    worker.install_signal_handlers()
    if exit_hard:
        worker.on_stop.append(shutdown.Watchdog(shutdown.deadline_s(app.settings)).arm)
    freezing = asyncio.create_task(_freeze_when_ready(worker))
    try:
        await worker.run()
    finally:
        freezing.cancel()
    if exit_hard:
        await _end_threads(worker)
    return shutdown.EXIT_STOPPED


async def _freeze_when_ready(worker: Worker) -> None:
    """Once the worker is ready, keep what it holds for good out of the collector's way.

    Python's full collection walks every object that survived the younger
    ones; a worker's modules, engines and caches are about 90,000 of them, and
    each full collection took 45-55 ms of CPU, every few seconds at full
    rate: a stall of every message in flight. ``gc.freeze`` moves the
    objects alive now out of the collections; later garbage is collected as
    before. Only ``eop worker``'s own processes do this, not a worker hosted
    in another application's process.
    """
    await worker.ready.wait()
    gc.collect()
    gc.freeze()


async def _end_threads(worker: Worker) -> None:
    """Exit at once when threads that cannot be stopped would keep the process alive.

    The worker has stopped: every COMMIT under way has been acked, the
    connections are closed. Python would now wait for every thread, and a
    handler that never returns would keep the process alive for ever.
    """
    if worker.abandoned_threads:
        shutdown.exit_now(shutdown.EXIT_FORCED, "handler_threads", threads=worker.abandoned_threads)
    # asyncio.run waits for the default executor's threads (an async handler's
    # asyncio.to_thread) without a bound before Python 3.12: wait here, bounded.
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(loop.shutdown_default_executor(), shutdown.STOP_MARGIN_S)
    except asyncio.TimeoutError:
        shutdown.exit_now(shutdown.EXIT_FORCED, "executor_threads")
