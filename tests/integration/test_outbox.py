"""The outbox: rows added in a transaction are published once it commits, never if it does not.

Against real JetStream and PostgreSQL: the handler styles of docs/outbox.md
(async session, sync Session, eop.Writes, batch), the app's own sessions
outside handlers, the relay's lease, parking, and the operators' commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from nats.aio.client import Client as NATS
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

import eop
from eop.app import sync_url
from eop.outbox import notifications, publishing
from eop.outbox.jetstream_publisher import JetStreamPublisher
from eop.outbox.relay import Relay

from .bed import (
    STREAM,
    bed_settings,
    create_effects_table,
    drained,
    equals,
    running,
    scalar,
    wait_for,
)

OUT_STREAM = "SHIPMENTS"
OUT_SUBJECT = "SHIPMENTS.requested"
EFFECT = sa.text("INSERT INTO effects (handler, msg_key, body) VALUES (:h, :k, :b)")


def make_app(
    database_url: str,
    nats_url: str,
    sync_sessionmaker: orm.sessionmaker[Session] | None = None,
    **changes: Any,
) -> eop.App:
    """An app with the input stream and the stream the outbox publishes to."""
    changes.setdefault("outbox_poll_s", 0.2)
    settings = bed_settings(database_url, nats_url, **changes)
    app = eop.App(settings=settings, sync_sessionmaker=sync_sessionmaker)
    app.stream(STREAM, subjects=["ORDERS.>"])
    app.stream(OUT_STREAM, subjects=["SHIPMENTS.>"])
    return app


async def out_messages(js: Any, stream: str = OUT_STREAM) -> list[tuple[int, str, bytes]]:
    """Every message of ``stream``: (sequence, msg-id, payload), in stream order."""
    info = await js.stream_info(stream)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        with contextlib.suppress(Exception):
            msg = await js.get_msg(stream, seq)
            found.append((seq, (msg.headers or {}).get("Nats-Msg-Id", ""), msg.data))
    return found


async def out_count(js: Any, stream: str = OUT_STREAM) -> int:
    """Messages stored in ``stream`` (0 when it does not exist)."""
    try:
        return int((await js.stream_info(stream)).state.messages)
    except Exception:
        return 0


async def outbox_rows(engine: AsyncEngine, where: str = "true") -> int:
    """Outbox rows matching ``where``."""
    return int(await scalar(engine, f"SELECT count(*) FROM eop.outbox WHERE {where}"))


@contextlib.asynccontextmanager
async def relaying(app: eop.App, nats_url: str, **kwargs: Any) -> AsyncIterator[Relay]:
    """A relay of its own (not a worker's) in a task for the body; stopped after."""
    nc = NATS()
    await nc.connect(nats_url)
    relay = Relay(app.engine, JetStreamPublisher(nc, app.settings), app.settings, **kwargs)
    stopping = asyncio.Event()
    task = asyncio.create_task(relay.run(stopping))
    try:
        yield relay
    finally:
        stopping.set()
        await asyncio.wait_for(task, 30)
        await nc.close()


async def ensure_streams(js: Any) -> None:
    """The input and output streams, before any publish."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    await js.add_stream(name=OUT_STREAM, subjects=["SHIPMENTS.>"])


@pytest.mark.parametrize("style", ["async_session", "sync_session", "writes", "batch"])
async def test_a_handler_publishes_through_the_outbox_once_per_message(
    style: str, database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Each handler style adds one outbox row per message in its transaction: the worker's
    relay publishes each row once, with the row's msg-id, and marks it published."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url, batch=16, concurrency=16)

    if style == "async_session":

        @app.handler(stream=STREAM, subject="ORDERS.created", name="h")
        async def h(msg: eop.Message, session: AsyncSession) -> None:
            await session.execute(EFFECT, {"h": "h", "k": msg.idempotency_key, "b": msg.text()})
            eop.outbox.add(session, OUT_SUBJECT, msg.data, headers={"Order": msg.text()})

    elif style == "sync_session":

        @app.handler(stream=STREAM, subject="ORDERS.created", name="h")
        def h_sync(msg: eop.Message, session: Session) -> None:
            session.execute(EFFECT, {"h": "h", "k": msg.idempotency_key, "b": msg.text()})
            eop.outbox.add(session, OUT_SUBJECT, msg.data, headers={"Order": msg.text()})

    elif style == "writes":

        @app.handler(stream=STREAM, subject="ORDERS.created", name="h")
        async def h_writes(msg: eop.Message, writes: eop.Writes) -> None:
            writes.add(EFFECT, {"h": "h", "k": msg.idempotency_key, "b": msg.text()})
            eop.outbox.add(writes, OUT_SUBJECT, msg.data, headers={"Order": msg.text()})

    else:

        @app.handler(stream=STREAM, subject="ORDERS.created", name="h", batch=True)
        def h_batch(msgs: list[eop.Message], writes: eop.Writes) -> None:
            for msg in msgs:
                writes.add(EFFECT, {"h": "h", "k": msg.idempotency_key, "b": msg.text()})
                eop.outbox.add(writes, OUT_SUBJECT, msg.data, headers={"Order": msg.text()})

    await ensure_streams(js)
    bodies = [f"o{i}" for i in range(60)]
    for body in bodies:
        await js.publish("ORDERS.created", body.encode())
    async with running(app) as worker:
        await wait_for(lambda: drained(js, "eop-h"), what="input drained")
        await wait_for(lambda: equals(out_count(js), 60), what="60 messages published")
        await wait_for(lambda: equals(outbox_rows(engine, "published_at IS NULL"), 0))
        assert worker.relay is not None
        assert worker.relay.published == 60
    stored = await out_messages(js)
    assert sorted(data.decode() for _, _, data in stored) == sorted(bodies)
    msg_ids = await _msg_ids_by_row(engine)
    assert sorted(msg_id for _, msg_id, _ in stored) == sorted(msg_ids.values())
    seqs = await _seqs_by_row(engine)
    assert sorted(seqs) == [seq for seq, _, _ in stored]


async def _msg_ids_by_row(engine: AsyncEngine) -> dict[int, str]:
    async with engine.connect() as conn:
        rows = await conn.execute(sa.text("SELECT id, msg_id FROM eop.outbox"))
        return {int(r[0]): str(r[1]) for r in rows}


async def _seqs_by_row(engine: AsyncEngine) -> list[int]:
    async with engine.connect() as conn:
        rows = await conn.execute(sa.text("SELECT stream_seq FROM eop.outbox ORDER BY id"))
        return [int(r[0]) for r in rows]


async def test_a_declared_stream_only_the_outbox_publishes_to_is_created_by_the_worker(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A stream the app declares but no handler consumes (the outbox's destination) is
    created when the worker starts, so rows to it are published, not parked."""
    app = make_app(database_url, nats_url, outbox_max_attempts=1)

    @app.handler(stream=STREAM, subject="ORDERS.created", name="h")
    async def h(msg: eop.Message, session: AsyncSession) -> None:
        eop.outbox.add(session, OUT_SUBJECT, msg.data)

    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    await js.publish("ORDERS.created", b"one")
    async with running(app):
        await wait_for(lambda: equals(out_count(js), 1), what="published to the new stream")
    assert await outbox_rows(engine, "parked_at IS NOT NULL") == 0


async def test_a_failing_handler_in_a_batch_leaves_no_outbox_row_and_its_neighbours_publish(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A rolled-back handler's outbox row goes with its savepoint (never published);
    its batch neighbours' rows commit and are published once."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url, batch=16, concurrency=16, max_attempts=1)

    @app.handler(stream=STREAM, subject="ORDERS.created", name="h")
    async def h(msg: eop.Message, writes: eop.Writes) -> None:
        eop.outbox.add(writes, OUT_SUBJECT, msg.data)
        if msg.text() == "bad":
            raise eop.Reject("bad order")

    await ensure_streams(js)
    for body in ["a", "b", "bad", "c", "d"]:
        await js.publish("ORDERS.created", body.encode())
    async with running(app):
        await wait_for(lambda: drained(js, "eop-h"), what="input drained")
        await wait_for(lambda: equals(outbox_rows(engine, "published_at IS NOT NULL"), 4))
    assert await outbox_rows(engine) == 4
    stored = sorted(data.decode() for _, _, data in await out_messages(js))
    assert stored == ["a", "b", "c", "d"]


async def test_the_apps_own_async_session_publishes_on_commit_only(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Outside handlers: a row added on an AsyncSession is written at COMMIT; a rollback,
    or a rolled-back savepoint, drops the rows added in it, and only those."""
    app = make_app(database_url, nats_url)
    await ensure_streams(js)
    async with app.sessionmaker() as session:
        eop.outbox.add(session, OUT_SUBJECT, b"kept-1")
        async with session.begin_nested():
            eop.outbox.add(session, OUT_SUBJECT, b"released-savepoint")
        with contextlib.suppress(RuntimeError):
            async with session.begin_nested():
                eop.outbox.add(session, OUT_SUBJECT, b"rolled-back-savepoint")
                raise RuntimeError("the savepoint rolls back")
        eop.outbox.add(session, OUT_SUBJECT, b"kept-2")
        await session.commit()
    async with app.sessionmaker() as session:
        eop.outbox.add(session, OUT_SUBJECT, b"rolled-back")
        await session.rollback()
    async with app.sessionmaker() as session, session.begin():
        eop.outbox.add(session, OUT_SUBJECT, b"with-begin")
    async with relaying(app, nats_url):
        await wait_for(lambda: equals(outbox_rows(engine, "published_at IS NULL"), 0))
        await wait_for(lambda: equals(out_count(js), 4))
    stored = [data.decode() for _, _, data in await out_messages(js)]
    assert stored == ["kept-1", "released-savepoint", "kept-2", "with-begin"]
    await app.dispose()


async def test_a_sync_session_and_a_schema_given_by_name_write_at_once(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A plain sync Session (not made by eop) inserts the row at once, in its transaction;
    it is published in id order with the rest, and a rolled-back one never."""
    app = make_app(database_url, nats_url)
    await ensure_streams(js)
    sync_engine = sa.create_engine(database_url.replace("+asyncpg", "+psycopg"))
    try:
        with Session(sync_engine) as session, session.begin():
            for i in range(3):
                eop.outbox.add(session, OUT_SUBJECT, f"sync-{i}", schema="eop")
        with Session(sync_engine) as session:
            eop.outbox.add(session, OUT_SUBJECT, "never", schema="eop")
            session.rollback()
    finally:
        sync_engine.dispose()
    async with relaying(app, nats_url):
        await wait_for(lambda: equals(outbox_rows(engine, "published_at IS NULL"), 0))
    stored = [data.decode() for _, _, data in await out_messages(js)]
    assert stored == ["sync-0", "sync-1", "sync-2"]
    await app.dispose()


async def test_a_commit_wakes_the_relay_through_notify(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The relay LISTENs while it leads: a COMMIT that added rows sends it a NOTIFY, which
    starts a round (polling is set to once a minute here, so only NOTIFY can explain it)."""
    app = make_app(database_url, nats_url, outbox_poll_s=60.0)
    await ensure_streams(js)
    async with relaying(app, nats_url) as relay:
        await wait_for(lambda: _true(relay.leading), what="the relay leads")
        await asyncio.sleep(0.5)  # its first round (and LISTEN) are done
        async with app.sessionmaker() as session, session.begin():
            eop.outbox.add(session, OUT_SUBJECT, b"wake up")
        await wait_for(lambda: equals(out_count(js), 1), what="published")
        assert relay.notifications >= 1
    await app.dispose()


async def _true(value: bool) -> bool:
    return value


class _Unconnected:
    """A second publishing target, never connected: it sends nothing."""

    target = "the archive"

    async def publish(self, rows: Sequence[publishing.Row]) -> list[publishing.Receipt]:
        return [publishing.UNSENT] * len(rows)


async def test_a_round_another_target_could_not_take_names_that_target_and_keeps_the_rows(
    database_url: str, nats_url: str, engine: AsyncEngine
) -> None:
    """The relay's failure speaks of its publisher's target, not of NATS, when a target of
    another kind is not connected; its rows stay pending for the next round."""
    app = make_app(database_url, nats_url)
    async with app.sessionmaker() as session, session.begin():
        eop.outbox.add(session, OUT_SUBJECT, b"kept")
    relay = Relay(app.engine, _Unconnected(), app.settings)
    await relay._take_lease()
    assert relay.leading
    with pytest.raises(
        eop.errors.ServiceUnavailable, match="1 of 1 outbox messages not sent: the archive"
    ):
        await relay.round()
    assert await outbox_rows(engine, "published_at IS NULL") == 1
    await app.dispose()


async def test_two_relays_publish_every_row_once_in_id_order(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Two relays at once: one holds the lease and publishes, the other stands by; every row
    reaches the stream once, in id order; when the leader stops, the other takes over."""
    app = make_app(database_url, nats_url, relay_lease_s=2.0, outbox_batch=50)
    await ensure_streams(js)

    async def add(n: int, prefix: str) -> None:
        for i in range(n):
            async with app.sessionmaker() as session, session.begin():
                eop.outbox.add(session, OUT_SUBJECT, f"{prefix}{i:04d}")

    async with relaying(app, nats_url) as first, relaying(app, nats_url) as second:
        await add(300, "a")
        await wait_for(lambda: equals(outbox_rows(engine, "published_at IS NULL"), 0))
        assert (first.published == 0) != (second.published == 0)
        leader = first if first.published else second
    async with relaying(app, nats_url) as third:
        await add(50, "b")
        await wait_for(lambda: equals(outbox_rows(engine, "published_at IS NULL"), 0))
        assert third.published == 50
    stored = [data.decode() for _, _, data in await out_messages(js)]
    assert stored == [f"a{i:04d}" for i in range(300)] + [f"b{i:04d}" for i in range(50)]
    assert leader.published == 300
    await app.dispose()


async def test_bad_messages_are_refused_when_added(database_url: str, nats_url: str) -> None:
    """A subject with a wildcard or a space, a bad header name, a line break in a value, or a
    message above max_payload raises UnpublishableMessage at add time; nothing is written."""
    app = make_app(database_url, nats_url, outbox_max_payload=1000)
    async with app.sessionmaker() as session:
        for subject in ["ORDERS.*", "ORDERS.>", "a b", "", "ORDERS..x"]:
            with pytest.raises(eop.UnpublishableMessage, match="subject"):
                eop.outbox.add(session, subject, b"x")
        with pytest.raises(eop.UnpublishableMessage, match="header name"):
            eop.outbox.add(session, OUT_SUBJECT, b"x", headers={"Bad Name": "v"})
        with pytest.raises(eop.UnpublishableMessage, match="header"):
            eop.outbox.add(session, OUT_SUBJECT, b"x", headers={"X-Ok": "line\r\nbreak"})
        with pytest.raises(eop.PayloadTooLarge, match="max_payload of 1000"):
            eop.outbox.add(session, OUT_SUBJECT, b"x" * 1000)
        await session.commit()
    assert await scalar(app.engine, "SELECT count(*) FROM eop.outbox") == 0
    await app.dispose()


async def test_a_subject_no_stream_holds_is_parked_then_retried_by_the_operator(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """JetStream says no stream holds the subject, outbox_max_attempts times: the row is
    parked with its reason, later rows of other subjects go on; once a stream exists,
    `retry` queues it again and it is published."""
    app = make_app(database_url, nats_url, outbox_max_attempts=2)
    await ensure_streams(js)
    async with app.sessionmaker() as session, session.begin():
        eop.outbox.add(session, "NOWHERE.x", b"lost?")
        eop.outbox.add(session, OUT_SUBJECT, b"fine")
    from eop.outbox import operations as ops

    async with relaying(app, nats_url) as relay:
        await wait_for(lambda: equals(outbox_rows(engine, "parked_at IS NOT NULL"), 1), 60)
        assert relay.parked == 1
        assert await out_count(js) == 1
        (row,) = await ops.Outbox(app).rows("parked")
        assert row["park_reason"] == "no_stream"
        assert row["attempts"] == 2
        assert "no stream holds subject NOWHERE.x" in row["last_error"]
        await js.add_stream(name="NOWHERE", subjects=["NOWHERE.>"])
        assert await ops.Outbox(app).retry(ids=[row["id"]]) == [row["id"]]
        relay.wake()
        await wait_for(lambda: equals(out_count(js, "NOWHERE"), 1), what="retried row sent")
    await app.dispose()


async def test_published_rows_are_deleted_after_outbox_keep_s(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The leading relay deletes rows published longer than outbox_keep_s ago, so the table
    stays small; unpublished rows stay."""
    app = make_app(database_url, nats_url, outbox_keep_s=0.0)
    await ensure_streams(js)
    async with app.sessionmaker() as session, session.begin():
        for i in range(20):
            eop.outbox.add(session, OUT_SUBJECT, f"p{i}")
    async with relaying(app, nats_url):
        await wait_for(lambda: equals(out_count(js), 20))
        await wait_for(lambda: equals(outbox_rows(engine), 0), what="purged", timeout_s=30)
    await app.dispose()


async def test_headers_and_msg_ids_reach_the_stream_as_given(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A caller's msg_id (or Nats-Msg-Id header) and headers are published as given; the
    server drops a second row with the same msg-id inside its duplicate window."""
    app = make_app(database_url, nats_url)
    await ensure_streams(js)
    async with app.sessionmaker() as session, session.begin():
        first = eop.outbox.add(session, OUT_SUBJECT, b"1", msg_id="order-1", headers={"K": "v"})
        again = eop.outbox.add(session, OUT_SUBJECT, b"1", headers={"Nats-Msg-Id": "order-1"})
    assert first == again == "order-1"
    async with relaying(app, nats_url):
        await wait_for(lambda: equals(outbox_rows(engine, "published_at IS NULL"), 0))
    stored = await js.get_msg(OUT_STREAM, 1)
    assert stored.headers == {"K": "v", "Nats-Msg-Id": "order-1"}
    assert await out_count(js) == 1
    await app.dispose()


async def test_a_writer_can_leave_notify_out_and_its_rows_are_still_polled(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """With eop.outbox_notify off in its session, a COMMIT sends no NOTIFY (PostgreSQL
    serialises notifying COMMITs); the relay's polling publishes the row all the same."""
    app = make_app(database_url, nats_url, outbox_poll_s=0.5)
    await ensure_streams(js)
    async with relaying(app, nats_url) as relay:
        await wait_for(lambda: _true(relay.leading), what="the relay leads")
        await asyncio.sleep(1.0)  # its LISTEN is in place
        async with app.sessionmaker() as session, session.begin():
            await session.execute(sa.text("SET LOCAL eop.outbox_notify = off"))
            eop.outbox.add(session, OUT_SUBJECT, b"quiet")
        await wait_for(lambda: equals(out_count(js), 1), what="published by polling")
        assert relay.notifications == 0


_RAW_ROW = sa.text(
    "INSERT INTO eop.outbox (msg_id, subject, headers, payload) VALUES (:m, :s, :h, :p)"
).bindparams(sa.bindparam("h", type_=sa.LargeBinary), sa.bindparam("p", type_=sa.LargeBinary))


async def test_rows_nats_cannot_frame_are_parked_and_the_rows_after_them_still_go_out(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Rows not written by eop.outbox.add (plain SQL, another version) that NATS cannot
    frame are parked: a header name it refuses (bad_header), more of them than one round
    holds, and a subject with a space (refused). The rows after them are still published.
    (nats-py refused them after taking one of publish_async's outbox_batch slots, never
    given back: once they were spent, the relay waited for a slot for ever; and the
    refused subject failed every round, holding back the whole outbox.)"""
    app = make_app(database_url, nats_url, outbox_batch=2)
    await ensure_streams(js)
    async with engine.begin() as conn:
        bad = json.dumps({"Bad Name": "x"}).encode()
        for i in range(3):
            await conn.execute(_RAW_ROW, {"m": f"bad-{i}", "s": OUT_SUBJECT, "h": bad, "p": b"?"})
        row = {"m": "spaced", "s": "SHIPMENTS.a b", "h": b"{}", "p": b"?"}
        await conn.execute(_RAW_ROW, row)
    async with app.sessionmaker() as session, session.begin():
        eop.outbox.add(session, OUT_SUBJECT, b"good")
    async with relaying(app, nats_url) as relay:
        await wait_for(lambda: equals(out_count(js), 1), what="the good row published")
        await wait_for(lambda: equals(outbox_rows(engine, "parked_at IS NOT NULL"), 4))
        assert relay.parked == 4
    stored = [data for _, _, data in await out_messages(js)]
    assert stored == [b"good"]
    assert await outbox_rows(engine, "park_reason = 'bad_header'") == 3
    assert await outbox_rows(engine, "park_reason = 'refused'") == 1
    await app.dispose()


async def test_a_nats_outage_with_more_pending_than_the_reconnect_buffer_does_not_wedge_the_relay(
    database_url: str, nats_server: Any, js: Any, engine: AsyncEngine
) -> None:
    """Rows larger in all than nats-py's reconnect buffer (2 MB) wait while NATS is down:
    the relay's rounds fail and are tried again without counting or parking anything,
    and every row is published and marked once NATS is back. (nats-py refuses a publish
    once that buffer is full after it took one of publish_async's slots, and never gives
    it back: a few rounds into the outage the relay waited for a slot for ever.)"""
    app = make_app(database_url, nats_server.url, outbox_batch=2, publish_timeout_s=0.5)
    await ensure_streams(js)
    async with relaying(app, nats_server.url) as relay:
        await wait_for(lambda: _true(relay.leading), what="the relay leads")
        await asyncio.to_thread(nats_server.stop)
        # Added while it leads (its NOTIFY wakes it): it tries them during the outage.
        async with app.sessionmaker() as session, session.begin():
            for i in range(4):
                eop.outbox.add(session, OUT_SUBJECT, bytes([65 + i]) * 700_000)
        await asyncio.sleep(4)
        await asyncio.to_thread(nats_server.start)
        await wait_for(
            lambda: equals(outbox_rows(engine, "published_at IS NULL"), 0), 60, "all marked"
        )
        assert relay.parked == 0
    assert await outbox_rows(engine, "parked_at IS NOT NULL") == 0
    await app.dispose()


async def test_a_connection_that_fails_to_listen_is_not_handed_out_again(
    database_url: str, nats_url: str, engine: AsyncEngine
) -> None:
    """A pooled connection whose backend is gone (PostgreSQL restarted) fails the relay's
    LISTEN outside SQLAlchemy, which would hand the same dead connection out again: a
    relay that renewed its lease on a live connection and LISTENed on the dead one failed
    every round for ever. The relay drops it: the pool's next connection is a live one.
    (The alternation depends on timing; this pins its cause.)"""
    app = make_app(database_url, nats_url)
    listener = notifications.Listener(app.engine, app.settings, lambda: None)
    async with app.engine.connect() as conn:
        pid = await conn.scalar(sa.text("SELECT pg_backend_pid()"))
    async with engine.connect() as admin:
        await admin.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    await asyncio.sleep(0.5)  # the idle connection sees its socket closed
    with pytest.raises(Exception, match="closed"):
        await listener.listen()
    async with app.engine.connect() as conn:
        assert await conn.scalar(sa.text("SELECT pg_backend_pid()")) != pid
    await app.dispose()


async def test_a_relay_waiting_on_postgresql_at_a_stop_stops_while_it_still_waits(
    database_url: str, nats_url: str, engine: AsyncEngine
) -> None:
    """A stop while the relay's lease renewal waits on a lock PostgreSQL never grants:
    the renewal is abandoned after publish_timeout_s and the relay stops, the lock still
    held. (It waited for as long as PostgreSQL did, and the worker's stop with it: a
    relay stuck on a connection that did not come held a worker's stop past 30 s.)"""
    app = make_app(database_url, nats_url, publish_timeout_s=1.0)
    nc = NATS()
    await nc.connect(nats_url)
    relay = Relay(app.engine, JetStreamPublisher(nc, app.settings), app.settings)
    stopping = asyncio.Event()
    async with engine.connect() as locker:
        await locker.execute(sa.text("LOCK TABLE eop.relay_leases IN ACCESS EXCLUSIVE MODE"))
        task = asyncio.create_task(relay.run(stopping))
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()"
        )
        await wait_for(lambda: equals(scalar(engine, waiting), 1), what="a renewal waiting")
        stopping.set()
        # Not a timing: without the bound, the renewal waits until the lock is released
        # below, and this wait fails first.
        await asyncio.wait_for(task, 30)
        assert await scalar(engine, waiting) == 0  # its statement was cancelled with it
        await locker.rollback()
    assert not relay.leading
    await nc.close()
    await app.dispose()


@pytest.mark.parametrize("sync_pool", [False, True])
async def test_a_worker_whose_async_pool_has_one_connection_still_publishes(
    sync_pool: bool, database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A worker whose async pool has one connection: an app with sync handlers only on the
    async engine and one connection per process, or one given a psycopg sync pool with
    4 connections per process (what `eop worker --processes 4` gives each process by
    default), which keeps one for the async pool. Its relay polls instead of holding that
    connection to LISTEN, so its rounds get it, and every row is published. (It LISTENed
    on it: each round then waited for the pool's 30 s timeout, and nothing was ever
    published.)"""
    await create_effects_table(engine)
    sessions = None
    if sync_pool:
        psycopg_url = sync_url(sa.make_url(database_url))
        sessions = orm.sessionmaker(sa.create_engine(psycopg_url, pool_size=3, max_overflow=0))
    app = make_app(
        database_url,
        nats_url,
        sync_sessionmaker=sessions,
        db_pool_size=4 if sync_pool else 1,
        concurrency=4,
        batch=4,
    )

    @app.handler(stream=STREAM, subject="ORDERS.created", name="h")
    def h(msg: eop.Message, session: Session) -> None:
        session.execute(EFFECT, {"h": "h", "k": msg.idempotency_key, "b": msg.text()})
        eop.outbox.add(session, OUT_SUBJECT, msg.data)

    assert app.connection_shares() == ((1, 3) if sync_pool else (1, 0))
    await ensure_streams(js)
    for i in range(5):
        await js.publish("ORDERS.created", f"o{i}".encode())
    async with running(app):
        await wait_for(lambda: drained(js, "eop-h"), what="input drained")
        await wait_for(lambda: equals(out_count(js), 5), what="5 messages published")
        await wait_for(lambda: equals(outbox_rows(engine, "published_at IS NULL"), 0))
    await app.dispose()
