"""PostgreSQL lost under a sync handler's statement, on the async engine (:mod:`eop.pg.bridge`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import create_async_engine

from eop.pg import migrate
from eop.runtime import shutdown

from .bed import create_effects_table, drained, effects_by_body, equals, publish, scalar, wait_for
from .test_cli import Workers, consumer_exists, eop_env
from .test_stop import DURABLE, STUCK_APP

_SLEEPING = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%'"

#: What SQLAlchemy's pool printed when it terminated the dead connection in the
#: handler's thread (no event loop there), and any raw traceback.
_NOT_ON_STDERR = ("Traceback", "no current event loop", "never awaited", "Exception terminating")


async def test_postgres_killed_under_a_sync_handlers_statement_prints_no_traceback(
    make_postgres_server: Any, nats_url: str, js: Any, tmp_path: Path
) -> None:
    """PostgreSQL killed while a sync handler's statement runs, then started again: the
    dead connection is dropped without a raw traceback, RuntimeError or coroutine never
    awaited on the worker's output (every line is one JSON log line), and the message
    is processed exactly once once PostgreSQL is back; the worker then stops with 0."""
    pg = make_postgres_server()
    migrate.upgrade(pg.url)
    engine = create_async_engine(pg.url)
    await create_effects_table(engine)
    env = eop_env(pg.url, nats_url, STUCKAPP_KIND="pg_sleep", EOP_STATEMENT_TIMEOUT_S="120")
    pool = Workers(env, tmp_path)
    try:
        pool.start(app=STUCK_APP)
        await wait_for(lambda: consumer_exists(js, DURABLE), what="the consumer")
        await publish(js, "stuck")
        await wait_for(lambda: equals(scalar(engine, _SLEEPING), 1), what="the handler's sleep")
        await engine.dispose()
        await asyncio.to_thread(pg.kill)
        await asyncio.to_thread(pg.start)
        await wait_for(
            lambda: equals(effects_by_body(engine), {"stuck": 1}),
            timeout_s=60,
            what="the message processed after the restart",
        )
        await wait_for(lambda: drained(js, DURABLE), what="the message acked")
        assert pool.stop_all() == [shutdown.EXIT_STOPPED]
        assert await effects_by_body(engine) == {"stuck": 1}
        output = pool.logs()
        for text in _NOT_ON_STDERR:
            assert text not in output, output
        assert all(line.startswith("{") for line in output.splitlines()), output
    finally:
        pool.stop_all()
        await engine.dispose()
