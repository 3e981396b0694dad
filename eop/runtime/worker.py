"""The worker: pulls each handler's durable consumer and runs the protocol.

Several worker processes may share one durable consumer. An ordered
handler's partitions are shared out among the processes that run it, each
with a consumer of its own (:mod:`eop.ordering.share`). A stop (SIGTERM,
SIGINT, or a host's :meth:`~eop.runtime.hosting.Hosted.shutdown`) stops
fetching, lets in-flight messages finish within the grace period, and never
cuts between a COMMIT and its ack.

This module is the worker's life: its start (the servers waited for, the
streams and consumers bound, each handler's loops started, the outbox
relay), its stop and what it closes. The loops are their own modules: an
unordered handler's fetch loop (:mod:`eop.runtime.unordered`), an ordered
handler's lanes (:mod:`eop.ordering.lanes`), the parked retries'
(:mod:`eop.runtime.parked`), all sharing the worker's messages in flight
(:mod:`eop.runtime.inflight`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import nats.errors

from eop import errors, futures, log, redaction
from eop.app import App, select_handlers
from eop.broker import ack, client, connection, jetstream, leases
from eop.handler import HandlerSpec
from eop.observe import observer as observe
from eop.ordering import lanes, partitions
from eop.outbox import relay
from eop.outbox.jetstream_publisher import JetStreamPublisher
from eop.pg import migrate
from eop.pg.store import PostgresStore
from eop.protocol import compaction, misconfiguration, processor, unacked
from eop.runtime import hosting, inflight, parked, shutdown, slots, startup, telemetry, unordered

if TYPE_CHECKING:
    import prometheus_client


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
        """Set once every subscription is bound and fetching has started; cleared when
        the worker stops (asked to, or by itself)."""
        self._stopping = asyncio.Event()
        self._startup = startup.Patience(self.settings, self._stopping)
        self._force = asyncio.Event()
        self._slots = slots.Slots(self.settings.concurrency)
        self._critical = processor.Critical()
        self._suspects = asyncio.Lock()
        # Every delivery from its fetch to its settlement: the one place leases are kept.
        self._leases = leases.Leases()
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
        self._flight = inflight.InFlight(
            self.settings,
            slots=self._slots,
            leases=self._leases,
            stopping=self._stopping,
            observer=self._observer,
            logger=self._logger,
            count=self._count,
        )
        self._lanes = lanes.Lanes(self._flight)
        self._runners = self._lanes.runners
        self.on_stop: list[Callable[[], None]] = []
        """Called once, when a stop is first asked for (``eop worker`` arms its watchdog)."""
        self.cancelled = 0
        """In-flight messages a stop cancelled after the grace period (left for redelivery)."""
        self.abandoned_threads = 0
        """Threads still running a sync handler after the stop (:mod:`eop.runtime.shutdown`)."""
        self.abandoned_commits = 0
        """COMMITs (with their acks) still waiting on a server ``ack_give_up_s + 5`` s after
        the grace: left to end by themselves, their messages redelivered."""
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
            # Ready means fetching: a readiness check built on it goes red at once.
            self.ready.clear()
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

    async def readiness(self) -> dict[str, bool]:
        """What ``eop worker``'s ``/readyz`` checks, each with whether it holds: every
        subscription bound, not stopping, NATS connected, PostgreSQL answering (a
        ping, at most one at a time, when no outcome showed it lately). Ready when all
        hold: for the readiness probe of an application that embeds the worker."""
        return await self.telemetry.readiness.check()

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
        loops: list[asyncio.Task[None]] = []
        compacting: list[asyncio.Task[None]] = []
        relaying: list[asyncio.Task[None]] = []
        try:
            try:
                await self._start(nc, store, loops, compacting, relaying)
            except startup.Stopped:
                # Stopped while a later handler's servers were waited for: the loops
                # started already may hold messages, which finish as on any stop.
                if not loops:
                    raise
                startup.stopped("worker")
            else:
                self._logger.info(log.Event.WORKER_STARTED)
                self.ready.set()
                await self._stopping.wait()
                self.ready.clear()  # set just above by a start a stop overtook
            # The grace counts from the stop, whatever the loops' own ends take.
            grace_until = asyncio.get_running_loop().time() + s.shutdown_grace_s
            self._logger.info(log.Event.WORKER_STOPPING, inflight=len(self._flight.tasks))
            # A compaction round raising the watermark waits for every open claim's
            # transaction (they read it FOR SHARE): awaited here, it would hold the
            # grace back for as long as the slowest handler runs. A stopping worker
            # needs no round; a cancelled one rolls back, and the next worker's redoes it.
            for task in compacting:
                task.cancel()
            await self._end_loops([*loops, *compacting], grace_until)
            # The relay's last round and its lease run beside the in-flight messages'
            # grace, not before it: a relay waiting on PostgreSQL must not eat the grace.
            await self._finish_inflight(grace_until)
            # Given up once their lanes are done, so that the other processes take them
            # over at their next tick rather than when the leases run out.
            for runner in self._runners.values():
                await runner.leave(clean=not self.cancelled)
            await asyncio.gather(*relaying, return_exceptions=True)
        finally:
            # A COMMIT's ack gives up within ack_give_up_s: a section still running past
            # it waits on a server that does not answer, and must not hold the stop.
            self.abandoned_commits = await self._critical.drain(
                s.ack_give_up_s + shutdown.STOP_MARGIN_S
            )
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
            abandoned_commits=self.abandoned_commits,
        )

    async def _start(
        self,
        nc: client.Client,
        store: PostgresStore,
        loops: list[asyncio.Task[None]],
        compacting: list[asyncio.Task[None]],
        relaying: list[asyncio.Task[None]],
    ) -> None:
        """Bind each handler and start its loops, compaction and watch, then the relay;
        each task is added to its list as it starts, so that a stop meanwhile drains them."""
        s, wait = self.settings, self._startup
        js = nc.jetstream()
        epochs = jetstream.StreamEpochs(nc)
        acker = ack.Acker(nc, self._stopping)
        # From every handler of the app, not only this worker's: whichever process
        # creates a stream first must give it the partition transform it needs.
        transforms = partitions.stream_transforms(self.app.handlers.values())
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
                runner = await self._lanes.add(self.app, nc, js, spec, proc, store, wait, epochs)
                floor, names = runner.floor, runner.owners.consumers
            compactor = compaction.Compactor(
                js,
                store,
                spec,
                epochs,
                floor=floor,
                noted=self._watch.noting(f"compaction of handler {spec.name!r}", s),
            )
            # The watermark row before fetching; a failure only delays compaction.
            await compactor.quietly(compactor.prepare)
            if spec.order_by is not None:
                loops.append(asyncio.create_task(self._runners[spec.name].run()))
            else:
                sub = await wait.bind(nc, js, spec)
                fetching = unordered.Unordered(
                    self._flight, self.app, transforms, js, spec, sub, proc, epochs
                )
                loops.append(asyncio.create_task(fetching.run()))
            if proc.parks:
                loops.append(asyncio.create_task(parked.retry_loop(self._flight, store, proc)))
            if s.compaction_interval_s > 0:
                self._compactors[spec.name] = compactor
                compacting.append(
                    asyncio.create_task(
                        compactor.run_forever(s.compaction_interval_s, self._stopping)
                    )
                )
            watch = unacked.UnackedWatch(
                nc,
                self.app.engine,
                s,
                spec,
                self._observer,
                names,
                noted=self._watch.noting(f"the stuck-delivery watch of handler {spec.name!r}", s),
            )
            compacting.append(asyncio.create_task(watch.run_forever(self._stopping)))
        # The streams only the outbox publishes to, before anything is published.
        await wait.streams(js, self.app.streams.values(), transforms)
        if s.relay:
            self.relay = relay.Relay(
                self.app.engine,
                JetStreamPublisher(nc, s),
                s,
                observer=self._observer,
                misconfigured=self._watch,
            )
            relaying.append(asyncio.create_task(self.relay.run(self._stopping)))

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

    async def _end_loops(self, tasks: list[asyncio.Task[None]], deadline: float) -> None:
        """Wait for the loops to end, until the grace's end (the loop's ``deadline``): one
        still waiting then on a server that does not answer (a parked retries' poll on a
        frozen PostgreSQL) is cancelled, as the in-flight messages are just after."""
        if not tasks:
            return
        loop = asyncio.get_running_loop()
        _, pending = await asyncio.wait(tasks, timeout=max(deadline - loop.time(), 0.0))
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=shutdown.STOP_MARGIN_S)
        for task in tasks:
            futures.retrieve(task)  # as gather(return_exceptions=True) did

    async def _finish_inflight(self, deadline: float) -> None:
        """Wait for in-flight messages, up to the grace's end (the loop's ``deadline``) or
        a second stop."""
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Future[Any]] = set(self._flight.tasks)
        force = asyncio.ensure_future(self._force.wait())
        try:
            while pending and not force.done() and loop.time() < deadline:
                _, pending = await asyncio.wait(
                    pending | {force},
                    timeout=deadline - loop.time(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                # With the ones started since (an ordered handler's lanes' batches).
                pending = (pending | self._flight.tasks) - {force}
        finally:
            force.cancel()
        # Cancelling a handler rolls its transaction back and leaves the message
        # for redelivery; a COMMIT already under way finishes in Critical. A sync
        # handler's thread cannot be stopped from outside: its task cancels the
        # statement the thread waits on (eop.pg.bridge), which then returns; a thread
        # blocked in code of its own is left to its transaction and eop.runtime.shutdown.
        self.cancelled = len(pending)
        for task in pending:
            task.cancel()
        if pending:
            # Bounded: a handler that swallows its cancellation must not hold the stop.
            await asyncio.wait(pending, timeout=shutdown.STOP_MARGIN_S)


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
