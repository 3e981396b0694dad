"""``eop relay``: the outbox relay in a process of its own, until SIGTERM or SIGINT.

For apps that add to the outbox but run no handlers (a web service), or that
run their workers with ``relay`` off. Any number may run beside the workers'
relays: the one holding the lease publishes (:mod:`eop.protocol.relay`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

from eop import errors, log, redaction
from eop.app import App
from eop.broker import connection, jetstream
from eop.pg import migrate
from eop.protocol import relay
from eop.runtime import shutdown, startup


async def run_relay(app: App) -> int:
    """Run a relay until a stop signal; the exit status (:mod:`eop.runtime.shutdown`).

    Stops as a worker does when NATS gives up on it (credentials refused).
    """
    s = app.settings
    logger = log.get_logger()
    stopping = asyncio.Event()
    lost: list[errors.NatsUnavailable] = []

    def nats_lost(error: errors.NatsUnavailable) -> None:
        lost.append(error)
        logger.error(log.Event.NATS_CLOSED, error=str(error))
        stopping.set()

    loop = asyncio.get_running_loop()
    watchdog = shutdown.Watchdog(s.publish_timeout_s * 2 + shutdown.STOP_MARGIN_S)

    def stop() -> None:
        watchdog.arm()
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    logger.info(
        log.Event.WORKER_STARTING,
        nats=redaction.redact_urls(s.nats_url),
        database=redaction.redact_url(s.database_url),
        relay_only=True,
    )
    await startup.retrying(lambda: migrate.ensure_ready(app.engine, s.schema), s)
    nc = await startup.retrying(
        lambda: jetstream.connect(s, name="eop-relay", on_lost=nats_lost), s
    )
    try:
        logger.info(log.Event.WORKER_STARTED)
        await relay.Relay(app.engine, nc, s).run(stopping)
    finally:
        with contextlib.suppress(Exception):
            await nc.flush(timeout=2)
        await connection.close_quietly(nc)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(app.dispose(), shutdown.STOP_MARGIN_S)
    if lost:
        raise lost[0]
    logger.info(log.Event.WORKER_STOPPED)
    return shutdown.EXIT_STOPPED
