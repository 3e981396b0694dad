"""`eop audit` against real JetStream and PostgreSQL: clean runs, and each anomaly provoked."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import eop
from eop.broker import consumers, jetstream
from eop.ops import audit
from eop.protocol import unacked

from . import auditapp
from .bed import STREAM, SUBJECT, bed_settings, drained, insert_inbox, publish, running, wait_for

if TYPE_CHECKING:
    from collections.abc import Mapping

ROOT = Path(__file__).resolve().parents[2]


def make_app(database_url: str, nats_url: str, **changes: Any) -> eop.App:
    """An app with one handler, `billing`, on ORDERS.created (effects go to the inbox only).

    The same handler as ``auditapp.app``, which the `eop audit` subprocesses load.
    """
    app = eop.App(settings=bed_settings(database_url, nats_url, **changes))
    app.stream(STREAM, subjects=["ORDERS.>"], storage="file")
    app.handler(stream=STREAM, subject=SUBJECT, name="billing")(auditapp.bill)
    return app


async def process(app: eop.App, js: Any, bodies: list[str], **publish_kw: Any) -> None:
    """Publish ``bodies`` and run a worker until the consumer has acked them all."""
    async with running(app):
        for body in bodies:
            await publish(js, body, **publish_kw)
        await wait_for(lambda: drained(js, "eop-billing"), what="all messages acked")


async def audit_of(app: eop.App, **options: Any) -> audit.HandlerAudit:
    """Audit `billing` on a copy of the app (run() disposes the app's engine)."""
    report = await audit.run(app.with_settings(), ["billing"], audit.Options(**options))
    return report.handlers[0]


def kinds(h: audit.HandlerAudit) -> dict[str, list[int | None]]:
    """The anomalies found, as kind -> sequences."""
    found: dict[str, list[int | None]] = {}
    for a in h.anomalies:
        found.setdefault(a.kind, []).append(a.seq)
    return found


async def test_clean_run_checks_every_message_and_finds_nothing(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """After a drained worker: every message checked, one outcome each, no anomaly."""
    app = make_app(database_url, nats_url, compaction_interval_s=0)
    await process(app, js, [f"m{i}" for i in range(30)] + ["poison"])
    h = await audit_of(app)
    assert h.clean, h.anomalies
    assert (h.checked, h.processed.count, h.compacted) == (31, 30, 0)
    assert {r: t.count for r, t in h.dead_lettered_by_rule.items()} == {"rejected": 1}
    assert h.settled
    assert (h.range_from, h.range_to) == (1, 31)


async def test_compacted_messages_are_counted_not_flagged(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Rows compacted below the watermark are counted; msg-id rows kept there still verify."""
    app = make_app(database_url, nats_url, compaction_interval_s=0.1)
    await process(app, js, [f"m{i}" for i in range(10)])
    await process(app, js, [f"k{i}" for i in range(5)], msg_id=None)
    async with running(app):
        for i in range(5):
            await publish(js, f"id{i}", msg_id=f"id-{i}")
        await wait_for(lambda: drained(js, "eop-billing"))

        async def compacted() -> bool:
            async with engine.connect() as conn:
                wm = (
                    await conn.execute(sa.text("SELECT max(watermark) FROM eop.watermarks"))
                ).scalar()
                return bool(wm and wm >= 20)

        await wait_for(compacted, what="the watermark to pass everything")
        await asyncio.sleep(0.3)  # one more compaction round deletes the rows below it
    h = await audit_of(app)
    assert h.clean, h.anomalies
    assert h.checked == 20
    assert h.compacted == 15
    assert h.verified_below_watermark == 5  # the msg-id rows are kept for msg_id_retention_s


async def test_deleted_inbox_row_above_the_watermark_is_acked_without_outcome(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """An acked message whose inbox row vanished (above the watermark) is reported, by seq."""
    app = make_app(database_url, nats_url, compaction_interval_s=0)
    await process(app, js, [f"m{i}" for i in range(10)])
    async with engine.begin() as conn:
        await conn.execute(sa.text("DELETE FROM eop.inbox WHERE stream_seq = 4"))
    h = await audit_of(app)
    assert kinds(h) == {"acked_without_outcome": [4]}


async def test_outcome_of_a_deleted_message_and_interior_deletes(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A message deleted after its outcome is reported; one deleted before delivery is not."""
    app = make_app(database_url, nats_url, compaction_interval_s=0)
    async with running(app):
        await wait_for(lambda: drained(js, "eop-billing"), what="the consumer")
    for i in range(10):
        await publish(js, f"m{i}")
    await js.delete_msg(STREAM, 3)  # never delivered: no outcome expected
    await process(app, js, [])
    await js.delete_msg(STREAM, 6)  # deleted after its outcome committed
    h = await audit_of(app)
    assert kinds(h) == {"outcome_message_gone": [6]}
    assert h.checked == 8


async def test_subject_filtered_consumer_gives_no_false_positives(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Messages on other subjects of the stream are neither walked nor missing."""
    app = make_app(database_url, nats_url, compaction_interval_s=0)
    async with running(app):
        for i in range(12):
            await publish(js, f"m{i}", subject=SUBJECT if i % 3 else "ORDERS.other")
        await wait_for(lambda: drained(js, "eop-billing"))
    h = await audit_of(app)
    assert h.clean, h.anomalies
    assert (h.checked, h.processed.count, h.filters) == (8, 8, [SUBJECT])


async def test_changed_fingerprint_in_the_same_epoch_is_a_reused_sequence(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """An inbox row whose fingerprint is not the message's now at that sequence."""
    app = make_app(database_url, nats_url, compaction_interval_s=0)
    await process(app, js, [f"m{i}" for i in range(5)])
    async with engine.begin() as conn:
        await conn.execute(
            sa.text("UPDATE eop.inbox SET fingerprint = '\\x00'::bytea WHERE stream_seq = 2")
        )
    h = await audit_of(app)
    assert kinds(h) == {"reused_sequence": [2]}


async def test_recreated_stream_reuses_sequences(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Outcomes of the deleted stream: reused where the new one holds the sequence, else gone,
    and a note says what they are and points at --current-epoch-only."""
    app = make_app(database_url, nats_url, compaction_interval_s=0)
    await process(app, js, [f"old{i}" for i in range(5)])
    await js.delete_stream(STREAM)
    await process(app, js, [f"new{i}" for i in range(3)])
    h = await audit_of(app)
    assert kinds(h) == {"reused_sequence": [1, 2, 3], "outcome_message_gone": [4, 5]}
    assert h.processed.count == 3
    [note] = [n for n in h.notes if "earlier incarnations" in n]
    assert note.startswith("5 of the anomalies")
    assert "--current-epoch-only" in note
    assert (await audit_of(app, current_epoch_only=True)).clean


async def test_message_left_pending_and_redelivered_is_stuck(
    database_url: str, nats_url: str, js: Any, nc: Any, engine: AsyncEngine
) -> None:
    """A delivery never acked (redelivered each AckWait) is a stuck delivery, timed from
    the first reading of the consumer that found it waiting (a worker's, here by hand)."""
    app = make_app(database_url, nats_url, ack_wait_s=1.0)
    spec = app.handlers["billing"]
    await jetstream.ensure_stream(js, app.stream_spec(STREAM), create=True)
    await consumers.ensure_consumer(js, spec, app.settings, create=True)
    await publish(js, "m0")
    sub = await js.pull_subscribe_bind(durable=spec.durable, stream=STREAM)
    watch = unacked.UnackedWatch(nc, engine, app.settings, spec)
    deliveries = 0
    while deliveries < 3:
        try:
            (msg,) = await sub.fetch(1, timeout=2)
        except asyncio.TimeoutError:
            continue
        deliveries = msg.metadata.num_delivered
        if deliveries == 1:
            assert [w.floor for w in await watch.check_once()] == [0]
    h = await audit_of(app, stuck_after_s=0.5)
    assert kinds(h) == {"stuck_delivery": [1]}
    assert counted(h.in_flight) == {audit.DELIVERED_NO_OUTCOME: (1, [1])}


async def test_limit_and_range_options(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """--limit stops the walk and says where to go on; --from-seq/--to-seq bound it."""
    app = make_app(database_url, nats_url, compaction_interval_s=0)
    await process(app, js, [f"m{i}" for i in range(20)])
    h = await audit_of(app, limit=7, batch=3)
    assert (h.checked, h.truncated, h.next_seq, h.range_to) == (7, True, 8, 7)
    h = await audit_of(app, from_seq=8, to_seq=15, batch=4)
    assert (h.checked, h.truncated, h.range_from, h.range_to) == (8, False, 8, 15)
    assert h.clean


_NOT_BY_RULE = (
    "INSERT INTO eop.dead_letters (subscription, stream, stream_epoch, stream_seq, fingerprint,"
    " msg_id, subject, headers, payload, reason, error, delivery_count)"
    " SELECT i.subscription, w.stream, w.stream_epoch, i.stream_seq, i.fingerprint, i.msg_id,"
    " :subject, '{}'::jsonb, ''::bytea, :reason, :error, 6"
    " FROM eop.inbox AS i JOIN eop.watermarks AS w USING (lane) WHERE i.stream_seq = :seq"
)


async def dead_letter_by_infrastructure(engine: AsyncEngine, seq: int, reason: str) -> None:
    """Turn the processed message at ``seq`` into a dead letter no rule of eop explains.

    This is what a dead letter caused by infrastructure looks like: the
    message's own inbox row marked dead-lettered, beside a dead letter whose
    reason is not one of eop's rules, or whose error says that the message
    was delivered several times without an outcome.
    """
    error = "delivered 6 times without an outcome (max_attempts=5)"
    async with engine.begin() as conn:
        await conn.execute(
            sa.text("UPDATE eop.inbox SET outcome = 'dead_lettered' WHERE stream_seq = :seq"),
            {"seq": seq},
        )
        await conn.execute(
            sa.text(_NOT_BY_RULE),
            {"seq": seq, "reason": reason, "error": error, "subject": SUBJECT},
        )


async def eop_audit(database_url: str, nats_url: str, *args: str) -> tuple[int, str]:
    """Run `eop audit` on ``auditapp:app`` in a subprocess: its exit status and stdout."""
    env = dict(os.environ, EOP_DATABASE_URL=database_url, EOP_NATS_URL=nats_url)
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "eop", "audit", "tests.integration.auditapp:app", *args),
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode in (0, 1), err.decode()
    return proc.returncode, out.decode()


def counted(tallies: Mapping[str, audit.Tally]) -> dict[str, tuple[int, list[int]]]:
    """A class's tallies, as key -> (count, sample sequences)."""
    return {key: (t.count, t.sample) for key, t in tallies.items()}


async def test_every_class_is_counted_and_only_anomalies_fail(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Processed, dead-lettered by rule or not, in flight and never delivered, each counted.

    Messages 1-8 are processed, 9-10 rejected; 11-13 are fetched from the
    durable consumer and left unacknowledged (a long AckWait keeps them
    delivered); 14-17 are never delivered. In flight and never delivered are
    not anomalies (exit 0, but the summary says "clean so far" and counts
    them); a dead letter with a reason that is not one of eop's rules, or one
    delivered without an outcome, is an anomaly (exit 1).
    """
    app = make_app(database_url, nats_url, compaction_interval_s=0, ack_wait_s=600.0)
    await process(app, js, [f"m{i}" for i in range(8)] + ["poison", "poison"])
    for i in range(3):
        await publish(js, f"pending{i}")
    sub = await js.pull_subscribe_bind(durable="eop-billing", stream=STREAM)
    fetched = await sub.fetch(3, timeout=5)
    assert [m.metadata.sequence.stream for m in fetched] == [11, 12, 13]
    for i in range(4):
        await publish(js, f"later{i}")

    h = await audit_of(app)
    assert h.clean, h.anomalies
    assert (h.processed.count, h.processed.sample) == (8, list(range(1, 9)))
    assert counted(h.dead_lettered_by_rule) == {"rejected": (2, [9, 10])}
    assert counted(h.dead_lettered_other) == {}
    assert counted(h.in_flight) == {audit.DELIVERED_NO_OUTCOME: (3, [11, 12, 13])}
    assert (h.never_delivered.count, h.never_delivered.sample) == (4, [14, 15, 16, 17])
    status, out = await eop_audit(database_url, nats_url)
    assert status == 0
    assert "result: clean so far: 3 in flight, 4 never delivered" in out

    await dead_letter_by_infrastructure(engine, 2, "crash_loop")
    await dead_letter_by_infrastructure(engine, 5, "attempts_exhausted")
    h = await audit_of(app)
    assert kinds(h) == {audit.DEAD_LETTER_NOT_BY_RULE: [2, 5]}
    assert counted(h.dead_lettered_other) == {
        "crash_loop": (1, [2]),
        "attempts_exhausted (delivered without an outcome)": (1, [5]),
    }
    assert (h.processed.count, h.never_delivered.count) == (6, 4)
    assert counted(h.dead_lettered_by_rule) == {"rejected": (2, [9, 10])}
    status, out = await eop_audit(database_url, nats_url)
    assert status == 1
    assert "dead_letter_not_by_rule  seq 2" in out
    assert "3 in flight, 4 never delivered" in out
    status, out = await eop_audit(database_url, nats_url, "--json")
    data = json.loads(out)["handlers"][0]
    assert status == 1
    assert data["counts"][audit.DEAD_LETTER_NOT_BY_RULE] == 2
    assert data["never_delivered"] == {"count": 4, "sample": [14, 15, 16, 17]}
    assert data["in_flight"][audit.DELIVERED_NO_OUTCOME]["count"] == 3


def test_cli_exit_codes(database_url: str, nats_url: str) -> None:
    """`eop audit` exits 0 on a clean stream, 1 on an anomaly, 2 when it cannot connect or
    is asked for a handler the app does not have (by ``EOP_HANDLERS`` too)."""
    env = dict(os.environ, EOP_DATABASE_URL=database_url, EOP_NATS_URL=nats_url)

    def eop(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "eop", "audit", "tests.integration.cliapp:app", *args],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    async def provision() -> str:
        import nats as nats_mod

        from tests.integration import cliapp

        nc = await nats_mod.connect(nats_url)
        js = nc.jetstream()
        app = cliapp.app.with_settings(database_url=database_url, nats_url=nats_url)
        await jetstream.ensure_stream(js, app.stream_spec(STREAM), create=True)
        await consumers.ensure_consumer(js, app.handlers["cli"], app.settings, create=True)
        await js.publish(SUBJECT, b"never delivered")
        info = await js.stream_info(STREAM)
        await nc.close()
        return str(info.config.metadata[jetstream.EPOCH_METADATA_KEY])

    epoch = asyncio.run(provision())
    done = eop("--json")
    assert done.returncode == 0, done.stderr
    assert '"clean": true' in done.stdout
    text = eop()
    assert text.returncode == 0
    assert "result: clean so far: 1 never delivered" in text.stdout

    async def outcome_beyond_the_stream() -> None:
        engine = create_async_engine(database_url)
        async with engine.begin() as conn:
            row = {
                "subscription": "cli",
                "stream": STREAM,
                "stream_epoch": epoch,
                "stream_seq": 99,
                "fingerprint": b"\x00",
                "outcome": "processed",
                "delivery_count": 1,
            }
            await insert_inbox(conn, [row])
        await engine.dispose()

    asyncio.run(outcome_beyond_the_stream())
    found = eop()
    assert found.returncode == 1, found.stderr
    assert "outcome_message_gone  seq 99" in found.stdout
    broken = eop("--nats-url", "nats://127.0.0.1:1")
    assert broken.returncode == 2
    assert "NATS is unreachable" in broken.stderr
    # Without --handler it audits the handlers EOP_HANDLERS names, as a worker runs them.
    env["EOP_HANDLERS"] = "not_one_of_its"
    named = eop()
    assert named.returncode == 2
    assert "not_one_of_its" in named.stderr
