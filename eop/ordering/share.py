"""An ordered handler in one worker process: its share of the partitions, fetched.

Every process that runs an ordered handler is a member of it (a row of
``members``, renewed on the database's clock). Each tick, a third of
``partition_lease_s`` apart, a member renews its leases and takes or gives
up partitions so that it owns its share: the partition count divided by
the live members, the remainder going to the first ones by name. A
partition it takes gets a new epoch and a consumer of its own, created at
the ack floor of the consumers before it (:mod:`eop.ordering.partitions`);
a partition it gives up is first drained (no more fetches; the lanes
already running finish). A member that stops gives everything up at once;
one that dies loses its leases when they run out. docs/ordering.md has the
guarantee, the bound on a handover and why order holds through all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from eop import backoff, errors, log
from eop.broker import fetcher, jetstream
from eop.handler import HandlerSpec
from eop.observe import observer as observe
from eop.ordering import keys, ownership, partitions
from eop.pg import failures
from eop.protocol import background
from eop.runtime.slots import Slots, Taken
from eop.settings import Settings
from eop.types import Delivery

#: JetStream's error code for a sequence the stream does not hold (deleted, or below its
#: first sequence); "stream not found" is another 404.
NO_MESSAGE_FOUND = 10037

# The waits after failed fetches or ticks (counted from 1): 0.2 s, doubling up to 5 s.
_RETRY_FIRST_S = 0.2
_RETRY_MAX_S = 5.0


@dataclasses.dataclass(eq=False)
class Partition:
    """A partition this process owns (or is giving up)."""

    number: int
    epoch: int
    previous: str | None
    consumer: str | None = None
    lost: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set once the process no longer owns it: its lanes leave what they have not started."""
    releasing: bool = False
    inflight: int = 0
    """Messages fetched from it whose lane has not finished."""
    room: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set when a lane of it finishes (its fetch loop may have been waiting for room)."""
    queued: int = 0
    """Messages held behind a running lane of their key (see :meth:`held`)."""
    keys: set[str] = dataclasses.field(default_factory=set)
    """Its keys that were blocked behind a retried message (forgotten when it goes)."""
    sub: fetcher.Fetcher | None = None
    task: asyncio.Task[None] | None = None
    release_by: float = 0.0
    released: bool = False
    """Its previous owner released it with every run ended (see ``Acquired.released``)."""
    handovers: ownership.Handovers = dataclasses.field(default_factory=ownership.Handovers)
    """What earlier owners' consumers delivered that its consumer delivers again."""

    @contextlib.asynccontextmanager
    async def held(self, slots: Slots, count: int, *, queued: bool = False) -> AsyncIterator[None]:
        """While ``count`` of its messages wait behind an earlier message of their key,
        their slots (and this partition's room) are free: the fetch loop must still be
        able to fetch that message's redelivery (when it is retried), and other keys'
        messages. ``queued``: they wait behind a running lane, counted against
        :attr:`OrderedRunner.lookahead`."""
        slots.give(count)
        self.inflight -= count
        self.queued += count if queued else 0
        self.room.set()
        try:
            yield
        finally:
            slots.borrow(count)
            self.inflight += count
            self.queued -= count if queued else 0


Dispatch = Callable[[Sequence[Delivery], float, Partition], None]


def member() -> ownership.Member:
    """This process's name among a handler's members: host, pid and a random part."""
    host = socket.gethostname()
    pid = os.getpid()
    return ownership.Member(name=f"{host}:{pid}:{uuid.uuid4().hex[:8]}", host=host, pid=pid)


def share(members: Sequence[str], me: str, count: int) -> int:
    """How many of ``count`` partitions ``me`` should own among the live ``members``.

    Every member ranks the members by name, so their shares add up to
    ``count`` whoever computes them: the remainder goes to the first ones.
    """
    if me not in members:
        return 0
    base, extra = divmod(count, len(members))
    return base + (1 if members.index(me) < extra else 0)


class OrderedRunner:
    """Owns this process's share of one ordered handler's partitions and fetches them."""

    def __init__(
        self,
        *,
        spec: HandlerSpec,
        nc: NATS,
        js: JetStreamContext,
        owners: ownership.Ownership,
        settings: Settings,
        dispatch: Dispatch,
        take_slots: Callable[[], Awaitable[int]],
        give_slots: Callable[[int], None],
        stopping: asyncio.Event,
        observer: observe.Observer,
        blocked: keys.BlockedKeys,
        noted: background.Noted | None = None,
        epochs: jetstream.StreamEpochs | None = None,
    ) -> None:
        self.spec = spec
        self._epochs = epochs
        """Told of each fetch's newest message, to read the stream's epochs ahead of the
        messages that need them (:meth:`eop.broker.jetstream.StreamEpochs.read_ahead`)."""
        self._noted = noted
        """Told of each failed tick: the worker counts the failures only a change of
        configuration ends (a pooler losing prepared statements fails every tick, and a
        process owning nothing runs no handler to notice it)."""
        self.nc = nc
        self.js = js
        self.owners = owners
        self.settings = settings
        self._dispatch = dispatch
        self._take_slots = take_slots
        self._give_slots = give_slots
        self._stopping = stopping
        self._observer = observer
        self._blocked = blocked
        self.owned: dict[int, Partition] = {}
        self.members: tuple[str, ...] = ()
        self._logger = log.get_logger(handler=spec.name, stream=spec.stream)
        self.ready = asyncio.Event()
        """Set after the first tick (whatever it took)."""
        self._lease_until = 0.0

    @property
    def tick_s(self) -> float:
        """How often leases are renewed and shares looked at."""
        return self.settings.partition_lease_s / 3

    async def run(self) -> None:
        """Tick until the worker stops; then stop fetching (:meth:`leave` gives up)."""
        failures = 0
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                # A tick waits on PostgreSQL and NATS for as long as they take: a stop
                # gives it a tick's time, then leaves what it did not do to the leases.
                await background.before_stop(self._ticks(), self._stopping, self.tick_s)
                failures = 0
                # A tick apart from start to start, however long this one took (opening
                # consumers): the others rank only members that renewed lately.
                wait_s = max(self.tick_s - (time.monotonic() - started), 0.0)
            except background.Abandoned as exc:
                self._logger.warning(log.Event.PARTITION_FAILED, error=log.brief_error(exc))
                break
            except Exception as exc:
                failures += 1
                (self._logger.warning if failures == 1 else self._logger.debug)(
                    log.Event.PARTITION_FAILED,
                    failures=failures,
                    error=log.brief_error(exc),
                )
                if self._noted is not None:
                    self._noted(exc)
                wait_s = min(self.tick_s, backoff.backoff_s(failures, _RETRY_FIRST_S, _RETRY_MAX_S))
            self.ready.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), wait_s)
        # Stopping: what the lanes have not started is left for the next owner.
        for part in self.owned.values():
            part.lost.set()
            await self._stop_fetching(part)

    async def _ticks(self) -> None:
        before = self.members
        await self.tick()
        if self.members != before and not self._stopping.is_set():
            # Someone joined or left (or this is the first tick): take the new share now
            # rather than a tick later.
            await self.tick()

    async def tick(self) -> None:
        """Renew, give up what is drained, take this process's share, open new consumers."""
        want = share(self.members, self.owners.member.name, self.owners.count)
        drained = [p for p in self.owned.values() if p.releasing and self._drained(p)]
        # Past its deadline with lanes still running: their runs are cut short, so the
        # next owner counts what this one's consumer delivered.
        expiring = [p.number for p in drained if p.inflight]
        releasing = [p.number for p in drained if not p.inflight]
        asked_at = time.monotonic()
        try:
            tick = await self.owners.tick(
                want if self.members else 0,
                releasing,
                expiring,
                # Asked just before taking more: a tick a stop overtook (one waiting on
                # PostgreSQL) must not take partitions from live processes to give up.
                taking=lambda: not self._stopping.is_set(),
            )
        except Exception:
            # Unknown whether the leases were renewed: past the lease, another owner may
            # have them, so stop fetching what may be lost (the lanes stop at once).
            self._expire(asked_at)
            raise
        self.members = tick.members
        for number in releasing + expiring:
            part = self.owned.pop(number)
            self._blocked.forget(self.spec.name, part.keys)
            await self._stop_fetching(part)
            self._logger.info(log.Event.PARTITION_RELEASED, partition=number, epoch=part.epoch)
            self._observer.partitions_changed(self.spec, "released", len(self.owned))
        for number, part in list(self.owned.items()):
            if tick.owned.get(number) != part.epoch:
                await self._lose(part)
        self._lease_until = asked_at + self.settings.partition_lease_s * 0.75
        for got in tick.acquired:
            part = Partition(got.partition, got.epoch, got.previous_consumer, released=got.released)
            self.owned[got.partition] = part
            self._logger.info(log.Event.PARTITION_ACQUIRED, partition=part.number, epoch=part.epoch)
            self._observer.partitions_changed(self.spec, "acquired", len(self.owned))
        for part in self.owned.values():
            if part.consumer is None and not part.releasing and not self._stopping.is_set():
                await self._open(part)
        self._give_up_surplus(share(self.members, self.owners.member.name, self.owners.count))

    def _expire(self, asked_at: float) -> None:
        """Past the lease as this process counts it: another owner may have the partitions
        now. Stop them at once; give them up (a new epoch, a consumer at the floor) even if
        the database still has them: their lanes left messages unacked behind later ones."""
        if asked_at > self._lease_until:
            for part in self.owned.values():
                self._stop(part)

    def _stop(self, part: Partition) -> None:
        """Stop fetching ``part`` and starting its messages; it is released once drained."""
        if part.releasing:
            return
        part.releasing = True
        # A handler running now may take its whole lease to finish.
        part.release_by = time.monotonic() + (self.spec.ack_wait_s or self.settings.ack_wait_s)
        part.lost.set()
        if part.task is not None:
            part.task.cancel()

    def _drained(self, part: Partition) -> bool:
        return part.inflight == 0 or time.monotonic() >= part.release_by

    def _give_up_surplus(self, want: int) -> None:
        """Stop fetching the partitions above this process's share; released once drained."""
        kept = [p for p in self.owned.values() if not p.releasing]
        surplus = len(kept) - want
        for part in sorted(kept, key=lambda p: p.number, reverse=True)[: max(surplus, 0)]:
            # Its lanes leave what they have not started: the next owner's consumer starts
            # at or below it.
            self._stop(part)

    async def _lose(self, part: Partition) -> None:
        """Another process owns it now (this one's lease ran out): stop at once."""
        self.owned.pop(part.number, None)
        part.lost.set()
        self._blocked.forget(self.spec.name, part.keys)
        await self._stop_fetching(part)
        self._logger.warning(log.Event.PARTITION_LOST, partition=part.number, epoch=part.epoch)
        self._observer.partitions_changed(self.spec, "lost", len(self.owned))

    async def _open(self, part: Partition) -> None:
        """Create the ownership's consumer at the earlier ones' floor, name it, retire them."""
        await self._stop_fetching(part)
        opened = await partitions.open_consumer(
            self.js, self.spec, self.settings, part.number, part.epoch, part.previous
        )
        name, start = opened.name, opened.start
        recorded = await self.owners.record_consumer(
            part.number, part.epoch, name, opened.redelivers, counted=not part.released
        )
        if recorded is None:
            await partitions.retire(self.js, self.spec.stream, [name])
            await self._lose(part)
            return
        part.handovers = recorded
        earlier = await partitions.earlier_consumers(
            self.js, self.spec, part.number, part.epoch, part.previous
        )
        await partitions.retire(self.js, self.spec.stream, earlier)
        part.consumer = name
        part.sub = await fetcher.Fetcher(self.nc, self.spec.stream, name).start()
        part.task = asyncio.create_task(self._fetch_loop(part))
        self._logger.info(
            log.Event.SUBSCRIPTION_BOUND, partition=part.number, durable=name, start_seq=start
        )

    async def _stop_fetching(self, part: Partition) -> None:
        if part.task is not None:
            part.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await part.task
        if part.sub is not None:
            with contextlib.suppress(Exception):
                await part.sub.stop()

    async def _fetch_loop(self, part: Partition) -> None:
        assert part.sub is not None
        failures = 0
        strip = self.spec.partitions > 1
        while not self._stopping.is_set() and not part.lost.is_set():
            await self._wait_for_room(part)
            wanted = await self._take_slots()
            if wanted == 0:
                break
            # A partition's messages queue in few lanes (its keys'): a fetch that took every
            # free slot would leave the other partitions' keys idle while these run one by one.
            room = max(self._fair_share() - part.inflight, 1)
            if wanted > room:
                self._give_slots(wanted - room)
                wanted = room
            taken = Taken(self._give_slots, wanted)
            msgs: list[Msg] = []
            try:
                msgs = await part.sub.fetch(
                    wanted, self.settings.fetch_timeout_s, lingering=taken.all_but_one
                )
                failures = 0
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                pass
            except (nats.errors.Error, OSError) as exc:
                failures += 1
                self._logger.warning(
                    log.Event.FETCH_FAILED,
                    partition=part.number,
                    error=type(exc).__name__,
                    failures=failures,
                )
                # Given back before the wait: the partition may be lost meanwhile (its
                # consumer deleted by a new owner is what failed the fetch), and the
                # cancel that stops this loop then would keep them from every partition.
                self._give_slots(taken.count)
                taken.count = 0
                if isinstance(exc, nats.js.errors.NotFoundError) or failures > 3:
                    # The consumer is gone (a NATS restart without its store, or deleted):
                    # a new one at the floor of whatever is left, same epoch.
                    part.consumer = None
                    return
                await asyncio.sleep(backoff.backoff_s(failures, _RETRY_FIRST_S, _RETRY_MAX_S))
            except asyncio.CancelledError:
                self._give_slots(taken.count)
                raise
            received_at = time.monotonic()
            if part.lost.is_set():
                # Left unacked: the next owner's consumer starts at or below them.
                msgs = []
            self._give_slots(taken.count - len(msgs))
            if not msgs:
                continue
            self._read_ahead(msgs[-1])
            if strip:
                # The stream put the partition in front of the subject; the handler sees
                # the subject as it was published.
                for msg in msgs:
                    msg.subject = msg.subject.partition(".")[2]
            part.inflight += len(msgs)
            self._dispatch([self._counted(part, m) for m in msgs], received_at, part)

    def _read_ahead(self, newest: Msg) -> None:
        if self._epochs is not None:
            meta = newest.metadata
            self._epochs.read_ahead(meta.stream, meta.timestamp)

    @staticmethod
    def _counted(part: Partition, msg: Msg) -> Delivery:
        """``msg``, its delivery count including earlier owners' deliveries of it: a
        message that kills every process it runs in is dead-lettered as a crash loop
        after ``max_deliveries`` of them, though each new owner's consumer counts from 1."""
        earlier = part.handovers.earlier(int(msg.metadata.sequence.stream))
        return partitions.Redelivery(msg, earlier) if earlier else msg

    async def floor(self) -> int | None:
        """The lowest sequence below which every partition's messages have their outcome
        (:class:`eop.protocol.compaction.Compactor`'s floor); None until every partition
        has a consumer."""
        names = await self.owners.consumers()
        if not names or any(name is None for name in names.values()):
            return None
        return await partitions.floor(self.js, self.spec.stream, [n for n in names.values() if n])

    @property
    def lookahead(self) -> int:
        """How many messages of a partition may wait behind their keys' running lanes with
        their slots given back (so that its other keys' messages are fetched meanwhile).
        Beyond it they keep their slots: the fetch loop would otherwise take the whole
        backlog in, every waiting message's lease renewed every ``ack_wait_s / 3``."""
        return 4 * self._fair_share()

    def _fair_share(self) -> int:
        """The slots one owned partition may hold: the concurrency shared out."""
        return max(1, self.settings.concurrency // max(1, len(self.owned)))

    async def _wait_for_room(self, part: Partition) -> None:
        """Until half of the partition's share is free (all of it when the share is 1),
        or some of it is and ``fetch_timeout_s`` has passed.

        A fetch for every slot freed would be a pull request a message: each
        costs nats-server far more than the message it brings, and one
        partition's lanes free their slots one at a time. But the slots may
        stay taken: messages waiting behind a key whose message was nak'ed hold
        theirs until its redelivery, which only a fetch brings.
        """
        share = self._fair_share()
        patience = time.monotonic() + self.settings.fetch_timeout_s
        while part.inflight > share - max(1, share // 2) and not part.lost.is_set():
            if part.inflight < share and time.monotonic() >= patience:
                return
            part.room.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(part.room.wait(), 1.0)

    async def stored(self, seq: int) -> bool:
        """Whether the stream still holds sequence ``seq`` (True when it cannot tell).

        Only the server's "no message found" counts as gone: a stream that is
        being recovered after a restart answers "stream not found" for a while,
        and releasing a key then would let its later messages overtake.
        """
        try:
            await self.js.get_msg(self.spec.stream, seq)
        except nats.js.errors.NotFoundError as exc:
            return getattr(exc, "err_code", None) != NO_MESSAGE_FOUND
        except (nats.errors.Error, OSError, asyncio.TimeoutError):
            return True
        return True

    async def leave(self, *, clean: bool = True) -> None:
        """Give every partition up and leave (after the lanes finished), so that the
        other members take them at their next tick instead of at the lease's end.
        ``clean`` False: the stop cut runs short (the next owners count them)."""
        numbers = list(self.owned)
        for part in self.owned.values():
            part.lost.set()
        try:
            # Bounded: PostgreSQL not answering at a stop must not hold it; the leases
            # then pass on when they run out, as after a crash.
            await background.bounded(self.owners.leave(numbers, clean=clean), self.tick_s)
        except Exception as exc:
            self._logger.warning(log.Event.PARTITION_FAILED, error=log.brief_error(exc))
            return
        for number in numbers:
            self._logger.info(log.Event.PARTITION_RELEASED, partition=number)
        self.owned.clear()
        self._observer.partitions_changed(self.spec, "released", 0)


async def prepare(runner: OrderedRunner) -> None:
    """Check what the handler needs of the stream, and create its rows (the connection
    refused a server without subject transforms, eop.broker.server)."""
    if runner.spec.partitions > 1:
        with jetstream.translated(f"stream {runner.spec.stream!r}"):
            try:
                info = await runner.js.stream_info(runner.spec.stream)
            except nats.js.errors.NotFoundError as exc:
                raise errors.ConfigurationError(
                    f"stream {runner.spec.stream!r} does not exist"
                ) from exc
        partitions.check_transform(info, runner.spec)
    await failures.connected(runner.owners.prepare())
