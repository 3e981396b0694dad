"""`eop dlq`: dead letters listed, shown, purged, and replayed exactly once, even repeated."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop
from eop import errors
from eop.ops import dlq

from .bed import (
    STREAM,
    SUBJECT,
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    record_effect,
    running,
    scalar,
    wait_for,
)


class Healable:
    """A handler that rejects poison until healed (as a fixed deployment would not)."""

    def __init__(self) -> None:
        self.healed = False
        self.calls = 0


def make_app(
    database_url: str, nats_url: str, healable: Healable, duplicate_window_s: float = 120.0
) -> eop.App:
    app = eop.App(settings=bed_settings(database_url, nats_url))
    app.stream(STREAM, subjects=["ORDERS.>"], duplicate_window_s=duplicate_window_s)

    @app.handler(stream=STREAM, subject=SUBJECT, name="billing")
    async def bill(msg: eop.Message, session: AsyncSession) -> None:
        healable.calls += 1
        if msg.data.startswith(b"poison") and not healable.healed:
            raise eop.Reject("poison is not billable")
        await record_effect(session, "billing", msg)

    return app


async def dead_lettered(app: eop.App, js: Any, engine: AsyncEngine, *bodies: str) -> list[int]:
    """Publish ``bodies`` with a running worker; return the dead letter ids (oldest first)."""
    await create_effects_table(engine)
    async with running(app):
        for i, body in enumerate(bodies):
            await js.publish(
                SUBJECT,
                body.encode(),
                headers={"Nats-Msg-Id": f"orig-{i}", "Authorization": "Bearer s3cr3t", "X": "1"},
            )
        await wait_for(lambda: drained(js, "eop-billing", engine=engine), what="the dead letters")
    return await dlq.DeadLetters(app).ids(dlq.Filters())


async def stream_messages(js: Any) -> int:
    return int((await js.stream_info(STREAM)).state.messages)


async def test_published_replay_is_processed_once_and_a_second_replay_is_a_no_op(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Replay publishes with a fresh msg-id; the worker applies it once; replaying again says so."""
    healable = Healable()
    app = make_app(database_url, nats_url, healable)
    [dl] = await dead_lettered(app, js, engine, "ok", "poison-1")
    healable.healed = True
    replayer = dlq.Replayer(app, js)
    first = await replayer.replay(dl)
    assert first.status == "published"
    assert first.msg_id == dlq.replay_msg_id({"subscription": "billing", "stream": STREAM,
                                              "stream_seq": 2, "id": dl}, 1)  # fmt: skip
    # The secret header was stored redacted: the replay leaves it out, keeps the rest.
    assert "Authorization" in first.detail
    msg = await js.get_msg(STREAM, first.stream_seq)
    assert msg.headers["Nats-Msg-Id"] == first.msg_id
    assert msg.headers["X"] == "1"
    assert msg.headers[dlq.REPLAY_OF_HEADER] == str(dl)
    assert "Authorization" not in msg.headers
    async with running(app):
        await wait_for(lambda: drained(js, "eop-billing", engine=engine), what="the replay")
        second = await replayer.replay(dl)
        assert second.status == "skipped"
        assert "already replayed" in second.detail
        await wait_for(lambda: drained(js, "eop-billing", engine=engine), what="nothing more")
    assert await effects_by_body(engine) == {"ok": 1, "poison-1": 1}
    assert await stream_messages(js) == 3
    row = await dlq.DeadLetters(app).get(dl)
    assert row["replayed_at"] is not None
    assert row["replay_stream_seq"] == first.stream_seq
    assert dlq.replay_state(row) == f"publish #1 seq {first.stream_seq}"


class CrashAfterPublish(dlq.Replayer):
    """Dies between the publish and the bookkeeping that records it."""

    async def _finish(self, intent: Any, seq: int) -> None:
        raise SystemExit("crash after publish")


class CrashBeforePublish(dlq.Replayer):
    """Dies after committing the intent, before publishing."""

    async def _publish(self, intent: Any) -> tuple[int, bool, list[str]]:
        raise SystemExit("crash before publish")


class BlindScan(dlq.Replayer):
    """Resumes without finding the earlier publish in the stream (clock skew, say)."""

    async def _find_in_stream(self, intent: Any) -> int | None:
        return None


async def test_crash_between_publish_and_bookkeeping_is_resumed_without_a_second_message(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The next run finds the intent unfinished and its message in the stream: no new publish."""
    healable = Healable()
    app = make_app(database_url, nats_url, healable)
    [dl] = await dead_lettered(app, js, engine, "poison-1")
    healable.healed = True
    with pytest.raises(SystemExit):
        await CrashAfterPublish(app, js).replay(dl)
    assert dlq.replay_state(await dlq.DeadLetters(app).get(dl)) == "pending"
    assert await stream_messages(js) == 2
    resumed = await dlq.Replayer(app, js).replay(dl)
    assert resumed.status == "recovered"
    assert resumed.stream_seq == 2
    assert await stream_messages(js) == 2
    async with running(app):
        await wait_for(lambda: drained(js, "eop-billing", engine=engine), what="the replay")
    assert await effects_by_body(engine) == {"poison-1": 1}
    assert (await dlq.Replayer(app, js).replay(dl)).status == "skipped"


async def test_crash_before_publish_is_resumed_with_the_same_msg_id(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Intent committed, nothing published: the next run publishes under the recorded msg-id."""
    healable = Healable()
    app = make_app(database_url, nats_url, healable)
    [dl] = await dead_lettered(app, js, engine, "poison-1")
    with pytest.raises(SystemExit):
        await CrashBeforePublish(app, js).replay(dl)
    pending = await dlq.DeadLetters(app).get(dl)
    resumed = await dlq.Replayer(app, js).replay(dl)
    assert resumed.status == "published"
    assert resumed.msg_id == pending["replay_msg_id"]
    assert resumed.generation == 1
    assert await stream_messages(js) == 2


async def test_resume_that_misses_its_message_is_stopped_by_the_duplicate_window(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Crash after publish, scan misses it: the same msg-id again is a server-side duplicate."""
    healable = Healable()
    app = make_app(database_url, nats_url, healable)
    [dl] = await dead_lettered(app, js, engine, "poison-1")
    with pytest.raises(SystemExit):
        await CrashAfterPublish(app, js).replay(dl)
    resumed = await BlindScan(app, js).replay(dl)
    assert resumed.status == "duplicate"
    assert resumed.stream_seq == 2
    assert await stream_messages(js) == 2


async def test_republish_after_the_duplicate_window_is_skipped_by_the_inbox_msg_id_guard(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Past the server's window, a blind resume publishes again; the handler applies it once."""
    healable = Healable()
    app = make_app(database_url, nats_url, healable, duplicate_window_s=0.5)
    [dl] = await dead_lettered(app, js, engine, "poison-1")
    healable.healed = True
    with pytest.raises(SystemExit):
        await CrashAfterPublish(app, js).replay(dl)
    async with running(app):
        await wait_for(lambda: drained(js, "eop-billing", engine=engine), what="the first replay")
        await asyncio.sleep(1.0)  # past the duplicate window: the server has forgotten the id
        resumed = await BlindScan(app, js).replay(dl)
        assert resumed.status == "published"
        assert resumed.stream_seq == 3
        await wait_for(lambda: drained(js, "eop-billing", engine=engine), what="the second copy")
    assert await effects_by_body(engine) == {"poison-1": 1}
    dup = await scalar(engine, "SELECT count(*) FROM eop.inbox WHERE stream_seq = 3")
    assert dup == 0  # skipped by msg-id, never claimed


async def test_again_replays_a_second_time_under_a_new_msg_id(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Only --again makes a new generation: a new msg-id and a second message."""
    app = make_app(database_url, nats_url, Healable())
    [dl] = await dead_lettered(app, js, engine, "poison-1")
    replayer = dlq.Replayer(app, js)
    first = await replayer.replay(dl)
    again = await replayer.replay(dl, again=True)
    assert again.status == "published"
    assert again.generation == 2
    assert again.msg_id != first.msg_id
    assert await stream_messages(js) == 3


async def test_concurrent_replays_of_one_dead_letter_publish_once(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Two operators at once: the row lock orders them, one message in the stream."""
    app = make_app(database_url, nats_url, Healable())
    [dl] = await dead_lettered(app, js, engine, "poison-1")
    results = await asyncio.gather(*(dlq.Replayer(app, js).replay(dl) for _ in range(4)))
    assert await stream_messages(js) == 2
    assert sorted(r.status for r in results).count("published") <= 1
    assert {r.msg_id for r in results} == {results[0].msg_id}


async def test_rerun_runs_the_handler_once_in_the_bookkeeping_transaction(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """--rerun applies the effect once, flips the inbox row; a repeat of either kind is a no-op."""
    healable = Healable()
    app = make_app(database_url, nats_url, healable)
    [dl] = await dead_lettered(app, js, engine, "poison-1")
    failed = await dlq.Replayer(app).replay(dl, mode="rerun")
    assert failed.status == "failed"
    assert "not billable" in failed.detail
    assert dlq.replay_state(await dlq.DeadLetters(app).get(dl)) == "-"
    healable.healed = True
    results = await asyncio.gather(*(dlq.Replayer(app).replay(dl, mode="rerun") for _ in range(3)))
    assert sorted(r.status for r in results) == ["rerun", "skipped", "skipped"]
    assert await effects_by_body(engine) == {"poison-1": 1}
    outcome = await scalar(engine, "SELECT outcome FROM eop.inbox WHERE stream_seq = 1")
    assert outcome == "processed"
    assert (await dlq.Replayer(app, js).replay(dl)).status == "skipped"
    assert await stream_messages(js) == 1


async def test_rerun_refuses_while_a_published_replay_is_unfinished(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A pending publish may still be processed by a worker: a rerun would be a second effect."""
    app = make_app(database_url, nats_url, Healable())
    [dl] = await dead_lettered(app, js, engine, "poison-1")
    with pytest.raises(SystemExit):
        await CrashAfterPublish(app, js).replay(dl)
    with pytest.raises(errors.ReplayRefused, match="in flight"):
        await dlq.Replayer(app).replay(dl, mode="rerun")


async def test_publish_is_refused_when_other_consumers_would_get_the_message(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Another durable consumer of the subject would reprocess the replay: refused unless asked."""
    app = make_app(database_url, nats_url, Healable())

    @app.handler(stream=STREAM, subject="ORDERS.*", name="audit")
    async def audit(msg: eop.Message, session: AsyncSession) -> None:
        pass

    [dl] = await dead_lettered(app, js, engine, "poison-1")
    with pytest.raises(errors.ReplayRefused, match="eop-audit"):
        await dlq.Replayer(app, js).replay(dl)
    assert dlq.replay_state(await dlq.DeadLetters(app).get(dl)) == "-"
    assert (await dlq.Replayer(app, js, allow_fanout=True).replay(dl)).status == "published"


async def insert_dead_letter(
    engine: AsyncEngine, handler: str, reason: str, error: str, age: datetime.timedelta, seq: int
) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "INSERT INTO eop.dead_letters (subscription, stream, stream_epoch, stream_seq,"
                " fingerprint, subject, headers, payload, reason, error, delivery_count,"
                " created_at) VALUES (:h, 'S', 'e', :seq, '\\x00', 'S.a', '{\"Token\": \"***\"}',"
                " :payload, :r, :e, 3, now() - CAST(:age AS interval))"
            ),
            {"h": handler, "seq": seq, "payload": b"x" * seq, "r": reason, "e": error, "age": age},
        )


async def test_filters_select_by_handler_reason_and_time_and_purge_deletes_them(
    database_url: str, engine: AsyncEngine
) -> None:
    """Filters (handler, ILIKE on reason or error, since/until) select for list and purge."""
    hour = datetime.timedelta(hours=1)
    await insert_dead_letter(engine, "a", "rejected", "bad VAT number", 3 * hour, 1)
    await insert_dead_letter(engine, "a", "attempts_exhausted", "timeout 100%", 1 * hour, 2)
    await insert_dead_letter(engine, "b", "undecodable", "not JSON", 0 * hour, 3)
    app = eop.App(database_url=database_url)
    store = dlq.DeadLetters(app)

    async def seqs(**kw: Any) -> list[int]:
        return [r["stream_seq"] for r in await store.rows(dlq.Filters(**kw))]

    try:
        assert await seqs() == [3, 2, 1]
        assert await seqs(handler="a") == [2, 1]
        assert await seqs(reason="vat") == [1]
        assert await seqs(reason="EXHAUSTED") == [2]
        assert await seqs(reason="100%") == [2]
        assert await seqs(reason="_") == [2]  # literal underscore (attempts_exhausted)
        assert await seqs(since=dlq.parse_when("2h")) == [3, 2]
        assert await seqs(until=dlq.parse_when("30m")) == [2, 1]
        assert await seqs(limit=1) == [3]
        [b_id] = await store.ids(dlq.Filters(handler="b"))
        one = await store.get(b_id)
        assert one["payload_size"] == 3
        assert "payload" not in one
        with pytest.raises(errors.DeadLetterNotFound):
            await store.get(999_999)
        assert await store.purge(dlq.Filters(handler="a", until=dlq.parse_when("2h"))) == 1
        assert await seqs() == [3, 2]
        assert await store.purge(dlq.Filters()) == 2
    finally:
        await app.dispose()
