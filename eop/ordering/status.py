"""The ordered handlers' part of ``eop status``: partitions, owners, lag, members.

An ordered handler has no durable consumer of its own: each of its
partitions is owned by one process at a time through a lease in the
database, and each ownership fetches from a consumer of its own
(``<durable>-p<partition>-e<epoch>``, :mod:`eop.ordering.partitions`). Its
status shows who owns which partition, each partition consumer's lag,
the last rebalance (the newest acquisition) and the live members. A
partition nobody owns, or whose owner's lease ran out, is waiting for a
member to take it: a warning, as a stopped worker's lag is for another
handler.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Sequence

import nats.js.errors
from nats.js import JetStreamContext, api

from eop.app import App
from eop.broker import jetstream
from eop.handler import HandlerSpec
from eop.ops import tables
from eop.ops.jetstream_state import group_warnings, window_warnings
from eop.ordering import ownership
from eop.pg import models


@dataclasses.dataclass
class PartitionStatus:
    """One partition of an ordered handler: its owner, lease, consumer and lag."""

    partition: int
    owner_host: str | None
    owner_pid: int | None
    epoch: int
    """Raised at every acquisition; the consumer of the ownership is named after it."""
    consumer: str | None
    acquired_at: datetime.datetime | None
    lease_left_s: float | None
    """Seconds left on the owner's lease; negative once it ran out; None without an owner."""
    num_pending: int | None = None
    """Messages of the partition not yet delivered to its consumer: its lag."""
    ack_pending: int | None = None
    """Delivered to the owner and not acked yet."""
    redelivered: int | None = None
    oldest_unacked_seq: int | None = None
    """Its delivery that has waited unacknowledged longest (None: none is known to wait)."""
    oldest_unacked_s: float | None = None
    """How long that delivery has waited, at least."""

    @property
    def owner(self) -> str | None:
        """``host:pid`` of the owning process, None when nobody owns it."""
        if self.owner_host is None:
            return None
        return f"{self.owner_host}:{self.owner_pid}"

    @property
    def expired(self) -> bool:
        """Owned, but its lease ran out (the owner died, froze or lost the database)."""
        return self.owner_host is not None and (self.lease_left_s or 0.0) < 0


@dataclasses.dataclass
class MemberStatus:
    """A live process that runs the handler (its member lease not run out)."""

    host: str
    pid: int
    joined_at: datetime.datetime | None


@dataclasses.dataclass
class OrderedStatus:
    """An ordered handler's partitions, their owners and lag, and its live members."""

    partition_count: int
    """As the database has it (the handler's declaration when it has no rows yet)."""
    partitions: list[PartitionStatus] = dataclasses.field(default_factory=list)
    members: list[MemberStatus] = dataclasses.field(default_factory=list)
    last_rebalance_at: datetime.datetime | None = None
    """The newest acquisition of any of its partitions."""
    last_rebalance_partition: int | None = None
    last_rebalance_epoch: int | None = None
    """The epoch that acquisition gave its partition."""

    def owners(self) -> dict[str, list[int]]:
        """``host:pid`` -> the partitions it owns (expired leases included)."""
        found: dict[str, list[int]] = {}
        for p in self.partitions:
            if p.owner is not None:
                found.setdefault(p.owner, []).append(p.partition)
        return found


def consumer_pattern(spec: HandlerSpec) -> str:
    """How an ordered handler's consumers are named, for the status's consumer column."""
    return f"{spec.durable}-p*-e*"


def from_rows(
    spec: HandlerSpec,
    rows: Iterable[ownership.PartitionRow],
    members: Iterable[ownership.MemberRow],
) -> OrderedStatus:
    """The handler's share of :func:`eop.ordering.ownership.read_status` and ``read_members``."""
    own = [r for r in rows if r.subscription == spec.name]
    status = OrderedStatus(partition_count=own[0].count if own else spec.partitions)
    for r in own:
        status.partitions.append(
            PartitionStatus(
                partition=r.partition,
                owner_host=r.host,
                owner_pid=r.pid,
                epoch=r.epoch,
                consumer=r.consumer,
                acquired_at=r.acquired_at,
                lease_left_s=r.expires_in_s if r.host is not None else None,
            )
        )
    status.members = [
        MemberStatus(host=m.host, pid=m.pid, joined_at=m.joined_at)
        for m in members
        if m.subscription == spec.name
    ]
    acquired = [p for p in status.partitions if p.acquired_at is not None]
    if acquired:
        last = max(acquired, key=lambda p: (p.acquired_at, p.epoch))
        status.last_rebalance_at = last.acquired_at
        status.last_rebalance_partition, status.last_rebalance_epoch = last.partition, last.epoch
    return status


async def read_ownership(
    app: App, specs: Sequence[HandlerSpec]
) -> tuple[list[ownership.PartitionRow], list[ownership.MemberRow]]:
    """Every ordered handler's partitions and live members (nothing without one)."""
    if not any(spec.order_by is not None for spec in specs):
        return [], []
    t = models.tables(app.settings.schema)
    rows = await ownership.read_status(app.engine, t)
    return rows, await ownership.read_members(app.engine, t)


async def read_lag(
    js: JetStreamContext, spec: HandlerSpec, status: OrderedStatus, warnings: list[str]
) -> list[tuple[PartitionStatus, api.ConsumerInfo]]:
    """Each partition consumer's lag, from NATS, with its consumer's info (for the
    window's and replicas' warnings); a consumer missing or silent goes to ``warnings``."""
    read = []
    for p in status.partitions:
        if p.consumer is None:
            continue
        try:
            info = await js.consumer_info(spec.stream, p.consumer)
        except nats.js.errors.NotFoundError:
            warnings.append(
                f"WARNING: partition {p.partition}'s consumer {p.consumer!r} does not exist on "
                f"stream {spec.stream!r} (its owner makes a new one at the earlier ones' floor)"
            )
            continue
        except jetstream.NATS_ERRORS as exc:
            warnings.append(
                f"WARNING: partition {p.partition}'s consumer {p.consumer!r} did not answer "
                f"({type(exc).__name__}); try again"
            )
            continue
        p.num_pending = int(info.num_pending or 0)
        p.ack_pending = int(info.num_ack_pending or 0)
        p.redelivered = int(info.num_redelivered or 0)
        read.append((p, info))
    return read


async def read_consumers(
    js: JetStreamContext, spec: HandlerSpec, status: OrderedStatus, warnings: list[str]
) -> int | None:
    """The partition consumers' lag (:func:`read_lag`), and the warnings about each one's
    ack-pending window and replicas; returns their ``max_ack_pending`` (None: none answered)."""
    limit = None
    for p, info in await read_lag(js, spec, status, warnings):
        limit = int(info.config.max_ack_pending or 0)
        warnings.extend(
            w.replace("WARNING: ", f"WARNING: partition {p.partition}: ", 1)
            for w in window_warnings(p.ack_pending or 0, limit)
        )
        warnings.extend(group_warnings(f"consumer {p.consumer!r}", info.cluster))
    return limit


def findings(spec: HandlerSpec, status: OrderedStatus) -> tuple[list[str], list[str]]:
    """(warnings, problems) about the partitions' ownership.

    No partition rows is a problem (as a missing consumer is for another
    handler), and so is a partition count other than the declared one (the
    workers refuse to start); a partition without an owner or with an
    expired lease is a warning: its messages wait until a member takes it.
    """
    warnings: list[str] = []
    problems: list[str] = []
    if not status.partitions:
        problems.append(
            f"handler {spec.name!r} has no partitions in the database (a worker creates them "
            "when it first runs the handler)"
        )
        return warnings, problems
    if status.partition_count != spec.partitions:
        problems.append(
            f"the database has {status.partition_count} partitions for handler {spec.name!r}, "
            f"which declares partitions={spec.partitions}: workers refuse to start it"
        )
    live = len(status.members)
    waiting = "its messages wait until a member takes it" + (
        "" if live else " (no live worker runs the handler)"
    )
    for p in status.partitions:
        if p.owner is None:
            warnings.append(f"WARNING: partition {p.partition} has no owner: {waiting}")
        elif p.expired:
            warnings.append(
                f"WARNING: partition {p.partition}'s lease expired {-(p.lease_left_s or 0):.0f} s "
                f"ago (owner {p.owner} died, froze or cannot reach the database): {waiting}"
            )
        elif p.consumer is None:
            warnings.append(
                f"WARNING: partition {p.partition} has no consumer yet (owner {p.owner} "
                "is creating it)"
            )
    return warnings, problems


def totals(status: OrderedStatus) -> tuple[int | None, int | None, int | None]:
    """(lag, ack pending, redelivered) summed over the partitions whose consumer answered."""
    read = [p for p in status.partitions if p.num_pending is not None]
    if not read:
        return None, None, None
    return (
        sum(p.num_pending or 0 for p in read),
        sum(p.ack_pending or 0 for p in read),
        sum(p.redelivered or 0 for p in read),
    )


_COLUMNS = (
    "HANDLER",
    "PARTITION",
    "OWNER",
    "EPOCH",
    "CONSUMER",
    "LAG",
    "ACK PENDING",
    "ACQUIRED (UTC)",
    "LEASE",
)


def format_partitions(handlers: Sequence[tuple[str, OrderedStatus]]) -> list[str]:
    """The ordered handlers' partitions as a table, then per handler its owners, live
    members and last rebalance, one line each."""
    cells = [list(_COLUMNS)]
    for name, status in handlers:
        for p in status.partitions:
            cells.append(
                [
                    name,
                    str(p.partition),
                    p.owner or "-",
                    str(p.epoch),
                    p.consumer or "-",
                    "?" if p.num_pending is None else str(p.num_pending),
                    "?" if p.ack_pending is None else str(p.ack_pending),
                    tables.utc(p.acquired_at) if p.acquired_at else "-",
                    _lease(p),
                ]
            )
    lines = tables.aligned(cells)
    for name, status in handlers:
        lines.extend(f"{name}: {line}" for line in describe(status))
    return lines


def describe(status: OrderedStatus) -> list[str]:
    """Who owns what, the live members and the last rebalance, in words."""
    owners = status.owners()
    owned = "; ".join(f"{owner} owns {_numbers(parts)}" for owner, parts in sorted(owners.items()))
    members = ", ".join(
        f"{m.host}:{m.pid}" + (f" (joined {tables.utc(m.joined_at)})" if m.joined_at else "")
        for m in status.members
    )
    lines = [
        f"{tables.counted(status.partition_count, 'partition')}; {owned or 'none owned'}",
        f"live members: {members or 'none'}",
    ]
    if status.last_rebalance_at is not None:
        lines.append(
            f"last rebalance: {tables.utc(status.last_rebalance_at)} UTC (partition "
            f"{status.last_rebalance_partition} taken at epoch {status.last_rebalance_epoch})"
        )
    return lines


def _numbers(parts: Sequence[int]) -> str:
    shown = ", ".join(str(n) for n in sorted(parts))
    return f"partition {shown}" if len(parts) == 1 else f"partitions {shown}"


def _lease(p: PartitionStatus) -> str:
    if p.lease_left_s is None:
        return "-"
    if p.lease_left_s < 0:
        return f"EXPIRED {-p.lease_left_s:.0f} s ago"
    return f"{p.lease_left_s:.0f} s left"
