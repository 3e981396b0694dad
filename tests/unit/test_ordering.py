"""Per-key ordering: a key blocked behind a retried message."""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import Callable, Sequence

import nats.errors

from eop import testing
from eop.handler import HandlerSpec
from eop.observe import observer as observe
from eop.ordering import keys, ownership, share
from eop.settings import Settings
from eop.types import Outcome


async def _always(seq: int) -> bool:
    return True


async def _never(seq: int) -> bool:
    return False


async def test_a_retried_message_blocks_its_key_until_it_settles() -> None:
    """The key waits while its retried message has no outcome and goes on once it has."""
    blocked = keys.BlockedKeys()
    retried = testing.FakeDelivery.make(seq=1)
    blocked.update("h", "k", retried, Outcome.RETRY)
    assert blocked.blocked_seq("h", "k") == 1
    task = asyncio.ensure_future(
        blocked.wait("h", "k", 2, lost=asyncio.Event(), stored=_always, hold_s=60, poll_s=0.01)
    )
    await asyncio.sleep(0.05)
    assert not task.done()
    blocked.update("h", "k", retried, Outcome.PROCESSED)
    assert await asyncio.wait_for(task, 10)
    assert blocked.blocked_seq("h", "k") is None


async def test_a_blocked_key_waits_past_any_time_while_its_message_is_stored() -> None:
    """No time limit lets a key's later messages overtake its retried one: after each
    hold the stream is asked, and the key stays blocked while it still holds the message."""
    blocked = keys.BlockedKeys()
    blocked.update("h", "k", testing.FakeDelivery.make(seq=5), Outcome.RETRY)
    asked: list[int] = []

    async def stored(seq: int) -> bool:
        asked.append(seq)
        return True

    waiting = blocked.wait(
        "h", "k", 0, lost=asyncio.Event(), stored=stored, hold_s=0.02, poll_s=0.01
    )
    task = asyncio.ensure_future(waiting)
    await asyncio.sleep(0.3)
    assert not task.done()
    assert len(asked) >= 3
    assert set(asked) == {5}
    blocked.update("h", "k", testing.FakeDelivery.make(seq=5), Outcome.PROCESSED)
    assert await asyncio.wait_for(task, 5)


async def test_a_blocked_key_is_released_when_the_stream_no_longer_holds_the_message() -> None:
    """A retried message deleted from the stream (limits, a purge) never comes back: its
    key goes on instead of waiting for ever."""
    blocked = keys.BlockedKeys()
    blocked.update("h", "k", testing.FakeDelivery.make(seq=5), Outcome.RETRY)
    went_on = await asyncio.wait_for(
        blocked.wait("h", "k", 0, lost=asyncio.Event(), stored=_never, hold_s=0.02, poll_s=0.01),
        5,
    )
    assert went_on
    assert blocked.blocked_seq("h", "k") is None


async def test_a_key_stops_waiting_when_its_partition_is_lost() -> None:
    """Once the process no longer owns the partition, its waiting messages are left for
    the new owner (False), not run."""
    blocked = keys.BlockedKeys()
    blocked.update("h", "k", testing.FakeDelivery.make(seq=5), Outcome.RETRY)
    lost = asyncio.Event()
    task = asyncio.ensure_future(
        blocked.wait("h", "k", 0, lost=lost, stored=_always, hold_s=60, poll_s=0.01)
    )
    await asyncio.sleep(0.05)
    lost.set()
    assert await asyncio.wait_for(task, 5) is False


def test_partition_shares_add_up_whoever_computes_them() -> None:
    """Every member ranks the members by name: the shares sum to the partition count,
    and differ by one at most."""
    for count in (1, 2, 7, 16):
        for n in (1, 2, 3, 5):
            members = [f"m{i}" for i in range(n)]
            shares = [share.share(members, m, count) for m in members]
            assert sum(shares) == count
            assert max(shares) - min(shares) <= 1
    assert share.share(["a", "b"], "c", 4) == 0


class _FakeOwners:
    """Stands in for eop.ordering.ownership.Ownership: records what each tick gave up."""

    def __init__(self) -> None:
        self.count = 2
        self.member = ownership.Member(name="me", host="h", pid=1)
        self.fail = False
        self.released: list[list[int]] = []
        self.expired: list[list[int]] = []
        self.gate: asyncio.Event | None = None
        """When set, each tick waits for it (a database that does not answer)."""
        self.entered = asyncio.Event()
        self.taking: list[bool] = []
        """What each tick's ``taking()`` said, asked before it takes partitions."""

    async def tick(
        self,
        want: int,
        releasing: list[int],
        expiring: Sequence[int] = (),
        taking: Callable[[], bool] = lambda: True,
    ) -> ownership.Tick:
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise OSError("the database is away")
        self.released.append(releasing)
        self.expired.append(list(expiring))
        if want and not releasing and not expiring:
            self.taking.append(taking())
            if self.taking[-1]:
                acquired = tuple(ownership.Acquired(n, 1, None, False) for n in range(want))
                return ownership.Tick(members=("me",), owned={}, acquired=acquired)
        owned = {n: 1 for n in (0, 1) if n not in releasing and n not in expiring}
        return ownership.Tick(members=("me",), owned=owned, acquired=())


def _runner(owners: _FakeOwners) -> share.OrderedRunner:
    return share.OrderedRunner(
        spec=HandlerSpec(
            func=_handler, name="h", stream="S", subject="s.*", durable="d", order_by="subject:1"
        ),
        nc=None,  # type: ignore[arg-type]  # no consumer is opened in this test
        js=None,  # type: ignore[arg-type]
        owners=owners,  # type: ignore[arg-type]
        settings=Settings(partition_lease_s=1.0),
        dispatch=lambda msgs, at, part: None,
        take_slots=_no_slots,
        give_slots=lambda n: None,
        stopping=asyncio.Event(),
        observer=observe.NOOP,
        blocked=keys.BlockedKeys(),
    )


async def test_partitions_whose_lease_may_have_run_out_are_given_up_not_resumed() -> None:
    """A tick that fails past the lease stops the partitions at once, and the next tick
    that works gives them up (a new owner, maybe this process, starts a consumer at the
    floor) instead of fetching again behind the messages their lanes left unacked."""
    owners = _FakeOwners()
    runner = _runner(owners)
    runner.members = ("me",)
    for n in (0, 1):
        runner.owned[n] = share.Partition(n, 1, None, consumer=f"d-p{n}-e1")
    owners.fail = True
    with contextlib.suppress(OSError):
        await runner.tick()
    assert all(p.lost.is_set() and p.releasing for p in runner.owned.values())
    owners.fail = False
    await runner.tick()
    assert sorted(owners.released[-1]) == [0, 1]
    assert runner.owned == {}


async def test_a_partition_given_up_with_runs_cut_short_is_expired_not_released() -> None:
    """Given up at its deadline with lanes still running, a partition is expired, so that
    its next owner counts what this one's consumer delivered as runs (a crash loop stays
    bounded); one whose lanes all ended is released, and its next owner counts nothing."""
    owners = _FakeOwners()
    runner = _runner(owners)
    runner.members = ("me",)
    for n in (0, 1):
        part = share.Partition(n, 1, None, consumer=f"d-p{n}-e1")
        part.releasing, part.release_by = True, 0.0
        runner.owned[n] = part
    runner.owned[1].inflight = 2
    await runner.tick()
    assert (owners.released[-1], owners.expired[-1]) == ([0], [1])
    assert runner.owned == {}


async def test_a_tick_a_stop_overtakes_takes_no_partition_from_the_live_processes() -> None:
    """A tick waiting on PostgreSQL when the stop comes, answered just after: it renews
    but takes no partition (it would take them from live processes only to give them up),
    opens no consumer, and the runner's loop ends."""
    owners = _FakeOwners()
    runner = _runner(owners)
    runner.members = ("me",)  # its share is both partitions
    owners.gate = asyncio.Event()
    running = asyncio.ensure_future(runner.run())
    await asyncio.wait_for(owners.entered.wait(), 5)
    runner._stopping.set()
    owners.gate.set()
    await asyncio.wait_for(running, 5)
    assert owners.taking == [False]
    assert runner.owned == {}


async def _no_slots() -> int:
    return 0


async def _handler(msg: object, session: object) -> None:
    return None


class _OneFetch:
    """A partition's subscription whose first fetch returns ``msgs``, then nothing."""

    def __init__(self, msgs: list[object]) -> None:
        self.msgs = msgs

    async def fetch(
        self, batch: int, timeout_s: float, *, lingering: object = None
    ) -> list[object]:
        msgs, self.msgs = self.msgs, []
        return msgs


class _Ahead:
    def __init__(self) -> None:
        self.read: list[tuple[str, object]] = []

    def read_ahead(self, stream: str, stored_at: object) -> None:
        self.read.append((stream, stored_at))


async def test_a_partitions_fetch_reads_the_epochs_ahead_for_its_newest_message() -> None:
    """As the unordered loop does, a partition's fetch loop starts the epochs' reading its
    newest message needs as soon as the fetch returns (StreamEpochs.read_ahead)."""
    ahead = _Ahead()
    slots = iter([8, 0])

    async def take_slots() -> int:
        return next(slots)

    runner = _runner(_FakeOwners())
    runner._epochs = ahead  # type: ignore[assignment]  # records the calls
    runner._take_slots = take_slots
    stored = [f"2026-01-01T00:00:0{i}" for i in range(3)]
    msgs = [
        types.SimpleNamespace(
            subject=f"s.{i}",
            metadata=types.SimpleNamespace(
                stream="S", timestamp=at, sequence=types.SimpleNamespace(stream=i + 1)
            ),
        )
        for i, at in enumerate(stored)
    ]
    part = share.Partition(0, 1, None, consumer="d-p0-e1")
    part.sub = _OneFetch(msgs)  # type: ignore[assignment]
    part.room.set()
    await runner._fetch_loop(part)
    assert ahead.read == [("S", stored[-1])]


class _GoneConsumer:
    """A partition's subscription whose consumer a new owner deleted: every fetch fails."""

    def __init__(self) -> None:
        self.failed = asyncio.Event()

    async def fetch(
        self, batch: int, timeout_s: float, *, lingering: object = None
    ) -> list[object]:
        self.failed.set()
        raise nats.errors.NoRespondersError


async def test_a_partition_lost_while_its_fetch_loop_waits_after_a_failure_frees_its_slots() -> (
    None
):
    """A process that wakes from a freeze finds its partition's consumer deleted: the fetch
    fails, and the loop waits before trying again. The partition is lost meanwhile and the
    loop cancelled in that wait; the slots it took for the failed fetch must come back, or
    the process fetches less for every partition from then on, until it restarts."""
    free = 8
    taken = 0

    async def take_slots() -> int:
        nonlocal free, taken
        taken, free = free, 0
        return taken

    def give_slots(n: int) -> None:
        nonlocal free
        free += n

    runner = _runner(_FakeOwners())
    runner._take_slots = take_slots
    runner._give_slots = give_slots
    part = share.Partition(0, 1, None, consumer="d-p0-e1")
    gone = _GoneConsumer()
    part.sub = gone  # type: ignore[assignment]
    part.room.set()
    loop = asyncio.create_task(runner._fetch_loop(part))
    await gone.failed.wait()
    await asyncio.sleep(0.01)  # in the wait after the failure
    part.lost.set()
    loop.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await loop
    assert taken == 8
    assert free == 8, "the failed fetch's slots were kept"
