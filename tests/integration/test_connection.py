"""What eop's NATS connection tells the operator about the server coming and going."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop
from eop import errors, log
from eop.broker import client, jetstream
from eop.pg import failures
from eop.settings import Settings

from .bed import (
    STREAM,
    SUBJECT,
    bed_settings,
    create_effects_table,
    debug_logs,
    drained,
    effects_by_body,
    publish,
    record_effect,
    running,
    wait_for,
)

if TYPE_CHECKING:
    from eop.tools import embedded


async def test_a_lost_server_is_logged_as_a_disconnect_but_closing_ourselves_is_not(
    nats_server: embedded.NatsServer,
) -> None:
    """`nats.disconnected` means the server went away, never that eop closed its connection."""
    settings = Settings.from_env(environ={}, overrides={"nats_url": nats_server.url})

    def disconnects(logs: list[dict[str, object]]) -> int:
        return sum(1 for e in logs if e["event"] == str(log.Event.NATS_DISCONNECTED))

    with structlog.testing.capture_logs() as logs:
        nc = await jetstream.connect(settings)
        await nc.close()
        await asyncio.sleep(0)
        assert disconnects(logs) == 0

        nc = await jetstream.connect(settings)
        try:
            nats_server.stop()

            async def logged() -> bool:
                return disconnects(logs) == 1

            await wait_for(logged, what="the disconnect to be logged")
        finally:
            await nc.close()


def _logged(logs: list[dict[str, object]], event: log.Event) -> int:
    return sum(1 for e in logs if e["event"] == str(event))


async def test_an_outage_logs_one_nats_error_warning_and_counts_the_rest_on_reconnection(
    nats_server: embedded.NatsServer,
) -> None:
    """While NATS is down every reconnect attempt fails, twice a second or so: after the
    `nats.disconnected` warning (and the error that ended the connection, if any) those
    failures are debug lines, and `nats.reconnected` counts them. A second outage is
    told of the same way."""
    settings = Settings.from_env(environ={}, overrides={"nats_url": nats_server.url})

    def nats_errors(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
        return [e for e in logs if e["event"] == str(log.Event.NATS_ERROR)]

    with debug_logs() as logs:
        nc = await jetstream.connect(settings)
        try:
            for outage in (1, 2):
                before, start = len(nats_errors(logs)), len(logs)
                nats_server.stop()

                async def failing(before: int = before) -> bool:
                    return len(nats_errors(logs)) >= before + 3

                await wait_for(failing, what="three failed reconnect attempts")
                nats_server.start()

                async def back(outage: int = outage) -> bool:
                    return _logged(logs, log.Event.NATS_RECONNECTED) == outage

                await wait_for(back, what="the reconnection")
                outage_lines = logs[start:]
                down = [e["event"] for e in outage_lines].index("nats.disconnected")
                warned = [e for e in outage_lines[:down] if e["event"] == "nats.error"]
                during = [e for e in outage_lines[down:] if e["event"] == "nats.error"]
                assert [e["log_level"] for e in warned] in ([], ["warning"])
                assert len(during) >= 2
                assert {e["log_level"] for e in during} == {"debug"}
                reconnected = [e for e in logs if e["event"] == "nats.reconnected"][-1]
                assert reconnected["failed_attempts"] == len(during)
        finally:
            await nc.close()


async def test_a_read_loop_ended_while_connected_is_logged_and_the_worker_reconnects(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The reading task of a live connection cancelled: logged, reconnected, processing goes on.

    The connection still says it is connected but reads nothing; the worker
    must notice rather than wait for messages that never come.
    """
    await create_effects_table(engine)
    app = eop.App(settings=bed_settings(database_url, nats_url))
    app.stream(STREAM, subjects=["ORDERS.>"])

    @app.handler(stream=STREAM, subject=SUBJECT, name="reader")
    async def handle(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "reader", msg)

    with structlog.testing.capture_logs() as logs:
        async with running(app) as worker:
            await publish(js, "before")
            await wait_for(lambda: drained(js, "eop-reader"), what="the first message")
            nc = worker.nats
            nc._reading_task.cancel()

            async def recovered() -> bool:
                return _logged(logs, log.Event.NATS_RECONNECTED) == 1 and nc.is_connected

            await wait_for(recovered, what="the reconnection")
            assert _logged(logs, log.Event.NATS_READER_ENDED) == 1
            assert client.reading(nc)
            await publish(js, "after")
            await wait_for(lambda: drained(js, "eop-reader"), what="the message after")
    assert await effects_by_body(engine) == {"before": 1, "after": 1}


async def test_a_read_loop_ended_without_reconnects_allowed_closes_and_reports_it(
    nats_server: embedded.NatsServer,
) -> None:
    """Reconnecting not allowed: the dead read loop closes the connection; on_lost is told."""
    settings = Settings.from_env(environ={}, overrides={"nats_url": nats_server.url})
    lost: list[errors.NatsUnavailable] = []
    nc = await jetstream.connect(settings, on_lost=lost.append)
    try:
        nc.options["allow_reconnect"] = False
        nc._reading_task.cancel()

        async def reported() -> bool:
            return bool(lost)

        await wait_for(reported, what="the loss to be reported")
        assert "stopped reading" in str(lost[0])
        assert nc.is_closed
    finally:
        await nc.close()


@pytest.mark.parametrize("driver", ["postgresql+asyncpg", "postgresql+psycopg"])
async def test_eops_own_connections_name_themselves_in_pg_stat_activity(
    database_url: str, driver: str
) -> None:
    """Both of eop's engines connect as application_name 'eop', so operators can find them,
    with either async driver (psycopg takes no asyncpg options)."""
    url = sa.make_url(database_url).set(drivername=driver).render_as_string(hide_password=False)
    app = eop.App(settings=Settings(database_url=url))
    query = sa.text("SELECT current_setting('application_name')")
    try:
        async with app.engine.connect() as conn:
            assert (await conn.execute(query)).scalar() == "eop"
        with app.sync_sessionmaker() as session:
            assert session.execute(query).scalar() == "eop"
    finally:
        await app.dispose()


@pytest.mark.timeout(45)
@pytest.mark.parametrize("driver", ["postgresql+asyncpg", "postgresql+psycopg"])
async def test_a_database_host_that_never_answers_fails_each_attempt_within_the_timeout(
    driver: str,
) -> None:
    """A host that takes the TCP connection and never answers (a server frozen, packets
    dropped past a load balancer) fails each of eop's connection attempts once
    ``db_connect_timeout_s`` has passed, as an unreachable database that eop retries;
    asyncpg would wait a minute by itself and libpq for ever (the test's own timeout)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshakes; nothing ever answers
        port = silent.getsockname()[1]
        url = f"{driver}://postgres@127.0.0.1:{port}/postgres"
        app = eop.App(settings=Settings(database_url=url, db_connect_timeout_s=0.5))
        try:
            with pytest.raises((OSError, sa.exc.OperationalError)) as waited:
                async with app.engine.connect():
                    pass
            assert failures.unreachable(waited.value), repr(waited.value)
            with (
                pytest.raises((OSError, sa.exc.OperationalError)) as waited_sync,
                app.sync_sessionmaker() as session,
            ):
                session.execute(sa.text("SELECT 1"))
            assert failures.unreachable(waited_sync.value), repr(waited_sync.value)
        finally:
            await app.dispose()
