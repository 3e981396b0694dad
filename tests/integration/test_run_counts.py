"""A redelivery's run count is forgotten with its message's outcome, on a real PostgreSQL.

A redelivered message's run is counted in ``eop.retries`` (with a copy of the
message) before its handler starts (docs/design.md, 'The crash-loop bound'). Each
test here drives deliveries through the per-message protocol (two processors on one
database are two workers; no NATS: the deliveries are fakes) down a path where the
message gets its outcome some other way than by that redelivery's own run, and checks
that no such row outlives it: where the protocol learns the outcome (a duplicate by
msg-id or key, found before or after the count, or when a failure or a crash loop's
dead letter is settled), and otherwise in compaction's sweep. A parked retry's row is
no run count: neither forgets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop
from eop import message, testing
from eop import settings as settings_mod
from eop.handler import HandlerSpec
from eop.message import Message
from eop.pg import contract
from eop.protocol import compaction, processor
from eop.types import Outcome

from . import bed
from .bed import create_effects_table, effects_by_body, record_effect, scalar, wait_for

SUB, STREAM, SUBJECT, EPOCH = "counted", "ORDERS", "orders.new", "e1"


class Script:
    """What the handler does, per (sequence, delivery count): wait at a gate, raise."""

    def __init__(self) -> None:
        self.entered: dict[tuple[int, int], asyncio.Event] = {}
        self.gates: dict[tuple[int, int], asyncio.Event] = {}
        self.failing: set[tuple[int, int]] = set()
        self.after_gate: dict[tuple[int, int], Any] = {}

    def gate(self, seq: int, delivered: int) -> tuple[asyncio.Event, asyncio.Event]:
        """The run of ``seq``'s delivery ``delivered`` waits at the gate returned second
        (set it to go on) once it has claimed and set the event returned first."""
        key = (seq, delivered)
        self.entered[key], self.gates[key] = asyncio.Event(), asyncio.Event()
        return self.entered[key], self.gates[key]

    async def run(self, msg: eop.Message, session: AsyncSession) -> None:
        key = (msg.seq, msg.num_delivered)
        if key in self.gates:
            self.entered[key].set()
            await self.gates[key].wait()
        if key in self.after_gate:
            self.after_gate[key]()
        if key in self.failing:
            raise RuntimeError("the handler failed")
        await record_effect(session, SUB, msg)


@pytest.fixture
def script() -> Script:
    return Script()


@pytest.fixture
async def app(database_url: str, engine: AsyncEngine, script: Script) -> AsyncIterator[eop.App]:
    """One handler run by :class:`Script`; claims give up after 0.5 s on a held key, and
    a run over one uncompleted run is a crash loop."""
    await create_effects_table(engine)
    settings = settings_mod.Settings(
        database_url=database_url,
        lock_timeout_s=0.5,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        ack_timeout_s=0.05,
        ack_give_up_s=0.2,
        lease_margin_s=0.0,
        max_deliveries=1,
    )
    app = eop.App(settings=settings)

    @app.handler(stream=STREAM, subject="orders.>", name=SUB)
    async def counted(msg: eop.Message, session: AsyncSession) -> None:
        """The scripted handler."""
        await script.run(msg, session)

    yield app
    await app.dispose()


def worker(app: eop.App, store: contract.Store | None = None) -> processor.Processor:
    """The per-message protocol of one worker process (its own store: its own pool)."""
    spec = app.handlers[SUB]
    made = store if store is not None else app.make_store()
    return processor.Processor(spec, app.settings, made, testing.FakeEpochs(default=EPOCH))


def patient(app: eop.App) -> eop.App:
    """``app`` whose claims wait 30 s on a held key: until the holder ends."""
    return app.with_settings(lock_timeout_s=30.0)


def delivery(seq: int, delivered: int, msg_id: str | None = None) -> testing.FakeDelivery:
    """Delivery number ``delivered`` of the message at ``seq``."""
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    return testing.FakeDelivery.make(
        data=f"m{seq}".encode(),
        subject=SUBJECT,
        stream=STREAM,
        seq=seq,
        num_delivered=delivered,
        headers=headers,
    )


async def handle(proc: processor.Processor, d: testing.FakeDelivery) -> Outcome:
    return await proc.handle(d, time.monotonic())


async def retries(engine: AsyncEngine) -> dict[tuple[str, int], tuple[int, int, bool]]:
    """Each retries row, by (epoch, sequence): (failures, runs, parked)."""
    query = "SELECT stream_epoch, stream_seq, failures, runs, parked FROM eop.retries"
    async with engine.connect() as conn:
        rows = (await conn.execute(sa.text(query))).all()
    return {(r[0], int(r[1])): (int(r[2]), int(r[3]), bool(r[4])) for r in rows}


async def a_claim_waits(engine: AsyncEngine) -> bool:
    """Whether a statement of the test's database waits for a lock (a claim on a held key)."""
    query = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    return int(await scalar(engine, query)) > 0


async def count_a_run(app: eop.App, seq: int, delivered: int, epoch: str = EPOCH) -> None:
    """Count a run of the message at ``seq`` as a redelivery does before it starts (its
    worker then died in it)."""
    d = delivery(seq, delivered)
    await bed.count_a_run(app, message.from_nats(d, subscription=SUB, stream_epoch=epoch))


async def test_a_redelivery_that_finds_its_msg_id_twin_processed_forgets_its_runs(
    app: eop.App, engine: AsyncEngine, script: Script
) -> None:
    """The new-user trial's sequence: a message's redelivery (its first owner killed)
    counts its run, then times out on its claim, the msg-id held by its twin (republished
    past the server's duplicate window, processed meanwhile); once the twin committed, the
    next redelivery finds it by msg-id before counting: a duplicate, acked, and the run
    count (a copy of the payload) goes with it."""
    twin_in, twin_go = script.gate(4, 1)
    twin = asyncio.create_task(handle(worker(app), delivery(4, 1, "dup-2")))
    await twin_in.wait()
    b = worker(app)
    assert await handle(b, delivery(3, 2, "dup-2")) is Outcome.RETRY  # the claim timed out
    assert await retries(engine) == {(EPOCH, 3): (0, 1, False)}
    twin_go.set()
    assert await twin is Outcome.PROCESSED
    assert await handle(b, delivery(3, 3, "dup-2")) is Outcome.DUPLICATE
    assert await retries(engine) == {}
    assert await effects_by_body(engine) == {"m4": 1}


async def test_a_redelivery_whose_claim_finds_the_first_owner_committed_forgets_its_run(
    app: eop.App, engine: AsyncEngine, script: Script
) -> None:
    """A first delivery's owner stalls in its handler, its claim held; the redelivery
    finds nothing committed, counts its run and waits on the claim; the owner commits
    (a first delivery knows of no count): the redelivery's claim finds the key taken, a
    duplicate, and forgets the run it counted."""
    first_in, first_go = script.gate(7, 1)
    first = asyncio.create_task(handle(worker(app), delivery(7, 1)))
    await first_in.wait()
    again = asyncio.create_task(handle(worker(patient(app)), delivery(7, 2)))
    await wait_for(lambda: a_claim_waits(engine), what="the redelivery's claim waiting")
    assert await retries(engine) == {(EPOCH, 7): (0, 1, False)}
    first_go.set()
    assert await first is Outcome.PROCESSED
    assert await again is Outcome.DUPLICATE
    assert await retries(engine) == {}
    assert await effects_by_body(engine) == {"m7": 1}


async def test_first_runs_without_an_outcome_run_side_by_side_each_counted_once(
    app: eop.App, engine: AsyncEngine, script: Script
) -> None:
    """Two redeliveries of one process, neither with a run counted: both run at once
    (neither waits for the other to end), each run committed as counted before its
    handler starts, and forgotten with its outcome. ``count_first_run`` writes nothing
    for a message that has a run counted or its outcome."""
    shared = app.with_settings(max_deliveries=2)
    proc = worker(shared)
    # The epoch's lane first: two claims making it at once would wait on each other.
    assert await handle(proc, delivery(1, 1)) is Outcome.PROCESSED
    (a_in, a_go), (b_in, b_go) = script.gate(3, 2), script.gate(4, 2)
    a = asyncio.create_task(handle(proc, delivery(3, 2)))
    b = asyncio.create_task(handle(proc, delivery(4, 2)))
    await asyncio.wait_for(asyncio.gather(a_in.wait(), b_in.wait()), 10)
    assert await retries(engine) == {(EPOCH, 3): (0, 1, False), (EPOCH, 4): (0, 1, False)}
    a_go.set()
    b_go.set()
    assert (await a, await b) == (Outcome.PROCESSED, Outcome.PROCESSED)
    assert await retries(engine) == {}
    await count_a_run(shared, 5, 2)
    store = shared.make_store()
    for seq in (3, 5):
        msg = message.from_nats(delivery(seq, 3), subscription=SUB, stream_epoch=EPOCH)
        async with store.transaction(shared.handlers[SUB]) as tx:
            assert not await tx.count_first_run(msg)
            await tx.commit()
    assert await retries(engine) == {(EPOCH, 5): (0, 1, False)}
    assert await effects_by_body(engine) == {"m1": 1, "m3": 1, "m4": 1}


class HeldStore:
    """A store whose next transaction, once :attr:`hold` is set, waits for it to be set."""

    def __init__(self, store: contract.Store) -> None:
        self.store = store
        self.hold: asyncio.Event | None = None

    @contextlib.asynccontextmanager
    async def transaction(self, spec: HandlerSpec) -> AsyncIterator[contract.Transaction]:
        hold, self.hold = self.hold, None
        if hold is not None:
            await hold.wait()
        async with self.store.transaction(spec) as tx:
            yield tx

    async def has_outcome(self, spec: HandlerSpec, message: Message) -> bool:
        return await self.store.has_outcome(spec, message)


async def test_a_redelivery_whose_failure_finds_its_twin_processed_forgets_its_run(
    app: eop.App, engine: AsyncEngine, script: Script
) -> None:
    """A redelivery counts its run and claims; its handler fails; before the failure is
    settled its msg-id twin (waiting on that claim) is processed: parking the failure
    finds the msg-id taken, a duplicate. The failure counted with it is rolled back, and
    the run count is forgotten too (in a transaction of its own)."""
    held = HeldStore(patient(app).make_store())
    failing_in, failing_go = script.gate(3, 2)
    script.failing.add((3, 2))
    settle = asyncio.Event()
    script.after_gate[(3, 2)] = lambda: setattr(held, "hold", settle)
    failing = asyncio.create_task(handle(worker(patient(app), held), delivery(3, 2, "m")))
    await failing_in.wait()
    assert await retries(engine) == {(EPOCH, 3): (0, 1, False)}
    twin = asyncio.create_task(handle(worker(patient(app)), delivery(4, 1, "m")))
    await wait_for(lambda: a_claim_waits(engine), what="the twin's claim waiting")
    failing_go.set()
    assert await twin is Outcome.PROCESSED
    settle.set()
    assert await failing is Outcome.DUPLICATE
    assert await retries(engine) == {}
    assert await effects_by_body(engine) == {"m4": 1}


async def test_a_crash_loops_dead_letter_that_finds_its_twin_processed_forgets_its_runs(
    app: eop.App, engine: AsyncEngine, script: Script
) -> None:
    """A message whose earlier redelivery counted a run and died comes again, over the
    crash-loop bound (max_deliveries=1): its dead letter's claim waits on its msg-id
    twin's, which commits; a duplicate, not a dead letter, and its two counted runs are
    forgotten."""
    await count_a_run(app, 3, 2)
    twin_in, twin_go = script.gate(4, 1)
    twin = asyncio.create_task(handle(worker(app), delivery(4, 1, "m")))
    await twin_in.wait()
    looping = asyncio.create_task(handle(worker(patient(app)), delivery(3, 3, "m")))
    await wait_for(lambda: a_claim_waits(engine), what="the dead letter's claim waiting")
    assert await retries(engine) == {(EPOCH, 3): (0, 2, False)}
    twin_go.set()
    assert await twin is Outcome.PROCESSED
    assert await looping is Outcome.DUPLICATE
    assert await retries(engine) == {}
    assert await scalar(engine, "SELECT count(*) FROM eop.dead_letters") == 0


async def test_duplicate_redeliveries_forget_their_run_counts_but_not_a_parked_retry(
    app: eop.App, engine: AsyncEngine, script: Script
) -> None:
    """A first delivery's owner stalls past the redelivery's lock timeout: the redelivery
    counted its run and gave up on the claim (nak'ed); the owner commits. The nak'ed
    redelivery comes back and finds the message processed under its key, a duplicate:
    its run count goes. Another message whose handler failed is parked (acked, its retry
    in the retries table); a redelivery of it (the ack lost) finds its retrying row, a
    duplicate too: that row is its pending retry, not a run count, and stays as it was."""
    first_in, first_go = script.gate(7, 1)
    first = asyncio.create_task(handle(worker(app), delivery(7, 1)))
    await first_in.wait()
    b = worker(app)
    assert await handle(b, delivery(7, 2)) is Outcome.RETRY  # the claim timed out
    first_go.set()
    assert await first is Outcome.PROCESSED
    script.failing.add((5, 1))
    assert await handle(b, delivery(5, 1)) is Outcome.RETRY  # parked
    assert await retries(engine) == {(EPOCH, 7): (0, 1, False), (EPOCH, 5): (1, 0, True)}
    assert await handle(b, delivery(7, 3)) is Outcome.DUPLICATE
    assert await handle(b, delivery(5, 2)) is Outcome.DUPLICATE
    assert await retries(engine) == {(EPOCH, 5): (1, 0, True)}
    assert await effects_by_body(engine) == {"m7": 1}


class Epochs:
    """The stream's epoch and first sequence, as compaction reads them (no NATS)."""

    async def refresh(self, stream: str) -> str:
        return EPOCH

    def first_seq(self, stream: str) -> int:
        return 1

    def current_for(self, stream: str, epoch: str) -> None:
        return None  # no earlier epoch to sweep


def compactor(app: eop.App, floor: int) -> compaction.Compactor:
    """A compactor of the handler whose consumer's ack floor is ``floor``."""
    return bed.compactor_with_floor(app, SUB, Epochs(), floor)


async def test_compaction_sweeps_the_run_counts_a_first_delivery_settled_behind(
    app: eop.App, engine: AsyncEngine, script: Script
) -> None:
    """A first delivery's owner stalls past the redelivery's lock timeout: the redelivery
    counted its run, gave up on the claim (nak'ed), and the owner then commits, knowing of
    no count; the row stays. The next compaction round from the first sequence deletes the
    rows not parked at or below the watermark (this one, and an ordered handler's counted
    failure), in one statement; it leaves a parked retry's row below it, a run count above
    it (a redelivery still unacked) and another epoch's. A round within the compaction
    interval after it, counted by messages, sends no such statement."""
    first_in, first_go = script.gate(7, 1)
    first = asyncio.create_task(handle(worker(app), delivery(7, 1)))
    await first_in.wait()
    assert await handle(worker(app), delivery(7, 2)) is Outcome.RETRY  # the claim timed out
    first_go.set()
    assert await first is Outcome.PROCESSED
    script.failing.add((5, 1))
    assert await handle(worker(app), delivery(5, 1)) is Outcome.RETRY  # parked
    await count_a_run(app, 20, 2)  # above the watermark: a redelivery in flight
    await count_a_run(app, 3, 2, epoch="e0")  # an earlier epoch's
    msg = message.from_nats(delivery(8, 2), subscription=SUB, stream_epoch=EPOCH)
    async with app.make_store().transaction(app.handlers[SUB]) as tx:
        await tx.count_failure(msg, "failed", parked=False, due_in_s=0.0)  # ordered: nak'ed
        await tx.commit()
    assert await retries(engine) == {
        (EPOCH, 7): (0, 1, False),
        (EPOCH, 5): (1, 0, True),
        (EPOCH, 8): (1, 0, False),
        (EPOCH, 20): (0, 1, False),
        ("e0", 3): (0, 1, False),
    }
    sent: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "eop.retries" in statement:
            sent.append(statement.split(None, 1)[0].upper())

    c = compactor(app, floor=10)
    sa.event.listen(app.engine.sync_engine, "before_cursor_execute", seen)
    try:
        done = await c.compact_once()
        assert done is not None
        assert done.watermark == 10
        assert sent == ["DELETE"]
        assert await retries(engine) == {
            (EPOCH, 5): (1, 0, True),
            (EPOCH, 20): (0, 1, False),
            ("e0", 3): (0, 1, False),
        }
        await c.compact_once()
        assert sent == ["DELETE"]
    finally:
        sa.event.remove(app.engine.sync_engine, "before_cursor_execute", seen)
