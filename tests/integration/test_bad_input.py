"""Bad input through the real `eop worker` command: one clear line each, nothing lost."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from nats.js import api
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import eop
from eop.pg import migrate
from eop.tools import embedded

from .bed import (
    STREAM,
    create_effects_table,
    drained,
    effects_by_body,
    error_lines,
    publish,
    wait_for,
)
from .test_cli import APP, Workers, consumer_exists, eop_env
from .test_cli import eop as run_eop


def assert_clear_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 1, no traceback, and the first line of stderr holds every needle."""
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = error_lines(result.stderr)
    assert errors, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_missing_stream_without_create_says_how_to_create_it(
    database_url: str, nats_url: str
) -> None:
    """--no-create and no stream: the error names the stream and the `nats stream add` fix."""
    result = run_eop("worker", APP, "--no-create", env=eop_env(database_url, nats_url))
    assert_clear_error(result, "stream 'ORDERS' does not exist", "nats stream add ORDERS")


async def test_stream_without_the_handlers_subject_names_the_stream_subjects(
    database_url: str, nats_url: str, js: Any
) -> None:
    """An existing stream that does not hold the handler's subject: both are named."""
    await js.add_stream(name=STREAM, subjects=["OTHER.>"])
    result = await asyncio.to_thread(run_eop, "worker", APP, env=eop_env(database_url, nats_url))
    assert_clear_error(
        result, "stream 'ORDERS' holds subjects OTHER.>", "do not cover", "ORDERS.created"
    )


async def test_subjects_held_by_another_stream_is_a_clear_error(
    database_url: str, nats_url: str, js: Any
) -> None:
    """eop cannot create its stream because another one holds the subjects."""
    await js.add_stream(name="LEGACY", subjects=["ORDERS.>"])
    result = await asyncio.to_thread(run_eop, "worker", APP, env=eop_env(database_url, nats_url))
    assert_clear_error(result, "cannot create stream 'ORDERS'", "another stream")


async def test_conflicting_consumer_names_each_differing_field_and_the_fix(
    database_url: str, nats_url: str, js: Any
) -> None:
    """An existing durable with another filter, ack and deliver policy, and a low max_deliver."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    await js.add_consumer(
        STREAM,
        api.ConsumerConfig(
            durable_name="eop-cli",
            ack_policy=api.AckPolicy.ALL,
            deliver_policy=api.DeliverPolicy.NEW,
            filter_subject="ORDERS.other",
            max_deliver=2,
        ),
    )
    result = await asyncio.to_thread(run_eop, "worker", APP, env=eop_env(database_url, nats_url))
    line = assert_clear_error(result, "consumer 'eop-cli' on stream 'ORDERS' conflicts")
    for part in (
        "ack_policy is all, eop needs explicit",
        "filter_subject is ORDERS.other",
        "deliver_policy is new, eop needs all",
        "max_deliver is 2",
        "nats consumer rm ORDERS eop-cli",
    ):
        assert part in line


async def _consumer_waiting_30_s(js: Any) -> None:
    """The stream, and the app's consumer made by hand with an AckWait of 30 s."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    await js.add_consumer(
        STREAM,
        api.ConsumerConfig(
            durable_name="eop-cli",
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=30.0,
            filter_subject="ORDERS.created",
        ),
    )


async def test_a_consumer_with_another_ack_wait_gets_the_settings_one_at_bind(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, workers: Workers
) -> None:
    """A changed EOP_ACK_WAIT_S reaches the existing consumer: `eop status` shows the
    difference as a warning, and the next worker gives the consumer its AckWait (logged)
    and works."""
    await create_effects_table(engine)
    await _consumer_waiting_30_s(js)
    env = eop_env(database_url, nats_url)
    before = await asyncio.to_thread(run_eop, "status", APP, "--json", env=env)
    [row] = json.loads(before.stdout)
    assert row["ack_wait_s"] == 30.0
    assert any("has AckWait 30 s" in w for w in row["warnings"]), row["warnings"]
    workers.start()

    async def updated() -> bool:
        info = await js.consumer_info(STREAM, "eop-cli")
        return bool(info.config.ack_wait == float(env["EOP_ACK_WAIT_S"]))

    await wait_for(updated, what="the consumer's AckWait to follow the settings")
    await publish(js, "after")
    await wait_for(lambda: drained(js, "eop-cli"), what="the message")
    assert workers.stop_all() == [0]
    assert await effects_by_body(engine) == {"after": 1}
    assert '"event": "consumer.ack_wait_changed"' in workers.logs()
    after = await asyncio.to_thread(run_eop, "status", APP, "--json", env=env)
    assert json.loads(after.stdout)[0]["warnings"] == []


async def test_a_consumer_with_another_ack_wait_without_create_is_one_clear_line(
    database_url: str, nats_url: str, js: Any
) -> None:
    """--no-create: eop may not touch the consumer, so a different AckWait (leases timed
    wrong) stops the worker at start, naming both fixes."""
    await _consumer_waiting_30_s(js)
    result = await asyncio.to_thread(
        run_eop, "worker", APP, "--no-create", env=eop_env(database_url, nats_url)
    )
    assert_clear_error(
        result,
        "consumer 'eop-cli' on stream 'ORDERS' has AckWait 30 s",
        "EOP_ACK_WAIT_S=30",
        "nats consumer edit ORDERS eop-cli --wait 4s",
    )
    info = await js.consumer_info(STREAM, "eop-cli")
    assert info.config.ack_wait == 30.0


def test_unknown_handler_lists_the_known_ones(database_url: str, nats_url: str) -> None:
    """`--handler nope`: the error lists the registered handler names."""
    result = run_eop("worker", APP, "--handler", "nope", env=eop_env(database_url, nats_url))
    assert_clear_error(result, "unknown handler(s) ['nope']", "registered: cli")


def test_unreachable_nats_is_retried_a_few_times_then_one_clear_line(database_url: str) -> None:
    """NATS down: bounded start-up retries (logged), then exit 1 with the redacted URL."""
    url = f"nats://u:hunter2@127.0.0.1:{embedded.free_port()}"
    env = eop_env(database_url, url, EOP_STARTUP_ATTEMPTS="2")
    result = run_eop("worker", APP, env=env)
    line = assert_clear_error(result, "NATS is unreachable at nats://u:***@127.0.0.1")
    assert "hunter2" not in result.stderr + result.stdout
    assert result.stderr.count('"event": "worker.startup_retry"') == 1
    assert len(line) < 300


def test_unreachable_postgres_is_retried_then_one_clear_line(nats_url: str) -> None:
    """PostgreSQL down: start-up retries, then exit 1 naming the redacted URL."""
    url = f"postgresql+asyncpg://postgres:hunter2@127.0.0.1:{embedded.free_port()}/x"
    result = run_eop("worker", APP, env=eop_env(url, nats_url, EOP_STARTUP_ATTEMPTS="3"))
    assert_clear_error(result, "cannot use PostgreSQL at postgresql+asyncpg://postgres:***@")
    assert "hunter2" not in result.stderr + result.stdout
    assert result.stderr.count('"event": "worker.startup_retry"') == 2


async def test_postgres_blip_during_start_up_does_not_stop_the_worker(
    make_postgres_server: Any, nats_url: str, js: Any, tmp_path: Path
) -> None:
    """PostgreSQL down when the worker starts and back a moment later: it starts and works."""
    pg = make_postgres_server()
    migrate.upgrade(pg.url)
    engine = create_async_engine(pg.url)
    await create_effects_table(engine)
    await engine.dispose()
    await asyncio.to_thread(pg.stop)
    pool = Workers(eop_env(pg.url, nats_url, EOP_STARTUP_ATTEMPTS="6"), tmp_path)
    try:
        proc = pool.start()
        await wait_for(lambda: _logged(pool, "worker.startup_retry"), what="a start-up retry")
        await asyncio.to_thread(pg.start)
        await wait_for(lambda: consumer_exists(js), timeout_s=30, what="the worker to start")
        await publish(js, "after-blip")
        await wait_for(lambda: drained(js, "eop-cli"), what="the message")
        assert proc.poll() is None
        assert await effects_by_body(engine) == {"after-blip": 1}
    finally:
        pool.stop_all()
        await engine.dispose()


async def _logged(pool: Workers, event: str) -> bool:
    return f'"event": "{event}"' in pool.logs()


async def test_publish_refuses_a_payload_above_max_payload_before_sending(js: Any, nc: Any) -> None:
    """eop.publish counts headers too and names the limit; nothing half-sent."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    limit = nc.max_payload
    with pytest.raises(eop.PayloadTooLarge, match=f"max_payload of {limit} bytes"):
        await eop.publish(nc, "ORDERS.created", b"x" * (limit + 1))
    # Fits on its own, not with its headers: nats-py alone would send it and fail later.
    with pytest.raises(eop.PayloadTooLarge, match="headers"):
        await eop.publish(nc, "ORDERS.created", b"x" * (limit - 10), msg_id="m" * 40)
    ack = await eop.publish(nc, "ORDERS.created", b"x" * (limit - 200), msg_id="fits")
    assert ack.seq == 1
    info = await js.stream_info(STREAM)
    assert info.state.messages == 1


async def test_publish_to_a_subject_no_stream_holds_is_a_clear_error(nc: Any) -> None:
    """No stream for the subject: ConfigurationError, not a bare timeout."""
    with pytest.raises(eop.ConfigurationError, match="no stream holds it"):
        await eop.publish(nc, "NOWHERE.x", b"{}", timeout_s=1)


async def test_publish_with_a_malformed_header_name_is_a_clear_error(nc: Any, js: Any) -> None:
    """A header name NATS refuses: ConfigurationError naming it, not 'NATS unavailable'."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    with pytest.raises(eop.ConfigurationError, match="invalid header name 'a b;c'"):
        await eop.publish(nc, "ORDERS.created", b"{}", headers={"a b;c": "v"})
