"""A background round's failure (compaction, the unacked watch): logged, or raised if a bug;
a round under way at a stop (the relay's, an ordered handler's tick): bounded."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
import sqlalchemy.exc as sa_exc
from structlog.testing import capture_logs

from eop import errors, log
from eop.protocol import background


def failing(exc: Exception) -> background.Step:
    """A round that raises ``exc``."""

    async def step() -> None:
        raise exc

    return step


@pytest.mark.parametrize(
    "exc",
    [
        OSError("connection reset"),
        asyncio.TimeoutError(),
        nats.errors.NoServersError(),
        errors.DatabaseUnavailable("gone"),
        sa_exc.TimeoutError("QueuePool limit reached"),
    ],
)
async def test_an_io_or_database_failure_of_a_round_is_logged_not_raised(exc: Exception) -> None:
    """NATS, the network, a timeout and a failure of the database (classified other than
    OTHER) cost the round only: one warning with the event given and the error described."""
    with capture_logs() as logs:
        await background.quietly(failing(exc), log.get_logger(), log.Event.COMPACTION_FAILED)
    assert [(e["event"], e["log_level"], e["error"]) for e in logs] == [
        (log.Event.COMPACTION_FAILED, "warning", log.describe_error(exc)[:500])
    ]
    assert logs[0]["error"].startswith(type(exc).__name__)


async def test_a_round_failed_on_a_statement_is_one_line_without_its_sql() -> None:
    """A round's statement that failed as the database went away is described by its
    first line: the driver's message, not the several lines of eop's own SQL."""

    class ConnectionDoesNotExist(Exception):
        """asyncpg's error as the connection drops."""

    exc = sa_exc.InterfaceError(
        "INSERT INTO eop.watermarks (subscription, stream)\nSELECT unnest($1::TEXT[])",
        ("h", "ORDERS"),
        ConnectionDoesNotExist("connection was closed in the middle of operation"),
    )
    assert "[SQL:" in log.describe_error(exc)
    with capture_logs() as logs:
        await background.quietly(failing(exc), log.get_logger(), log.Event.COMPACTION_FAILED)
    [line] = logs
    assert line["error"].startswith("InterfaceError: ")
    assert "connection was closed" in line["error"]
    assert "\n" not in line["error"]
    assert "SQL" not in line["error"]


async def test_a_bug_in_a_round_is_raised() -> None:
    """An error that is neither I/O nor the database's (a bug) is raised, not logged."""
    with capture_logs() as logs, pytest.raises(ValueError, match="a bug"):
        await background.quietly(
            failing(ValueError("a bug")), log.get_logger(), log.Event.UNACKED_WATCH_FAILED
        )
    assert logs == []


async def test_a_round_that_succeeds_logs_nothing() -> None:
    """A round that ends well is run once and leaves no log line."""
    ran: list[int] = []

    async def step() -> None:
        ran.append(1)

    with capture_logs() as logs:
        await background.quietly(step, log.get_logger(), log.Event.COMPACTION_FAILED)
    assert (ran, logs) == ([1], [])


async def test_a_failed_rounds_line_says_why_and_whoever_counts_is_told() -> None:
    """The warning carries the database's own words (a round failing on every try must be
    diagnosable from the log: its type alone was not), and ``noted`` hears of each failure;
    a bug is neither logged nor noted."""
    from .test_inbox import DriverError, wrapped

    pooler = wrapped(DriverError("26000", 'prepared statement "__asyncpg_stmt_a__" does not exist'))
    noted: list[BaseException] = []
    with capture_logs() as logs:
        for _ in range(2):
            await background.quietly(
                failing(pooler), log.get_logger(), log.Event.COMPACTION_FAILED, noted.append
            )
        with pytest.raises(ValueError, match="a bug"):
            await background.quietly(
                failing(ValueError("a bug")),
                log.get_logger(),
                log.Event.COMPACTION_FAILED,
                noted.append,
            )
    assert noted == [pooler, pooler]
    assert len(logs) == 2
    assert all('prepared statement "__asyncpg_stmt_a__" does not exist' in e["error"] for e in logs)


async def hanging(cancelled: asyncio.Event) -> None:
    """A round waiting for ever (a server that does not answer); ``cancelled`` set when
    it is cancelled."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.set()
        raise


async def test_a_round_that_ends_is_awaited_whole_across_a_stop() -> None:
    """A round the stop comes during, done within its bound: its result, not cut."""
    stopping = asyncio.Event()

    async def round_() -> str:
        stopping.set()
        await asyncio.sleep(0.01)
        return "done"

    assert await background.before_stop(round_(), stopping, bound_s=5.0) == "done"


async def test_a_round_that_never_ends_is_cancelled_after_its_bound_from_the_stop() -> None:
    """A round waiting for ever (a server that does not answer) runs on until the stop,
    then for its bound, then is cancelled and Abandoned raised."""
    stopping = asyncio.Event()
    cancelled = asyncio.Event()

    task = asyncio.ensure_future(background.before_stop(hanging(cancelled), stopping, bound_s=0.05))
    await asyncio.sleep(0.1)
    assert not task.done()  # no stop yet: no bound
    stopping.set()
    with pytest.raises(background.Abandoned, match=r"no answer within 0\.05 s at the stop"):
        await task
    assert cancelled.is_set()


async def test_a_round_whose_cancellation_hangs_too_is_left_behind() -> None:
    """A round whose cancellation waits on the server as well (a rollback on a frozen
    connection): Abandoned is raised anyway, the round left to end by itself, its error
    retrieved."""
    release = asyncio.Event()
    ended = asyncio.Event()

    async def round_() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await release.wait()
            ended.set()
            raise RuntimeError("the rollback failed")  # retrieved, never reported

    with pytest.raises(background.Abandoned):
        await background.bounded(round_(), bound_s=0.05)
    assert not ended.is_set()
    release.set()
    await asyncio.wait_for(ended.wait(), 5)


async def test_a_cancelled_caller_cancels_its_round() -> None:
    """The caller cancelled (a second stop, a cancelled host): its round with it."""
    cancelled = asyncio.Event()

    task = asyncio.ensure_future(background.before_stop(hanging(cancelled), asyncio.Event(), 5.0))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(cancelled.wait(), 5)
