"""A worker's start-up retries: transient outages are retried, refusals are not."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from structlog.testing import capture_logs

from eop import errors, log
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
