"""A worker's start-up retries: transient outages are waited out, refusals are not; a stop ends
the wait."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import nats.js.errors
import pytest
from structlog.testing import capture_logs

from eop import errors, log
from eop.broker import jetstream
from eop.pg import failures
from eop.runtime import startup
from eop.settings import Settings


def _counting(
    exc: Exception, succeed_after: int | None = None
) -> tuple[list[int], Callable[[], Awaitable[str]]]:
    calls: list[int] = []

    async def step() -> str:
        calls.append(1)
        if succeed_after is not None and len(calls) > succeed_after:
            return "ready"
        raise exc

    return calls, step


async def test_an_unreachable_server_is_retried_until_it_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A blip shorter than the attempts is ridden out."""
    monkeypatch.setattr(startup, "_FIRST_DELAY_S", 0.0)
    calls, step = _counting(errors.DatabaseUnavailable("down"), succeed_after=2)
    assert await startup.retrying(step, Settings(startup_attempts=4)) == "ready"
    assert len(calls) == 3


async def test_an_outage_longer_than_the_attempts_is_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After ``startup_attempts`` tries the worker gives up with the last error."""
    monkeypatch.setattr(startup, "_FIRST_DELAY_S", 0.0)
    calls, step = _counting(errors.NatsUnavailable("down"))
    with pytest.raises(errors.NatsUnavailable):
        await startup.retrying(step, Settings(startup_attempts=3))
    assert len(calls) == 3


@pytest.mark.parametrize(
    "exc",
    [
        errors.NatsAuthenticationFailed("refused"),
        errors.NatsTlsError("bad certificate"),
        errors.SchemaNotReady("run eop db upgrade"),
    ],
    ids=["auth", "tls", "schema"],
)
async def test_refusals_and_configuration_errors_are_not_retried(exc: Exception) -> None:
    """Knocking again with the same credentials or schema cannot help: one attempt."""
    calls, step = _counting(exc)
    with pytest.raises(type(exc)):
        await startup.retrying(step, Settings(startup_attempts=4))
    assert len(calls) == 1


async def test_each_retry_is_a_warning_with_its_attempt_and_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The warnings count the attempts and give the backoff: 0.5 s, doubled, capped at 5 s."""
    waits: list[float] = []

    async def no_sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    _, step = _counting(errors.DatabaseUnavailable("down"))
    with capture_logs() as logs, pytest.raises(errors.DatabaseUnavailable):
        await startup.retrying(step, Settings(startup_attempts=7))
    retries = [e for e in logs if e["event"] == log.Event.WORKER_STARTUP_RETRY]
    assert [e["attempt"] for e in retries] == [1, 2, 3, 4, 5, 6]
    assert [e["retry_in_s"] for e in retries] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert waits == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert {e["attempts"] for e in retries} == {7}


async def test_a_step_that_returns_a_coroutine_is_awaited() -> None:
    """The worker passes lambdas returning coroutines: what they yield comes back, awaited."""

    async def ready() -> str:
        return "ready"

    assert await startup.retrying(lambda: ready(), Settings(startup_attempts=2)) == "ready"


async def test_by_default_an_outage_is_waited_out_however_long_it_lasts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``startup_attempts`` 0 (the default): no budget; the step is tried until it answers,
    one warning per backoff step, the waits capped at 5 s."""
    waits: list[float] = []

    async def no_sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    assert Settings().startup_attempts == 0
    calls, step = _counting(errors.NatsUnavailable("down"), succeed_after=12)
    with capture_logs() as logs:
        assert await startup.retrying(step, Settings()) == "ready"
    assert len(calls) == 13
    retries = [e for e in logs if e["event"] == log.Event.WORKER_STARTUP_RETRY]
    assert [e["attempt"] for e in retries] == list(range(1, 13))
    assert max(waits) == 5.0
    assert sum(waits) > 3.5  # past the old default's whole budget


async def test_a_stop_during_the_backoff_ends_the_wait_at_once() -> None:
    """SIGTERM while waiting for a server: Stopped, without sleeping the backoff out."""
    stopping = asyncio.Event()
    calls: list[int] = []

    async def step() -> str:
        calls.append(1)
        # The stop arrives during the backoff after this failure.
        asyncio.get_running_loop().call_later(0.05, stopping.set)
        raise errors.DatabaseUnavailable("down")

    retrying = startup.retrying(step, Settings(startup_attempts=0), stopping)
    with pytest.raises(startup.Stopped):
        # A stall guard, not a timing: the first backoff is 0.5 s, the next ones longer.
        await asyncio.wait_for(retrying, 10)
    assert len(calls) == 1


async def test_a_stop_cancels_the_step_under_way() -> None:
    """A connection attempt may take seconds: a stop cancels it rather than waiting."""
    stopping = asyncio.Event()
    cancelled = asyncio.Event()

    async def step() -> str:
        stopping.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    with pytest.raises(startup.Stopped):
        await asyncio.wait_for(startup.retrying(step, Settings(), stopping), 10)
    assert cancelled.is_set()


async def test_a_stop_asked_for_before_a_step_skips_it() -> None:
    """A worker stopped before it reached a step does not start it."""
    stopping = asyncio.Event()
    stopping.set()
    calls, step = _counting(errors.NatsUnavailable("down"), succeed_after=0)
    with pytest.raises(startup.Stopped):
        await startup.retrying(step, Settings(), stopping)
    assert calls == []


def test_postgres_refusing_the_login_is_a_configuration_error() -> None:
    """A refused role or password, or a missing database (SQLSTATE 28000, 28P01, 3D000),
    is not waited for; a server starting up (57P03) or refusing connections is."""

    class Driver(Exception):
        def __init__(self, sqlstate: str) -> None:
            super().__init__(sqlstate)
            self.sqlstate = sqlstate

    for state in ("28000", "28P01", "3D000"):
        assert failures.login_refused(Driver(state))
    for state in ("57P03", "53300", "08006"):
        assert not failures.login_refused(Driver(state))
    assert not failures.login_refused(ConnectionRefusedError())


def test_jetstream_answering_503_is_unavailable_not_a_refusal() -> None:
    """'JetStream system temporarily unavailable' (a cluster electing its leader, a server
    starting) is waited for; another API error is a refusal, raised at once."""
    with pytest.raises(errors.NatsUnavailable) as caught, jetstream.translated("stream 'S'"):
        raise nats.js.errors.ServiceUnavailableError(code=503, description="temporarily")
    assert not isinstance(caught.value, errors.ConfigurationError)
    with pytest.raises(errors.ConfigurationError), jetstream.translated("stream 'S'"):
        raise nats.js.errors.BadRequestError(code=400, description="bad")
