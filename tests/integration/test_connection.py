"""What eop's NATS connection tells the operator about the server coming and going."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from eop import jetstream, log
from eop.settings import Settings

from .bed import wait_for

if TYPE_CHECKING:
    from eop import embedded


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
