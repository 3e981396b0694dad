"""eop.testing.TestApp and ``order_by`` handlers: a retried message holds back its key."""

from __future__ import annotations

import eop
from eop import message, testing
from eop.handler import HandlerSpec
from eop.testing import Outcome
from eop.testing.deliveries import FakeDelivery
from eop.testing.lanes import Lanes


class Ledger:
    """An ``order_by`` handler whose entries fail as told; it records the entries it ran."""

    def __init__(
        self, *, order_by: str | None = "subject:1", max_attempts: int = 5, error: type = eop.Retry
    ) -> None:
        self.failures: dict[str, int] = {}
        """Entry -> how many more runs of it fail."""
        self.ran: list[str] = []
        """The entries the handler ran, in order (failed runs too)."""
        self.app = eop.App(settings=eop.Settings(max_attempts=max_attempts))

        @self.app.handler(stream="LEDGER", subject="LEDGER.*", name="ledger", order_by=order_by)
        async def ledger(msg: eop.Message, session: object) -> None:
            entry = msg.json()["entry"]
            self.ran.append(entry)
            if self.failures.get(entry, 0) > 0:
                self.failures[entry] -= 1
                raise error(f"{entry} is not ready")

    def fail(self, entry: str, times: int = 1) -> Ledger:
        """Make the next ``times`` runs of ``entry`` fail."""
        self.failures[entry] = times
        return self


def seqs(results: list[testing.Result]) -> list[int]:
    return [r.message.seq for r in results]


async def test_a_retried_message_holds_back_the_later_ones_of_its_key() -> None:
    """a1 fails once: a2 and a3 (same key) are held, unrun, while a1 waits for its retry;
    b1 (another key) runs; retry() runs a1 again, then a2 and a3 in stream order."""
    ledger = Ledger().fail("a1")
    async with testing.TestApp(ledger.app) as t:
        a1 = await t.deliver("LEDGER.A", {"entry": "a1"})
        a2 = await t.deliver("LEDGER.A", {"entry": "a2"})
        a3 = await t.deliver("LEDGER.A", {"entry": "a3"})
        b1 = await t.deliver("LEDGER.B", {"entry": "b1"})

        assert a1.retried
        assert (a2.held, a3.held, a2.outcome) == (True, True, None)
        assert a2.held_behind == a3.held_behind == a1.message.seq
        assert (b1.processed, b1.held) == (True, False)
        assert ledger.ran == ["a1", "b1"]
        assert seqs(t.held) == [a2.message.seq, a3.message.seq]
        assert str(t.held[0]) == "ledger: held behind #1 [LEDGER #2]"

        later = await t.retry()

        assert [(r.message.seq, r.outcome) for r in later] == [
            (1, Outcome.PROCESSED),
            (2, Outcome.PROCESSED),
            (3, Outcome.PROCESSED),
        ]
        assert later[0].message.num_delivered == 2
        assert ledger.ran == ["a1", "b1", "a1", "a2", "a3"]
        assert t.held == []
        assert await t.retry() == []


async def test_a_message_that_keeps_failing_holds_its_key_until_it_is_dead_lettered() -> None:
    """While a1 is retried and fails again, a2 stays held; once a1 is dead-lettered after
    max_attempts, a2 runs; the held result is in t.results, the run after it."""
    ledger = Ledger(max_attempts=3, error=RuntimeError).fail("a1", times=10)
    async with testing.TestApp(ledger.app, raise_errors=False) as t:
        a1 = await t.deliver("LEDGER.A", {"entry": "a1"})
        a2 = await t.deliver("LEDGER.A", {"entry": "a2"})
        first = await t.retry()
        assert [r.outcome for r in first] == [Outcome.RETRY]
        assert seqs(t.held) == [a2.message.seq]
        second = await t.retry()
        [dead] = await t.dead_letters()

    assert a1.retried
    assert isinstance(a1.error, RuntimeError)
    assert a2.held
    assert [(r.message.seq, r.outcome) for r in second] == [
        (1, Outcome.DEAD_LETTERED),
        (2, Outcome.PROCESSED),
    ]
    assert (dead.stream_seq, dead.reason) == (1, "attempts_exhausted")
    assert ledger.ran == ["a1", "a1", "a1", "a2"]
    assert [r.outcome for r in t.results if r.message.seq == 2] == [None, Outcome.PROCESSED]


async def test_a_held_message_that_fails_in_turn_holds_the_rest_behind_it() -> None:
    """Released behind a1, a2 fails: a3 stays held, now behind a2, until a2's retry."""
    ledger = Ledger().fail("a1").fail("a2")
    async with testing.TestApp(ledger.app) as t:
        await t.deliver("LEDGER.A", {"entry": "a1"})
        a2 = await t.deliver("LEDGER.A", {"entry": "a2"})
        a3 = await t.deliver("LEDGER.A", {"entry": "a3"})
        first = await t.retry()
        [still] = t.held
        second = await t.retry()

    assert [(r.message.seq, r.outcome) for r in first] == [
        (1, Outcome.PROCESSED),
        (2, Outcome.RETRY),
    ]
    assert (still.message.seq, still.held_behind) == (a3.message.seq, a2.message.seq)
    assert [(r.message.seq, r.outcome) for r in second] == [
        (2, Outcome.PROCESSED),
        (3, Outcome.PROCESSED),
    ]
    assert ledger.ran == ["a1", "a1", "a2", "a2", "a3"]


async def test_settle_runs_the_held_messages_once_their_key_is_free() -> None:
    """settle() retries a1 until it succeeds, and runs what its key held, in order."""
    ledger = Ledger().fail("a1", times=3)
    async with testing.TestApp(ledger.app) as t:
        await t.deliver("LEDGER.A", {"entry": "a1"})
        await t.deliver("LEDGER.A", {"entry": "a2"})
        settled = await t.settle()
    retried, processed = Outcome.RETRY, Outcome.PROCESSED
    assert [r.outcome for r in settled] == [retried, retried, processed, processed]
    assert ledger.ran == ["a1"] * 4 + ["a2"]
    assert t.held == []


async def test_a_header_key_holds_back_its_own_messages_only() -> None:
    """order_by="header:X-Account": the key is the header, not the subject."""
    ledger = Ledger(order_by="header:X-Account").fail("a1")
    async with testing.TestApp(ledger.app) as t:
        a1 = await t.deliver("LEDGER.x", {"entry": "a1"}, headers={"X-Account": "A"})
        a2 = await t.deliver("LEDGER.y", {"entry": "a2"}, headers={"X-Account": "A"})
        b1 = await t.deliver("LEDGER.x", {"entry": "b1"}, headers={"X-Account": "B"})
        assert (a1.retried, a2.held, b1.processed) == (True, True, True)
        assert seqs(await t.retry()) == [1, 2]


async def test_a_fetched_batch_runs_in_its_keys_lanes() -> None:
    """deliver_batch on an ordered handler runs each message alone, as a worker does (no
    batch transaction): a1 fails, a2 and a3 are held behind it; key B's batch runs."""
    ledger = Ledger().fail("a1")
    async with testing.TestApp(ledger.app) as t:
        a1, a2, a3 = await t.deliver_batch("LEDGER.A", [{"entry": e} for e in ("a1", "a2", "a3")])
        b1, b2 = await t.deliver_batch("LEDGER.B", [{"entry": "b1"}, {"entry": "b2"}])
        assert (a1.retried, a2.held, a3.held, b1.processed, b2.processed) == (True,) * 5
        assert ledger.ran == ["a1", "b1", "b2"]
        assert seqs(await t.retry()) == [1, 2, 3]


async def test_redelivering_the_retried_message_releases_its_key() -> None:
    """A redelivery of the retried message runs at once (it is what the key waits for);
    processed, it releases the held ones; the nak'ed delivery then comes as a duplicate."""
    ledger = Ledger().fail("a1")
    async with testing.TestApp(ledger.app) as t:
        a1 = await t.deliver("LEDGER.A", {"entry": "a1"})
        a2 = await t.deliver("LEDGER.A", {"entry": "a2"})
        again = await t.redeliver(a1)
        assert again.processed
        assert t.held == []
        assert [(r.message.seq, r.outcome) for r in t.results[-2:]] == [
            (1, Outcome.PROCESSED),
            (2, Outcome.PROCESSED),
        ]
        [late] = await t.retry()
    assert a2.held
    assert late.duplicate
    assert ledger.ran == ["a1", "a1", "a2"]


async def test_a_redelivered_held_message_waits_in_its_lane_too() -> None:
    """A held message delivered again is held again, behind the same retried message; once
    released, its first delivery processes it and the second is a duplicate."""
    ledger = Ledger().fail("a1")
    async with testing.TestApp(ledger.app) as t:
        await t.deliver("LEDGER.A", {"entry": "a1"})
        a2 = await t.deliver("LEDGER.A", {"entry": "a2"})
        again = await t.redeliver(a2)
        assert (again.held, again.message.num_delivered) == (True, 2)
        later = await t.retry()
    assert [(r.message.seq, r.outcome) for r in later] == [
        (1, Outcome.PROCESSED),
        (2, Outcome.PROCESSED),
        (2, Outcome.DUPLICATE),
    ]


async def test_an_unordered_handler_holds_nothing() -> None:
    """Without order_by a failed message is parked and the next one runs at once."""
    ledger = Ledger(order_by=None).fail("a1")
    async with testing.TestApp(ledger.app) as t:
        a1 = await t.deliver("LEDGER.A", {"entry": "a1"})
        a2 = await t.deliver("LEDGER.A", {"entry": "a2"})
    assert (a1.retried, a2.processed, a2.held, t.held) == (True, True, False, [])


async def test_lanes_stop_holding_a_key_whose_retried_message_is_not_redelivered() -> None:
    """A message left for the server's redelivery (no nak to redeliver in the kit) holds
    its key until the next unhold, as a worker's hold ends after a while."""
    spec = Ledger().app.handlers["ledger"]
    ran: list[int] = []

    def result(
        spec: HandlerSpec, delivery: FakeDelivery, outcome: Outcome | None, behind: int | None
    ) -> testing.Result:
        msg = message.from_nats(delivery, subscription=spec.name, stream_epoch="e")
        return testing.Result(spec.name, outcome, msg, held_behind=behind)

    async def run(spec: HandlerSpec, delivery: FakeDelivery) -> testing.Result:
        seq = delivery.metadata.sequence.stream
        ran.append(seq)
        return result(spec, delivery, Outcome.LEFT if seq == 1 else Outcome.PROCESSED, None)

    async def hold(spec: HandlerSpec, delivery: FakeDelivery, behind: int) -> testing.Result:
        return result(spec, delivery, None, behind)

    lanes = Lanes(run, hold)
    left = await lanes.deliver(spec, FakeDelivery.make(subject="LEDGER.A", seq=1))
    held = await lanes.deliver(spec, FakeDelivery.make(subject="LEDGER.A", seq=2))
    assert (left.outcome, held.held_behind, ran) == (Outcome.LEFT, 1, [1])
    assert [r.held_behind for r in lanes.held()] == [1]
    released = await lanes.unhold([])
    assert ([r.outcome for r in released], ran, lanes.held()) == ([Outcome.PROCESSED], [1, 2], [])
