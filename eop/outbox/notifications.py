"""The outbox's NOTIFY heard by its relay: a LISTEN connection held while the relay leads.

An insert into the outbox notifies ``<schema>_outbox`` on COMMIT (a trigger of
migration ``eop_0006``), so a leading relay wakes as soon as a row commits.
LISTEN needs asyncpg, a connection of its own (one the pool can spare, or the
rounds would wait for it) and a server connection that stays the relay's (not
through a transaction-mode pooler); without any of them the relay polls every
``outbox_poll_s``, which finds the same rows, later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.pool import QueuePool

from eop import log
from eop.pg import engines, failures, models
from eop.settings import Settings


class Listener:
    """LISTENs on the outbox's channel of ``settings.schema``; ``heard`` on each NOTIFY."""

    def __init__(
        self,
        engine: AsyncEngine,
        settings: Settings,
        heard: Callable[[], None],
        *,
        logger: log.Logger | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self._heard = heard
        self._logger = logger or log.get_logger()
        self._connection: AsyncConnection | None = None
        self._polls_only = False
        """Set once a transaction-mode pooler was found: no LISTEN, rounds poll."""

    async def listen(self) -> None:
        """LISTEN, unless already listening (asyncpg only, and only with a connection to
        spare for the rounds; else rounds poll)."""
        listener = self._connection
        if listener is not None:
            raw = await listener.get_raw_connection()
            driver: Any = raw.driver_connection
            if driver is not None and not driver.is_closed():
                return
            await self.close()
        if (
            self.engine.dialect.driver != "asyncpg"
            or self._polls_only
            or not _spares_a_connection(self.engine)
        ):
            return
        conn = await failures.connected(self.engine.connect())
        try:
            # Through a transaction-mode pooler the server connection serves
            # other clients after each transaction: a LISTEN would hear for them.
            if await engines.transaction_pooled(conn, self.settings.db_pooler):
                self._polls_only = True
                self._logger.info(log.Event.RELAY_POLLING, poll_s=self.settings.outbox_poll_s)
                await conn.close()
                return
            raw = await conn.get_raw_connection()
            listening: Any = raw.driver_connection
            await listening.add_listener(
                models.outbox_channel(self.settings.schema), self._notified
            )
        except BaseException:
            # add_listener fails outside SQLAlchemy (a pooled connection that died
            # with a restart), which would hand the same connection out again: with
            # the lease renewed on a live one, the relay failed every round for ever.
            with contextlib.suppress(Exception):
                await conn.invalidate()
            await conn.close()
            raise
        self._connection = conn

    def _notified(self, *_: object) -> None:
        self._heard()

    async def close(self) -> None:
        """Stop listening (the relay stands by, stops, or lost a round to an error)."""
        listener, self._connection = self._connection, None
        if listener is not None:
            # Closed, not returned to the pool: a pooled connection must not LISTEN.
            with contextlib.suppress(Exception):
                raw = await listener.get_raw_connection()
                raw.invalidate()
            with contextlib.suppress(Exception):
                await listener.close()


def _spares_a_connection(engine: AsyncEngine) -> bool:
    """Whether the pool keeps a connection for the rounds while one LISTENs.

    A worker of sync handlers only may have one async connection (4 per process,
    as ``--processes 4`` gives by default): held to LISTEN, every round waited
    for the pool's timeout and nothing was published.
    """
    pool = engine.pool
    if isinstance(pool, QueuePool):
        return pool.size() + max(int(getattr(pool, "_max_overflow", 0)), 0) >= 2
    return True  # no bound (NullPool...), or not one eop can size up
