"""The worker's HTTP endpoint (/metrics, /healthz, /readyz) and the readiness checks."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from eop import errors
from eop.observe import health, metrics, reports
from eop.observe.observer import Settled
from eop.types import Outcome

from .support import delivery


async def get(port: int, path: str, method: str = "GET") -> tuple[int, str, str]:
    """(status, content type, body) of a request made with the standard library's client."""

    def call() -> tuple[int, str, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, response.headers["Content-Type"], response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()

    return await asyncio.to_thread(call)


class State:
    """What the readiness callables report; flip the fields to change readiness."""

    def __init__(self) -> None:
        self.bound = True
        self.draining = False
        self.connected = True
        self.db_up = True
        self.pings = 0

    async def ping(self) -> None:
        self.pings += 1
        await asyncio.sleep(0.01)
        if not self.db_up:
            raise OSError("connection refused")


@pytest.fixture
def state() -> State:
    return State()


@pytest.fixture
def clock() -> list[float]:
    """A settable clock: the readiness's notion of now."""
    return [1000.0]


@pytest.fixture
def readiness(state: State, clock: list[float]) -> health.Readiness:
    return health.Readiness(
        bound=lambda: state.bound,
        draining=lambda: state.draining,
        nats_connected=lambda: state.connected,
        ping=state.ping,
        clock=lambda: clock[0],
    )


@pytest.fixture
async def endpoints(readiness: health.Readiness) -> AsyncIterator[health.Endpoints]:
    server = health.Endpoints(
        host="127.0.0.1", port=0, metrics=lambda: b"demo_total 3.0\n", readiness=readiness
    )
    await server.start()
    yield server
    await server.close()


async def test_metrics_are_served_in_the_text_format(endpoints: health.Endpoints) -> None:
    """GET /metrics: 200, the exposition format's content type, what the renderer made."""
    status, content_type, body = await get(endpoints.port, "/metrics")
    assert status == 200
    assert content_type == metrics.CONTENT_TYPE
    assert body == "demo_total 3.0\n"


async def test_healthz_answers_while_the_loop_runs(endpoints: health.Endpoints) -> None:
    """Liveness is 200 whatever the readiness says."""
    endpoints.readiness._draining = lambda: True
    assert (await get(endpoints.port, "/healthz"))[0] == 200


async def test_readyz_is_ok_when_every_check_holds(
    endpoints: health.Endpoints, state: State
) -> None:
    """All four checks hold: 200 and each listed as ok (PostgreSQL pinged once)."""
    status, _, body = await get(endpoints.port, "/readyz")
    assert status == 200
    assert body.splitlines() == [
        "subscriptions_bound ok",
        "not_draining ok",
        "nats_connected ok",
        "database_reachable ok",
    ]
    assert state.pings == 1


@pytest.mark.parametrize(
    ("field", "value", "line"),
    [
        ("bound", False, "subscriptions_bound fail"),
        ("draining", True, "not_draining fail"),
        ("connected", False, "nats_connected fail"),
        ("db_up", False, "database_reachable fail"),
    ],
)
async def test_readyz_fails_when_a_check_fails(
    endpoints: health.Endpoints, state: State, field: str, value: bool, line: str
) -> None:
    """Each failing check alone makes /readyz 503 and names itself."""
    setattr(state, field, value)
    status, _, body = await get(endpoints.port, "/readyz")
    assert status == 503
    assert line in body.splitlines()


async def test_recent_outcome_spares_the_ping_and_a_stale_one_pings_again(
    readiness: health.Readiness, state: State, clock: list[float]
) -> None:
    """A committed outcome shows the database reachable; after DB_FRESH_S it is pinged again."""
    spec_delivery = delivery()
    readiness.outcome(Settled(None, spec_delivery, Outcome.PROCESSED))  # type: ignore[arg-type]
    assert (await readiness.check())["database_reachable"]
    assert state.pings == 0
    clock[0] += health.DB_FRESH_S + 1
    state.db_up = False
    assert not (await readiness.check())["database_reachable"]
    assert state.pings == 1


async def test_a_retry_outcome_does_not_prove_the_database(
    readiness: health.Readiness, state: State
) -> None:
    """A nak says nothing about PostgreSQL: the probe still pings."""
    readiness.outcome(Settled(None, delivery(), Outcome.RETRY))  # type: ignore[arg-type]
    await readiness.check()
    assert state.pings == 1


async def test_concurrent_probes_share_one_ping(readiness: health.Readiness, state: State) -> None:
    """Many probes at once cause one ping, not one each."""
    results = await asyncio.gather(*(readiness.check() for _ in range(10)))
    assert all(r["database_reachable"] for r in results)
    assert state.pings == 1


async def test_head_unknown_path_wrong_method_and_garbage(endpoints: health.Endpoints) -> None:
    """HEAD has no body; unknown paths 404; POST 405; a malformed request line 400."""
    assert (await get(endpoints.port, "/metrics", method="HEAD"))[:1] == (200,)
    assert (await get(endpoints.port, "/nope"))[0] == 404
    assert (await get(endpoints.port, "/metrics", method="POST"))[0] == 405
    reader, writer = await asyncio.open_connection("127.0.0.1", endpoints.port)
    writer.write(b"garbage\r\n\r\n")
    await writer.drain()
    assert (await reader.read()).startswith(b"HTTP/1.1 400 ")
    writer.close()


async def test_a_silent_client_does_not_block_the_others(endpoints: health.Endpoints) -> None:
    """A connection that never sends its request does not stop other requests being served."""
    _, idle = await asyncio.open_connection("127.0.0.1", endpoints.port)
    assert (await get(endpoints.port, "/healthz"))[0] == 200
    idle.close()


async def test_port_in_use_is_a_configuration_error(readiness: health.Readiness) -> None:
    """A port another process holds fails with a clear ConfigurationError."""
    first = health.Endpoints(host="127.0.0.1", port=0, metrics=None, readiness=readiness)
    await first.start()
    try:
        second = health.Endpoints(
            host="127.0.0.1", port=first.port, metrics=None, readiness=readiness
        )
        with pytest.raises(errors.ConfigurationError, match="cannot serve metrics"):
            await second.start()
        with pytest.raises(errors.ConfigurationError, match="cannot serve metrics"):
            health.bind("127.0.0.1", first.port)
    finally:
        await first.close()


async def test_healthz_follows_a_liveness_callable_when_given(
    readiness: health.Readiness,
) -> None:
    """A supervisor's /healthz is 503 while one of its processes is not live."""
    live = [True]
    server = health.Endpoints(
        host="127.0.0.1", port=0, metrics=None, readiness=readiness, live=lambda: live[0]
    )
    await server.start(sock=health.bind("127.0.0.1", 0))
    try:
        assert (await get(server.port, "/healthz"))[0] == 200
        live[0] = False
        assert (await get(server.port, "/healthz"))[0] == 503
    finally:
        await server.close()


class Fixed:
    """Readiness checks that say what they are told."""

    def __init__(self, **checks: bool) -> None:
        self.checks = checks

    async def check(self) -> dict[str, bool]:
        return dict(self.checks)


async def test_each_process_reports_its_checks_and_the_supervisor_combines_them(
    tmp_path: Path,
) -> None:
    """Ready only when every process reports every check ok; one failing check, a process
    gone, or a process whose report went stale makes the whole worker not ready."""
    now = [1000.0]
    combined = reports.Combined(str(tmp_path), clock=lambda: now[0])
    ok = Fixed(subscriptions_bound=True, not_draining=True)
    me = reports.Reporter(str(tmp_path), ok)
    other = os.getpid() + 1_000_000  # a second process's report, written by hand
    combined.started(os.getpid())
    combined.started(other)
    assert combined.live()  # both starting: live, not ready
    assert not all((await combined.check()).values())
    await me.start()
    # Reporter stamps reports with the wall clock: the test's clock follows it.
    now[0] = time.time()
    write_report(tmp_path, other, now[0], subscriptions_bound=True, not_draining=True)
    checks = await combined.check()
    assert all(checks.values()), checks
    assert set(checks) >= {"processes_running", "processes_answering", "subscriptions_bound"}
    write_report(tmp_path, other, now[0], subscriptions_bound=True, not_draining=False)
    assert not (await combined.check())["not_draining"]
    write_report(tmp_path, other, now[0], subscriptions_bound=True, not_draining=True)
    assert all((await combined.check()).values())
    now[0] += reports.STALE_S + 1  # nobody reported since: their loops no longer answer
    assert not (await combined.check())["processes_answering"]
    assert not combined.live()
    now[0] -= reports.STALE_S + 1
    combined.gone(other)
    assert not (await combined.check())["processes_running"]
    assert not combined.live()
    await me.close()
    assert not reports.report_path(tmp_path, os.getpid()).exists()


def write_report(directory: Path, pid: int, at: float, **checks: bool) -> None:
    reports.report_path(directory, pid).write_text(json.dumps({"at": at, "checks": checks}))


def test_a_process_that_never_reports_is_live_only_for_the_start_grace(tmp_path: Path) -> None:
    """A process hung before its first report stops counting as live after START_GRACE_S."""
    now = [0.0]
    combined = reports.Combined(str(tmp_path), clock=lambda: now[0])
    combined.started(4242)
    assert combined.live()
    now[0] += reports.START_GRACE_S + 1
    assert not combined.live()
