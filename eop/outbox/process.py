"""``eop relay``: the outbox relay in a process of its own, until SIGTERM or SIGINT.

For apps that add to the outbox but run no handlers (a web service), or that
run their workers with ``relay`` off. Any number may run beside the workers'
relays: the one holding the lease publishes (:mod:`eop.outbox.relay`).
With ``metrics_port`` set it serves ``/metrics`` (the ``eop_outbox_*``
series), ``/healthz`` and ``/readyz`` as a worker does.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Sequence
from typing import Any

from eop import errors, log, redaction
from eop.app import App
from eop.broker import connection, jetstream
from eop.handler import HandlerSpec
from eop.ordering import partitions
from eop.outbox import relay
from eop.outbox.jetstream_publisher import JetStreamPublisher
from eop.pg import migrate
from eop.protocol import misconfiguration
from eop.runtime import shutdown, startup, telemetry
from eop.settings import Settings


class RelayProcess:
    """A relay's process, as telemetry sees it (:class:`eop.runtime.telemetry.Observed`)."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.settings: Settings = app.settings
        self.specs: Sequence[HandlerSpec] = ()
        self.ready = asyncio.Event()
        """Set once connected to both servers and relaying."""
        self.nats: Any = None
        self.stopping = asyncio.Event()
        self.lost: errors.EopError | None = None
        """Why the relay stopped by itself: NATS gave up on it, or it is misconfigured."""

    @property
    def draining(self) -> bool:
        """Whether a stop was asked for."""
        return self.stopping.is_set()

    def nats_lost(self, error: errors.NatsUnavailable) -> None:
        """NATS gave up on the relay (credentials refused): stop, then exit with the error.

        Logged as the worker logs it: ``nats.auth_refused`` for credentials
        refused again and again, ``nats.closed`` for a connection closed for good.
        """
        if self.lost is None:
            logger = log.get_logger()
            if isinstance(error, errors.NatsReauthenticationFailed):
                logger.error(log.Event.NATS_AUTH_REFUSED, refusals=error.refusals, error=str(error))
            else:
                logger.error(log.Event.NATS_CLOSED, error=str(error))
        self.give_up(error)

    def give_up(self, error: errors.EopError) -> None:
        """Stop, then exit with ``error`` (the first one): NATS gave up on the relay, or its
        database is misconfigured (:mod:`eop.protocol.misconfiguration`, logged there)."""
        self.lost = self.lost or error
        self.stopping.set()


async def run_relay(app: App) -> int:
    """Run a relay until a stop signal; the exit status (:mod:`eop.runtime.shutdown`)."""
    s = app.settings
    logger = log.get_logger()
    process = RelayProcess(app)
    watchdog = shutdown.Watchdog(s.publish_timeout_s * 2 + shutdown.STOP_MARGIN_S)

    def stop() -> None:
        watchdog.arm()
        process.stopping.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    logger.info(
        log.Event.RELAY_STARTING,
        nats=redaction.redact_urls(s.nats_url),
        database=redaction.redact_url(s.database_url),
    )
    reports = telemetry.Telemetry(process)
    await reports.start()
    try:
        await _relay(app, process, reports.observer)
    except startup.Stopped:
        startup.stopped("relay")
    finally:
        await reports.close()
    if process.lost is not None:
        raise process.lost
    return shutdown.EXIT_STOPPED


async def _relay(app: App, process: RelayProcess, observer: Any) -> None:
    s = app.settings
    # Until ready, each call to the servers waits for them (eop.runtime.startup).
    wait = startup.Patience(s, process.stopping)
    await wait(lambda: migrate.ensure_ready(app.engine, s.schema))
    nc = await wait(lambda: jetstream.connect(s, name="eop-relay", on_lost=process.nats_lost))
    process.nats = nc
    try:
        js = nc.jetstream()
        # A stream this relay creates first gets the partition transform its ordered
        # handlers need (eop.ordering.partitions).
        transforms = partitions.stream_transforms(app.handlers.values())
        await wait.streams(js, app.streams.values(), transforms)
        log.get_logger().info(log.Event.RELAY_STARTED)
        process.ready.set()
        watch = misconfiguration.Watch(stop=process.give_up)
        publisher = JetStreamPublisher(nc, s)
        await relay.Relay(app.engine, publisher, s, observer=observer, misconfigured=watch).run(
            process.stopping
        )
    finally:
        with contextlib.suppress(Exception):
            await nc.flush(timeout=2)
        await connection.close_quietly(nc)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(app.dispose(), shutdown.STOP_MARGIN_S)
