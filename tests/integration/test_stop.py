"""A stop always ends: `eop worker` exits on SIGTERM whatever its handlers are doing."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from eop.runtime import shutdown

from .bed import create_effects_table, drained, effects_by_body, publish, scalar, wait_for
from .test_cli import Workers, consumer_exists

STUCK_APP = "tests.integration.stuckapp:app"
DURABLE = "eop-stuck"
# A liveness bound, far above the stop deadline of these settings (2 + 10 + 5 s).
EXIT_WITHIN_S = 60.0


async def _in_flight(js: Any) -> bool:
    info = await js.consumer_info("ORDERS", DURABLE)
    return bool(info.num_ack_pending)


async def _hang_then_stop(js: Any, workers: Workers, kind: str, *args: str) -> tuple[int, Any]:
    """Start a worker whose handler hangs on ``stuck``, SIGTERM it mid-handler; its status."""
    workers.env.update(EOP_SHUTDOWN_GRACE_S="2", STUCKAPP_KIND=kind)
    proc = workers.start(*args, app=STUCK_APP)
    await wait_for(lambda: consumer_exists(js, DURABLE), what="the consumer")
    # Every process at work: one still importing would die of the SIGTERM (143)
    # before it could stop cleanly, which is another test's matter.
    processes = int(args[args.index("--processes") + 1]) if "--processes" in args else 1
    await wait_for(lambda: _started(workers, processes), what="every worker process started")
    await publish(js, "stuck")
    await wait_for(lambda: _in_flight(js), what="the message in flight")
    await asyncio.sleep(0.5)  # into the handler (not a timing assertion)
    proc.send_signal(signal.SIGTERM)
    return await asyncio.to_thread(proc.wait, EXIT_WITHIN_S), proc


async def _started(workers: Workers, processes: int) -> bool:
    return workers.logs().count('"worker.started"') >= processes


async def _processed_once_by_another_worker(js: Any, workers: Workers, engine: AsyncEngine) -> None:
    """A worker whose handler does not hang gets the message back and applies it once."""
    workers.start(app=STUCK_APP, env={"STUCKAPP_HANG": "0"})
    await wait_for(lambda: drained(js, DURABLE), timeout_s=60, what="the message redelivered")
    assert await effects_by_body(engine) == {"stuck": 1}
    workers.stop_all()


@pytest.mark.parametrize(
    ("kind", "status"),
    [("sync", shutdown.EXIT_FORCED), ("async", shutdown.EXIT_STOPPED)],
)
async def test_sigterm_ends_a_worker_whose_handler_hangs_and_the_message_comes_back_once(
    kind: str, status: int, engine: AsyncEngine, js: Any, workers: Workers
) -> None:
    """SIGTERM with a handler stuck for good (a sync one in time.sleep, an async one
    awaiting for ever): the process exits after the grace period, with 3 when a
    thread had to be abandoned (os._exit) and 0 when the handler could be cancelled;
    another worker then processes the message exactly once."""
    await create_effects_table(engine)
    code, _ = await _hang_then_stop(js, workers, kind)
    assert code == status
    if kind == "sync":
        assert '"worker.exit_forced"' in workers.logs()
    await _processed_once_by_another_worker(js, workers, engine)


async def test_sigterm_ends_a_supervisor_whose_child_has_a_stuck_sync_handler(
    engine: AsyncEngine, js: Any, workers: Workers, tmp_path: Path
) -> None:
    """`eop worker --processes 2`: the child with the stuck thread exits by itself
    (status 3), the supervisor exits with that status, and the message is
    processed once afterwards."""
    await create_effects_table(engine)
    code, _ = await _hang_then_stop(js, workers, "sync", "--processes", "2")
    assert code == shutdown.EXIT_FORCED
    await _processed_once_by_another_worker(js, workers, engine)


_WAITING_ON_THE_LOCK = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE stuck_lock%'"
)


async def test_sigterm_cancels_a_sync_handler_waiting_on_a_row_lock_and_exits_cleanly(
    engine: AsyncEngine, js: Any, workers: Workers
) -> None:
    """A sync handler whose only wait is its session's own statement (an UPDATE on a row
    another connection holds locked) is cancelled at the end of the grace period as an
    async one is: its statement is cancelled on the loop, its thread returns, no thread is
    abandoned and the worker exits 0; once the lock is released the message, left
    unacked, is processed once by another worker."""
    await create_effects_table(engine)
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE stuck_lock (n bigint NOT NULL)"))
        await conn.execute(sa.text("INSERT INTO stuck_lock VALUES (0)"))
    # Longer than the whole test: only the stop may end the handler's wait.
    workers.env.update(
        EOP_SHUTDOWN_GRACE_S="2",
        EOP_LOCK_TIMEOUT_S="120",
        EOP_STATEMENT_TIMEOUT_S="120",
        STUCKAPP_KIND="lock",
    )
    async with engine.connect() as holder:
        await holder.execute(sa.text("SELECT * FROM stuck_lock FOR UPDATE"))
        proc = workers.start(app=STUCK_APP)
        await wait_for(lambda: consumer_exists(js, DURABLE), what="the consumer")
        await wait_for(lambda: _started(workers, 1), what="the worker started")
        await publish(js, "stuck")
        await wait_for(
            lambda: _counts(engine, _WAITING_ON_THE_LOCK, 1), what="the handler on the lock"
        )
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, EXIT_WITHIN_S)
        assert code == shutdown.EXIT_STOPPED, workers.logs()
        assert '"worker.exit_forced"' not in workers.logs()
        assert '"abandoned_threads": 0' in workers.logs()
        assert '"loop.error"' not in workers.logs()
        # Cancelled, not merely left behind by a process gone: a backend waiting on a lock
        # does not notice its client went (its lock timeout is 120 s), a cancelled one
        # stops waiting as soon as PostgreSQL has handled the cancel request.
        await wait_for(
            lambda: _counts(engine, _WAITING_ON_THE_LOCK, 0),
            timeout_s=10,
            what="no backend waiting on the lock",
        )
        await holder.rollback()
    await _processed_once_by_another_worker(js, workers, engine)


async def _counts(engine: AsyncEngine, query: str, expected: int) -> bool:
    return bool(await scalar(engine, query) == expected)
