"""eop.Writes: a handler's queued writes, against real JetStream and PostgreSQL."""

from __future__ import annotations

import datetime
import decimal
import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncEngine

import eop

from .bed import (
    STREAM,
    SUBJECT,
    create_effects_table,
    debug_logs,
    drained,
    effects_by_body,
    running,
    scalar,
    wait_for,
)
from .test_batch import make_app, prepublish

EFFECT = sa.text("INSERT INTO effects (handler, msg_key, body) VALUES (:h, :k, :b)")


def _effect(handler: str, msg: eop.Message) -> dict[str, str]:
    return {"h": handler, "k": msg.idempotency_key, "b": msg.data.decode()}


def _count_executemany(app: eop.App) -> list[int]:
    """How many parameter sets each INSERT INTO effects the app's engine sends carries."""
    sizes: list[int] = []

    def before(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        if statement.startswith("INSERT INTO effects"):
            sizes.append(len(params) if many else 1)

    sa.event.listen(app.engine.sync_engine, "before_cursor_execute", before)
    return sizes


async def test_queued_writes_of_a_batch_go_out_as_one_executemany_and_count_once(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A per-message handler taking eop.Writes: its batch's INSERTs share an executemany,
    and each message's effect is written exactly once."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)
    sizes = _count_executemany(app)

    @app.handler(stream=STREAM, subject=SUBJECT, name="queued")
    async def queued(msg: eop.Message, writes: eop.Writes) -> None:
        writes.add(EFFECT, _effect("queued", msg))

    bodies = [f"w{i}" for i in range(40)]
    await prepublish(js, bodies)
    async with running(app):
        await wait_for(lambda: drained(js, "eop-queued", engine=engine), what="the batches")
    assert await effects_by_body(engine) == dict.fromkeys(bodies, 1)
    assert sum(sizes) == 40
    assert max(sizes) > 1  # the first fetch returns a full batch of pre-published messages


async def test_writes_sent_through_the_session_because_of_a_listener_are_said_once(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """On eop's own engine, queued writes go out on asyncpg's connection and nothing is
    said; once a listener (as an instrumentation adds) watches the engine's executions,
    they go through the session, exactly once each still, and one
    ``writes.through_session`` line says why, however many batches follow."""
    await create_effects_table(engine)
    bodies = [f"w{i}" for i in range(30)]
    await prepublish(js, bodies)
    said: dict[str, list[Any]] = {}
    for name in ("plain", "listened"):
        app = make_app(database_url, nats_url)
        sizes = _count_executemany(app) if name == "listened" else []

        async def queued(msg: eop.Message, writes: eop.Writes) -> None:
            writes.add(EFFECT, {"h": msg.subscription, "k": msg.idempotency_key, "b": msg.text()})

        app.handler(stream=STREAM, subject=SUBJECT, name=name)(queued)
        with debug_logs() as logs:
            async with running(app):
                durable = f"eop-{name}"
                await wait_for(lambda d=durable: drained(js, d, engine=engine), what=name)
        said[name] = [e for e in logs if e["event"] == "writes.through_session"]
        if name == "listened":
            assert sum(sizes) == 30  # the listener saw every row go through the session
    assert said["plain"] == []
    assert len(said["listened"]) == 1, said["listened"]
    assert "an event listens to the engine's executions" in said["listened"][0]["reason"]
    async with engine.connect() as conn:
        rows = await conn.execute(
            sa.text("SELECT handler, body, count(*) FROM effects GROUP BY handler, body")
        )
        counts = {(h, b): int(n) for h, b, n in rows}
    assert counts == {(h, b): 1 for h in ("plain", "listened") for b in bodies}


async def test_a_failing_write_fails_its_own_message_only(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A write that violates a constraint at the batch's flush: the batch reruns with a
    savepoint per message; the culprit is dead-lettered, its neighbours commit once, at
    their first delivery. Sent on asyncpg itself (no event listens here), its error is
    still SQLAlchemy's, and the savepoint it fails in is really on the connection (the
    failed write must not abort the batch's transaction, nor the parked retry's)."""
    await create_effects_table(engine)
    async with engine.begin() as conn:
        await conn.execute(sa.text("ALTER TABLE effects ADD CHECK (body <> 'poison')"))
    app = make_app(database_url, nats_url, max_attempts=2)
    deliveries: dict[str, int] = {}

    @app.handler(stream=STREAM, subject=SUBJECT, name="checked")
    async def checked(msg: eop.Message, writes: eop.Writes) -> None:
        deliveries[msg.data.decode()] = max(deliveries.get(msg.data.decode(), 0), msg.num_delivered)
        writes.add(EFFECT, _effect("checked", msg))

    bodies = [f"a{i}" for i in range(5)] + ["poison"] + [f"b{i}" for i in range(5)]
    await prepublish(js, bodies)
    async with running(app):
        await wait_for(
            lambda: drained(js, "eop-checked", engine=engine), what="the batch and the poison"
        )
    good = [b for b in bodies if b != "poison"]
    assert await effects_by_body(engine) == dict.fromkeys(good, 1)
    assert {b: deliveries[b] for b in good} == dict.fromkeys(good, 1)
    assert deliveries["poison"] == 2  # its parked retry ran, and failed, in a savepoint too
    reason = await scalar(engine, "SELECT reason FROM eop.dead_letters")
    error = await scalar(engine, "SELECT error FROM eop.dead_letters")
    assert reason == "attempts_exhausted"
    assert "effects_body_check" in error
    assert "IntegrityError" in error


async def test_reads_through_the_session_see_the_writes_queued_before_them(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A read through writes.session first sends what is queued, as autoflush would:
    each message of a batch sees the effects of the messages before it."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)
    seen: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="reader")
    async def reader(msg: eop.Message, writes: eop.Writes) -> None:
        count = await writes.session.scalar(sa.text("SELECT count(*) FROM effects"))
        seen.append(int(count))
        writes.add(EFFECT, _effect("reader", msg))

    bodies = [f"r{i}" for i in range(20)]
    await prepublish(js, bodies)
    async with running(app):
        await wait_for(lambda: drained(js, "eop-reader", engine=engine), what="the batch")
    assert seen == list(range(20))
    assert await effects_by_body(engine) == dict.fromkeys(bodies, 1)


async def test_sync_and_batch_handlers_take_writes_too(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A plain def handler and a batch handler get eop.Writes by their annotation;
    a Reject drops the rejected message's queued write with its savepoint."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)

    @app.handler(stream=STREAM, subject=SUBJECT, name="sync-queued")
    def sync_queued(msg: eop.Message, writes: eop.Writes) -> None:
        writes.add(EFFECT, _effect("sync", msg))
        if msg.data == b"bad":
            raise eop.Reject("bad")

    @app.handler(stream=STREAM, subject=SUBJECT, name="bulk-queued", batch=True)
    async def bulk_queued(msgs: list[eop.Message], writes: eop.Writes) -> None:
        for msg in msgs:
            writes.add(EFFECT, _effect("bulk", msg))

    bodies = ["a", "b", "bad", "c"]
    await prepublish(js, bodies)
    async with running(app):
        await wait_for(
            lambda: drained(js, "eop-sync-queued", engine=engine), what="the sync handler"
        )
        await wait_for(
            lambda: drained(js, "eop-bulk-queued", engine=engine), what="the batch handler"
        )
    async with engine.connect() as conn:
        rows = await conn.execute(
            sa.text("SELECT handler, body, count(*) FROM effects GROUP BY handler, body")
        )
        counts = {(h, b): int(n) for h, b, n in rows}
    assert counts == {
        **{("sync", b): 1 for b in ("a", "b", "c")},
        **{("bulk", b): 1 for b in bodies},
    }


async def test_values_sqlalchemy_processes_arrive_as_it_would_send_them(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A queued INSERT of a JSONB document and bytea bytes, sent on asyncpg itself: each
    value goes through the bind processor SQLAlchemy would apply, and reads back equal."""
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE docs (body text, doc jsonb, raw bytea)"))
    docs = sa.table("docs", sa.column("body"), sa.column("doc", JSONB), sa.column("raw"))
    insert = sa.insert(docs).values(raw=sa.bindparam("raw", type_=sa.LargeBinary))
    app = make_app(database_url, nats_url)

    @app.handler(stream=STREAM, subject=SUBJECT, name="docs")
    async def keep(msg: eop.Message, writes: eop.Writes) -> None:
        writes.add(insert, {"body": msg.text(), "doc": {"n": [msg.text()]}, "raw": msg.data})

    bodies = ["d1", "d2", "d3"]
    await prepublish(js, bodies)
    async with running(app):
        await wait_for(lambda: drained(js, "eop-docs", engine=engine), what="the batch")
    async with engine.connect() as conn:
        rows = (await conn.execute(sa.text("SELECT body, doc, raw FROM docs ORDER BY 1"))).all()
    assert [tuple(r) for r in rows] == [(b, {"n": [b]}, b.encode()) for b in bodies]


async def test_a_batchs_queued_inserts_go_as_one_statement_of_many_rows_values_intact(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The queued INSERTs of a batch, a text one and a Core one, each go to PostgreSQL as
    statements of many rows (a statement-level trigger counts far fewer statements than
    rows), and every value arrives in its column as a statement a row would have sent it:
    numeric, timestamptz, bytea, boolean, uuid, JSONB through SQLAlchemy's processor,
    NULL, and the server's default for a column left out."""
    async with engine.begin() as conn:
        for ddl in (
            "CREATE TABLE typed (handler text, body text, amount numeric(10, 2),"
            " at timestamptz, raw bytea, flag boolean, id uuid, doc jsonb, note text,"
            " made timestamptz NOT NULL DEFAULT now())",
            "CREATE TABLE typed_statements (n integer)",
            "CREATE FUNCTION count_typed() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN INSERT INTO typed_statements VALUES (1); RETURN NULL; END $$",
            "CREATE TRIGGER typed_statement AFTER INSERT ON typed"
            " FOR EACH STATEMENT EXECUTE FUNCTION count_typed()",
        ):
            await conn.execute(sa.text(ddl))
    typed = sa.table(
        "typed",
        *(sa.column(name) for name in ("handler", "body", "amount", "at", "raw", "flag")),
        sa.column("id", sa.Uuid),
        sa.column("doc", JSONB),
        sa.column("note"),
    )
    text_insert = sa.text(
        "INSERT INTO typed (handler, body, amount, at, raw, flag, id, doc, note)"
        " VALUES (:h, :b, :amount, :at, :raw, :flag, :id, :doc, :note)"
    )
    core_insert = sa.insert(typed)
    app = make_app(database_url, nats_url)
    at = datetime.datetime(2026, 11, 29, 12, 0, tzinfo=datetime.UTC)

    def values(msg: eop.Message) -> dict[str, Any]:
        n = int(msg.text()[1:])
        return {
            "body": msg.text(),
            "amount": decimal.Decimal(n) / 4,
            "at": at + datetime.timedelta(seconds=n),
            "raw": msg.data,
            "flag": n % 2 == 0,
            "id": uuid.UUID(int=n),
            "note": None if n % 3 else "third",
        }

    @app.handler(stream=STREAM, subject=SUBJECT, name="as-text")
    async def as_text(msg: eop.Message, writes: eop.Writes) -> None:
        row = values(msg)
        writes.add(text_insert, {"h": "text", "b": row.pop("body"), "doc": '{"k": 1}', **row})

    @app.handler(stream=STREAM, subject=SUBJECT, name="as-core")
    async def as_core(msg: eop.Message, writes: eop.Writes) -> None:
        writes.add(core_insert, {"handler": "core", "doc": {"k": [msg.text()]}, **values(msg)})

    bodies = [f"m{i}" for i in range(40)]
    await prepublish(js, bodies)
    async with running(app):
        for durable in ("eop-as-text", "eop-as-core"):
            await wait_for(lambda d=durable: drained(js, d, engine=engine), what=durable)
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.text(
                    "SELECT handler, body, amount, at, raw, flag, id, doc, note, made IS NOT NULL"
                    " FROM typed ORDER BY handler, amount"
                )
            )
        ).all()
        statements = (await conn.execute(sa.text("SELECT count(*) FROM typed_statements"))).scalar()
    for handler in ("core", "text"):
        mine = [tuple(r) for r in rows if r[0] == handler]
        expected = []
        for body in bodies:
            v = values(_Fake(body))  # type: ignore[arg-type]
            doc = {"k": [body]} if handler == "core" else {"k": 1}
            row = (handler, body, v["amount"], v["at"], v["raw"], v["flag"], v["id"], doc)
            expected.append((*row, v["note"], True))
        assert mine == expected
    assert statements is not None
    assert statements < len(rows) // 4  # 80 rows: a statement or a few a batch, not one a row


class _Fake:
    """What ``values`` reads of a message: its text and its bytes."""

    def __init__(self, body: str) -> None:
        self.data = body.encode()

    def text(self) -> str:
        return self.data.decode()
