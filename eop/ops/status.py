"""``eop status``: how each handler's subscription is doing, from NATS and PostgreSQL.

Per handler: its consumer's lag (``num_pending``), the ack-pending window
against ``max_ack_pending`` (a full window makes the server stop handing out
messages without any error: fetches just time out), redeliveries, the inbox
size and watermark, and the dead letters. In a NATS cluster, also its
stream's replicas and the leaders of the stream and of the consumer, with
the state of every other replica as the leader sees it (current, behind,
offline).

An ordered handler has no consumer of its own but one per partition
(:mod:`eop.ordering.status`): its lag and ack-pending counts are the
partitions' sums, and its status adds who owns which partition, each
partition's lag, the last rebalance and the live members.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from eop import errors
from eop.app import App, select_handlers
from eop.broker import floors as broker_floors
from eop.broker import jetstream
from eop.handler import HandlerSpec
from eop.ops import stuck, tables

# Re-exported as well: this module named them before they moved.
from eop.ops.jetstream_state import NEARLY_FULL as NEARLY_FULL
from eop.ops.jetstream_state import Replica as Replica
from eop.ops.jetstream_state import group
from eop.ops.jetstream_state import group_warnings as group_warnings
from eop.ops.jetstream_state import persistence_warnings as persistence_warnings
from eop.ops.jetstream_state import window_warnings as window_warnings
from eop.ordering import ownership
from eop.ordering import status as partition_status
from eop.pg import floors, migrate, models
from eop.pg.sql import dead_letters as dead_letters_sql
from eop.pg.sql import inbox as inbox_sql
from eop.pg.sql import retries as retries_sql
from eop.settings import Settings


@dataclasses.dataclass
class HandlerStatus:
    """The state of one handler's subscription."""

    handler: str
    stream: str
    consumer: str
    epoch: str | None = None
    num_pending: int | None = None
    """Messages in the stream not yet delivered to the consumer: its lag."""
    ack_pending: int | None = None
    max_ack_pending: int | None = None
    redelivered: int | None = None
    waiting_pulls: int | None = None
    ack_floor: int | None = None
    last_ack_at: datetime.datetime | None = None
    inbox_rows: int | None = None
    watermark: int | None = None
    last_processed_at: datetime.datetime | None = None
    """The newest outcome still in the inbox (compaction may have removed it)."""
    retrying: int | None = None
    """Failed messages whose retry waits in the database (acked in NATS)."""
    dead_letters: int | None = None
    dead_letters_unreplayed: int | None = None
    stream_replicas: int | None = None
    stream_leader: str | None = None
    """The server that leads the stream (None on a server that is not in a cluster)."""
    stream_followers: list[Replica] = dataclasses.field(default_factory=list)
    consumer_replicas: int | None = None
    consumer_leader: str | None = None
    consumer_followers: list[Replica] = dataclasses.field(default_factory=list)
    ordered: partition_status.OrderedStatus | None = None
    """An ordered handler's partitions, owners and members (None for another handler)."""
    warnings: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    """What makes this subscription unable to work (a missing stream or consumer)."""
    oldest_unacked_seq: int | None = None
    """The stream sequence of the delivery that has waited unacknowledged longest (of
    every partition, for an ordered handler); None when none is known to wait."""
    oldest_unacked_s: float | None = None
    """How long it has waited, at least (:mod:`eop.ops.stuck`)."""
    ack_wait_s: float | None = None
    """The consumer's AckWait, as the server holds it (None: not read)."""
    stuck_after_s: float | None = None
    """A delivery unacknowledged longer is stuck: ``stuck_after_ack_waits`` AckWaits."""
    anomalies: list[str] = dataclasses.field(default_factory=list)
    """Deliveries stuck longer than :attr:`stuck_after_s`: the command exits 1."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able values (times in ISO 8601, UTC)."""
        out: dict[str, Any] = _jsonable(dataclasses.asdict(self))
        if self.ordered is not None:
            for shown, p in zip(out["ordered"]["partitions"], self.ordered.partitions, strict=True):
                shown["owner"], shown["expired"] = p.owner, p.expired
        return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime.datetime):
        return value.astimezone(datetime.timezone.utc).isoformat()
    if isinstance(value, dict):
        return {key: _jsonable(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


async def collect(app: App, handlers: Iterable[str] = ()) -> list[HandlerStatus]:
    """The status of the app's handlers (all, or those named).

    Raises :class:`eop.SchemaNotReady` when eop's tables are not migrated. A missing
    stream or consumer, or one that does not answer (no leader in a cluster), is a
    ``problem`` of its handler's status; so is NATS unreachable, when what PostgreSQL
    holds (the inbox, the retries, the dead letters, an ordered handler's owners) is
    still shown: an outage is when an operator needs it.
    """
    specs = select_handlers(app, handlers)
    if not specs:
        raise errors.ConfigurationError("the app has no handlers: register one with @app.handler")
    await migrate.ensure_ready(app.engine, app.settings.schema)
    try:
        nc = await jetstream.connect(app.settings, name="eop-status")
    except errors.NatsUnavailable as exc:
        return await _without_nats(app, specs, exc)
    try:
        js = nc.jetstream()
        epochs = jetstream.StreamEpochs(nc)
        owners = await partition_status.read_ownership(app, specs)
        statuses = []
        for spec in specs:
            status = _started(spec, owners)
            # Before the consumers: a recorded wait holds if their floors did not move since.
            observed = await floors.read(
                app.engine, models.tables(app.settings.schema), spec.name, spec.stream
            )
            await _from_nats(js, epochs, spec, status, app.settings)
            await _unacked(nc, app, spec, status, observed)
            await _from_database(app, spec, status)
            if status.ordered is not None:
                warnings, problems = partition_status.findings(spec, status.ordered)
                status.warnings.extend(warnings)
                status.problems.extend(problems)
            declared = app.stream_spec(spec.stream).replicas
            status.warnings.extend(replicas_warnings(declared, status))
            statuses.append(status)
        return statuses
    finally:
        await nc.close()


def _started(
    spec: HandlerSpec,
    owners: tuple[list[ownership.PartitionRow], list[ownership.MemberRow]],
) -> HandlerStatus:
    """A handler's status before anything is read: its names, and an ordered handler's
    partitions and members from ``owners``."""
    status = HandlerStatus(handler=spec.name, stream=spec.stream, consumer=spec.durable)
    if spec.order_by is not None:
        status.consumer = partition_status.consumer_pattern(spec)
        status.ordered = partition_status.from_rows(spec, *owners)
    return status


async def _without_nats(
    app: App, specs: Sequence[HandlerSpec], exc: errors.NatsUnavailable
) -> list[HandlerStatus]:
    """What PostgreSQL says of each handler, NATS being unreachable: a problem of each."""
    owners = await partition_status.read_ownership(app, specs)
    statuses = []
    for spec in specs:
        status = _started(spec, owners)
        status.problems.append(
            f"{exc}: its lag, acks and stuck deliveries are unknown; what PostgreSQL holds is shown"
        )
        await _from_database(app, spec, status)
        statuses.append(status)
    return statuses


async def _from_nats(
    js: JetStreamContext,
    epochs: jetstream.StreamEpochs,
    spec: HandlerSpec,
    status: HandlerStatus,
    settings: Settings,
) -> None:
    try:
        stream = await js.stream_info(spec.stream)
    except nats.js.errors.NotFoundError:
        status.problems.append(f"stream {spec.stream!r} does not exist")
        return
    except jetstream.NATS_ERRORS as exc:
        status.problems.append(_silent(f"stream {spec.stream!r}", exc))
        return
    status.epoch = await epochs.refresh(spec.stream)
    status.stream_replicas = stream.config.num_replicas or 1
    status.stream_leader, status.stream_followers = group(stream.cluster)
    status.warnings.extend(group_warnings(f"stream {spec.stream!r}", stream.cluster))
    status.warnings.extend(persistence_warnings(spec.stream, stream.config))
    if status.ordered is not None:
        ordered = status.ordered
        status.max_ack_pending = await partition_status.read_consumers(
            js, spec, ordered, status.warnings
        )
        status.num_pending, status.ack_pending, status.redelivered = partition_status.totals(
            ordered
        )
        return
    try:
        info = await js.consumer_info(spec.stream, spec.durable)
    except nats.js.errors.NotFoundError:
        status.problems.append(
            f"consumer {spec.durable!r} does not exist on stream {spec.stream!r} "
            "(a worker creates it when started with create on)"
        )
        return
    except jetstream.NATS_ERRORS as exc:
        status.problems.append(_silent(f"consumer {spec.durable!r}", exc))
        return
    status.consumer_leader, status.consumer_followers = group(info.cluster)
    # Its config says 0 when it follows its stream's: count the group's members instead
    # (without a leader, during an election, the server lists them all as replicas).
    members = {r.name for r in status.consumer_followers} | {status.consumer_leader}
    status.consumer_replicas = len(members - {None}) or 1
    status.warnings.extend(group_warnings(f"consumer {spec.durable!r}", info.cluster))
    status.num_pending = int(info.num_pending or 0)
    status.ack_pending = int(info.num_ack_pending or 0)
    status.max_ack_pending = int(info.config.max_ack_pending or 0)
    status.redelivered = int(info.num_redelivered or 0)
    status.ack_wait_s = info.config.ack_wait
    want = spec.ack_wait_s or settings.ack_wait_s
    if status.ack_wait_s is not None and abs(status.ack_wait_s - want) >= 0.001:
        status.warnings.append(
            f"WARNING: consumer {spec.durable!r} has AckWait {status.ack_wait_s:g} s, but "
            f"these settings say {want:g} s: workers started with them set it to theirs "
            "(with creating consumers off they refuse to start). If the workers run with "
            "--ack-wait-s or EOP_ACK_WAIT_S, give eop status the same EOP_ACK_WAIT_S"
        )
    status.waiting_pulls = int(info.num_waiting or 0)
    if info.ack_floor is not None:
        status.ack_floor = broker_floors.acked_through(info)
        status.last_ack_at = info.ack_floor.last_active
    status.warnings.extend(window_warnings(status.ack_pending, status.max_ack_pending))


async def _unacked(
    nc: NATS,
    app: App,
    spec: HandlerSpec,
    status: HandlerStatus,
    observed: dict[str, floors.Observed],
) -> None:
    """The oldest unacknowledged delivery of each consumer, and those that are stuck."""
    status.stuck_after_s = app.settings.stuck_after_ack_waits * (
        status.ack_wait_s or spec.ack_wait_s or app.settings.ack_wait_s
    )
    names: dict[int | None, str | None] = {None: spec.durable}
    if status.ordered is not None:
        names = {p.partition: p.consumer for p in status.ordered.partitions}
    try:
        found = await stuck.oldest(nc, spec.stream, names, observed, app.settings)
    except errors.NatsUnavailable as exc:
        status.warnings.append(f"WARNING: cannot time the unacknowledged deliveries: {exc}")
        return
    by_partition = {w.partition: w for w in found}
    for p in status.ordered.partitions if status.ordered is not None else []:
        if p.partition in by_partition:
            p.oldest_unacked_seq = by_partition[p.partition].seq
            p.oldest_unacked_s = round(by_partition[p.partition].waited_s, 1)
    if found:
        first = max(found, key=lambda w: w.waited_s)
        status.oldest_unacked_seq, status.oldest_unacked_s = first.seq, round(first.waited_s, 1)
    status.anomalies.extend(w.describe() for w in found if w.stuck)


def _silent(what: str, exc: BaseException) -> str:
    # The connection is up (collect connected): the group's leader did not answer.
    return (
        f"{what} did not answer ({type(exc).__name__}): in a cluster, it has no leader now "
        "(an election is under way, or too few of its servers are up); try again"
    )


def replicas_warnings(declared: int | None, status: HandlerStatus) -> list[str]:
    """A stream whose replicas differ from what the app declares (``app.stream(replicas=)``)."""
    have = status.stream_replicas
    if declared is None or have is None or declared == have:
        return []
    return [
        f"WARNING: stream {status.stream!r} has {have} replicas, the app declares {declared}: "
        f"eop leaves an existing stream as it is (`nats stream edit {status.stream} "
        f"--replicas {declared}` changes it)"
    ]


async def _from_database(app: App, spec: HandlerSpec, status: HandlerStatus) -> None:
    t = models.tables(app.settings.schema)
    async with app.sessionmaker() as session:
        rows, last = (await session.execute(dead_letters_sql.inbox_summary(t, spec.name))).one()
        status.inbox_rows, status.last_processed_at = int(rows), last
        total, unreplayed = (
            await session.execute(dead_letters_sql.dead_letter_summary(t, spec.name))
        ).one()
        status.dead_letters, status.dead_letters_unreplayed = int(total), int(unreplayed)
        status.retrying = int(
            (await session.execute(retries_sql.count_parked(t, spec.name))).scalar_one()
        )
        if status.epoch is not None:
            stmt = inbox_sql.watermark(t, spec.name, spec.stream, status.epoch)
            value: Any = (await session.execute(stmt)).scalar()
            status.watermark = int(value) if value is not None else 0


_COLUMNS = (
    ("HANDLER", "handler"),
    ("STREAM", "stream"),
    ("CONSUMER", "consumer"),
    ("LAG", "num_pending"),
    ("ACK PENDING", "window"),
    ("REDELIVERED", "redelivered"),
    ("INBOX", "inbox_rows"),
    ("WATERMARK", "watermark"),
    ("RETRYING", "retrying"),
    ("DEAD (UNREPLAYED)", "dead"),
    ("LAST OUTCOME (UTC)", "last_processed_at"),
)


def format_table(statuses: Sequence[HandlerStatus]) -> str:
    """The statuses as a table, then their warnings and problems, one per line."""
    cells = [[title for title, _ in _COLUMNS]]
    for s in statuses:
        cells.append([_cell(key, s) for _, key in _COLUMNS])
    lines = tables.aligned(cells)
    if any(s.stream_replicas is not None for s in statuses):
        lines.append("")
        lines.extend(_replicas_table(statuses))
    ordered = [(s.handler, s.ordered) for s in statuses if s.ordered is not None]
    if ordered:
        lines.append("")
        lines.extend(partition_status.format_partitions(ordered))
    lines.extend(_grouped(statuses, lambda s: s.warnings, ""))
    lines.extend(_grouped(statuses, lambda s: s.problems, "ERROR: "))
    lines.extend(_grouped(statuses, lambda s: s.anomalies, "ANOMALY: "))
    return "\n".join(lines)


def problem_summary(statuses: Sequence[HandlerStatus]) -> str:
    """The statuses' problems and anomalies on one line, each said once with the handlers
    it concerns (an unreachable NATS is every handler's), or ``""`` when there are none."""
    return "; ".join(
        [
            *_grouped(statuses, lambda s: s.problems, ""),
            *_grouped(statuses, lambda s: s.anomalies, ""),
        ]
    )


def _grouped(
    statuses: Sequence[HandlerStatus], notes: Callable[[HandlerStatus], list[str]], tag: str
) -> list[str]:
    """``handler[, handler...]: <tag><note>`` for each distinct note, in first-seen order."""
    handlers: dict[str, list[str]] = {}
    for s in statuses:
        for note in notes(s):
            handlers.setdefault(note, []).append(s.handler)
    return [f"{', '.join(names)}: {tag}{note}" for note, names in handlers.items()]


_REPLICA_COLUMNS = (
    "HANDLER",
    "STREAM REPLICAS",
    "STREAM LEADER",
    "STREAM FOLLOWERS",
    "CONSUMER LEADER",
    "CONSUMER FOLLOWERS",
)


def _replicas_table(statuses: Sequence[HandlerStatus]) -> list[str]:
    """Where each handler's stream and consumer live: replicas, leaders, followers' state."""

    def followers(replicas: Sequence[Replica]) -> str:
        return ", ".join(r.describe() for r in replicas) or "-"

    cells = [list(_REPLICA_COLUMNS)]
    for s in statuses:
        cells.append(
            [
                s.handler,
                "?" if s.stream_replicas is None else str(s.stream_replicas),
                s.stream_leader or "-",
                followers(s.stream_followers),
                s.consumer_leader or "-",
                followers(s.consumer_followers),
            ]
        )
    return tables.aligned(cells)


def _cell(key: str, s: HandlerStatus) -> str:
    if key == "window":
        if s.ack_pending is None:
            return "?"
        limit = str(s.max_ack_pending) if s.max_ack_pending else "unlimited"
        full = " FULL" if any("window full" in w for w in s.warnings) else ""
        if s.ordered is not None:
            # The sum over the partitions' consumers, each with its own window.
            return f"{s.ack_pending} (max {limit} each){full}"
        return f"{s.ack_pending}/{limit}{full}"
    if key == "dead":
        if s.dead_letters is None:
            return "?"
        return f"{s.dead_letters} ({s.dead_letters_unreplayed})"
    value = getattr(s, key)
    if value is None:
        return "-" if key == "last_processed_at" else "?"
    if isinstance(value, datetime.datetime):
        return tables.utc(value)
    return str(value)
