"""Metrics, health endpoints and traces of a running worker, on real NATS and PostgreSQL."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop
from eop.observe import tracing
from eop.runtime.worker import Worker
from eop.tools import embedded

from ..otel import memory_exporter
from .bed import (
    STREAM,
    SUBJECT,
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    publish,
    record_effect,
    running,
    wait_for,
)
from .test_cli import APP, eop_env

ROOT = Path(__file__).resolve().parents[2]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of GET ``path`` on the worker's endpoint."""

    def call() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    return await asyncio.to_thread(call)


def parse(text: str) -> Samples:
    """Samples of the text format; every sample's family has a HELP and a TYPE line."""
    described: set[str] = set()
    samples: Samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            described.add(line.split(" ")[2])
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, labels, value = match.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in described or family in described, f"{name} has no HELP/TYPE"
        samples[(name, frozenset(_LABEL.findall(labels or "")))] = float(value)
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value."""
    return samples[(name, frozenset(labels.items()))]


async def scrape(port: int) -> Samples:
    status, body = await get(port, "/metrics")
    assert status == 200
    return parse(body)


def make_app(database_url: str, nats_url: str, **changes: Any) -> eop.App:
    app = eop.App(
        settings=bed_settings(
            database_url, nats_url, metrics_port=embedded.free_port(), metrics_host="127.0.0.1"
        ).replace(**changes)
    )
    app.stream(STREAM, subjects=["ORDERS.>"], duplicate_window_s=0.5)
    return app


async def test_metrics_count_processed_duplicate_retried_and_dead_lettered_per_handler(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Two handlers in one worker; a flaky message, a poison one and a late republish.

    The scrape shows each counter per handler: processed, a duplicate
    suppressed by the inbox, a retry, a dead letter by reason, no failed ack,
    one commit-to-ack observation per processed message, nothing in flight.
    """
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)

    @app.handler(stream=STREAM, subject=SUBJECT, name="billing")
    async def bill(msg: eop.Message, session: AsyncSession) -> None:
        body = msg.json()
        if body == "flaky" and msg.num_delivered == 1:
            raise RuntimeError("transient")
        await record_effect(session, "billing", msg)

    @app.handler(stream=STREAM, subject="ORDERS.audit", name="audit")
    async def audit(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "audit", msg)

    async with running(app) as worker:
        port = worker.telemetry.port
        assert port is not None
        for i in range(5):
            await publish(js, f'"ok-{i}"')
        await publish(js, '"flaky"')
        await publish(js, "not json")
        await publish(js, '"pay"', msg_id="pay-1")
        await publish(js, "a1", subject="ORDERS.audit")
        await wait_for(lambda: drained(js, "eop-billing", engine=engine), what="billing drained")
        await asyncio.sleep(1.0)  # past the server's duplicate window
        second = await publish(js, '"pay"', msg_id="pay-1")
        assert not second.duplicate
        await wait_for(lambda: drained(js, "eop-billing", engine=engine), what="the republish")
        await wait_for(lambda: drained(js, "eop-audit", engine=engine), what="audit drained")
        samples = await scrape(port)

    billing = {"handler": "billing", "stream": STREAM}
    audit_labels = {"handler": "audit", "stream": STREAM}
    assert value(samples, "eop_messages_processed_total", **billing) == 7
    assert value(samples, "eop_messages_duplicate_total", **billing) == 1
    assert value(samples, "eop_messages_retried_total", **billing) == 1
    assert value(samples, "eop_messages_dead_lettered_total", reason="undecodable", **billing) == 1
    assert value(samples, "eop_messages_dead_lettered_total", reason="rejected", **billing) == 0
    assert value(samples, "eop_acks_failed_total", **billing) == 0
    assert value(samples, "eop_messages_in_flight", **billing) == 0
    assert value(samples, "eop_commit_to_ack_seconds_count", **billing) == 7
    assert value(samples, "eop_commit_to_ack_seconds_bucket", le="+Inf", **billing) == 7
    # 5 ok, flaky twice, the poison, pay once; batches may run a failing handler twice.
    assert value(samples, "eop_handler_duration_seconds_count", **billing) >= 9
    assert value(samples, "eop_messages_processed_total", **audit_labels) == 1
    assert value(samples, "eop_messages_duplicate_total", **audit_labels) == 0
    assert await effects_by_body(engine) == {
        **{f'"ok-{i}"': 1 for i in range(5)},
        '"flaky"': 1,
        '"pay"': 1,
        "a1": 1,
    }
    # No label carries a subject or a payload.
    label_values = {v for (_, labels) in samples for (_, v) in labels}
    assert not {SUBJECT, "ORDERS.audit", '"pay"', "not json"} & label_values


async def test_readiness_is_false_while_draining_and_in_flight_is_counted(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Ready once bound; a stop makes /readyz 503 (draining) while /healthz stays 200."""
    app = make_app(database_url, nats_url)
    started, release = asyncio.Event(), asyncio.Event()

    @app.handler(stream=STREAM, subject=SUBJECT, name="slow")
    async def slow(msg: eop.Message, session: AsyncSession) -> None:
        started.set()
        await release.wait()

    worker = Worker(app)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 30)
    port = worker.telemetry.port
    assert port is not None
    try:
        status, body = await get(port, "/readyz")
        assert (status, "database_reachable ok" in body) == (200, True)
        await publish(js, "x")
        await asyncio.wait_for(started.wait(), 10)
        labels = {"handler": "slow", "stream": STREAM}
        assert value(await scrape(port), "eop_messages_in_flight", **labels) == 1
        worker.stop()
        status, body = await get(port, "/readyz")
        assert status == 503
        assert "not_draining fail" in body.splitlines()
        assert (await get(port, "/healthz"))[0] == 200
    finally:
        release.set()
        await asyncio.wait_for(task, 30)
    assert await drained(js, "eop-slow")


async def test_readiness_follows_the_nats_connection(
    database_url: str, nats_url: str, js: Any, nats_server: embedded.NatsServer
) -> None:
    """nats-server stopped: /readyz 503 (nats_connected fail); restarted: 200 again."""
    app = make_app(database_url, nats_url)

    @app.handler(stream=STREAM, subject=SUBJECT, name="conn")
    async def conn(msg: eop.Message, session: AsyncSession) -> None:
        pass

    async def status_is(expected: int) -> bool:
        return (await get(port, "/readyz"))[0] == expected

    async with running(app) as worker:
        port = worker.telemetry.port or 0
        await wait_for(lambda: status_is(200), what="ready")
        nats_server.stop()
        await wait_for(lambda: status_is(503), what="not ready without NATS")
        assert "nats_connected fail" in (await get(port, "/readyz"))[1]
        nats_server.start()
        await wait_for(lambda: status_is(200), timeout_s=30, what="ready after reconnect")


async def test_not_ready_before_the_subscriptions_are_bound(database_url: str) -> None:
    """A worker still connecting (to a NATS that never answers) is live but not ready."""
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    silent_url = f"nats://127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    app = make_app(database_url, silent_url)

    @app.handler(stream=STREAM, subject=SUBJECT, name="never")
    async def never(msg: eop.Message, session: AsyncSession) -> None:
        pass

    worker = Worker(app)
    task = asyncio.create_task(worker.run())
    try:
        port = worker.settings.metrics_port

        async def answers() -> bool:
            try:
                return (await get(port, "/healthz"))[0] == 200
            except OSError:
                return False

        await wait_for(answers, what="the endpoint")
        status, body = await get(port, "/readyz")
        assert status == 503
        assert "subscriptions_bound fail" in body.splitlines()
        assert "nats_connected fail" in body.splitlines()
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        silent.close()
    # The endpoint is closed with the worker.
    try:
        await get(port, "/healthz")
        raise AssertionError("the endpoint outlived its worker")
    except OSError:
        pass


async def test_published_traceparent_gives_a_child_consumer_span(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A message published inside a span with inject()ed headers is processed in its child span."""
    exporter = memory_exporter()
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)

    @app.handler(stream=STREAM, subject=SUBJECT, name="traced")
    async def traced(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "traced", msg)

    async with running(app):
        with trace.get_tracer("publisher").start_as_current_span("publish order") as parent:
            headers = tracing.inject({"Nats-Msg-Id": "order-1"})
            ack = await js.publish(SUBJECT, b"o1", headers=dict(headers))
        await wait_for(lambda: drained(js, "eop-traced", engine=engine), what="the message")

    [span] = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.CONSUMER]
    assert span.parent is not None
    assert span.context.trace_id == parent.get_span_context().trace_id
    assert span.parent.span_id == parent.get_span_context().span_id
    attrs = dict(span.attributes or {})
    assert attrs["messaging.system"] == "nats"
    assert attrs["messaging.destination.name"] == SUBJECT
    assert attrs["messaging.consumer.group.name"] == "eop-traced"
    assert attrs["eop.handler"] == "traced"
    assert attrs["eop.stream"] == STREAM
    assert attrs["eop.stream_seq"] == ack.seq
    assert attrs["eop.delivery_count"] == 1
    assert attrs["eop.outcome"] == "processed"
    assert attrs["messaging.message.id"] == "order-1"


def test_eop_worker_metrics_port_flag_serves_metrics(
    database_url: str, nats_url: str, engine: AsyncEngine
) -> None:
    """`eop worker --metrics-port P`: the CLI serves /metrics and /readyz while it runs."""
    port = embedded.free_port()
    env = eop_env(database_url, nats_url, EOP_METRICS_HOST="127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "eop", "worker", APP, "--metrics-port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:

        async def ready() -> bool:
            try:
                return (await get(port, "/readyz"))[0] == 200
            except OSError:
                return False

        asyncio.run(wait_for(ready, timeout_s=30, what="the CLI worker ready"))
        samples = asyncio.run(scrape(port))
        assert any(name == "eop_messages_processed_total" for name, _ in samples)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
