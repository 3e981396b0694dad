"""``eop status``: how each handler's subscription is doing, from NATS and PostgreSQL.

Per handler: its consumer's lag (``num_pending``), the ack-pending window
against ``max_ack_pending`` (a full window makes the server stop handing out
messages without any error: fetches just time out), redeliveries, the inbox
size and watermark, and the dead letters.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Sequence
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext

from eop import errors
from eop.app import App, select_handlers
from eop.broker import jetstream
from eop.handler import HandlerSpec
from eop.ops import tables
from eop.pg import migrate, models, sql

#: Share of max_ack_pending from which the window is reported as nearly full.
NEARLY_FULL = 0.9


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
    warnings: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    """What makes this subscription unable to work (a missing stream or consumer)."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able values (times in ISO 8601, UTC)."""
        out = dataclasses.asdict(self)
        for key, value in out.items():
            if isinstance(value, datetime.datetime):
                out[key] = value.astimezone(datetime.timezone.utc).isoformat()
        return out


def window_warnings(ack_pending: int, max_ack_pending: int) -> list[str]:
    """Warnings about the ack-pending window (max_ack_pending <= 0 means unlimited)."""
    if max_ack_pending <= 0:
        return []
    if ack_pending >= max_ack_pending:
        return [
            f"WARNING: ack-pending window full ({ack_pending}/{max_ack_pending}): the server "
            "hands out no more messages until some are acked; fetches stall silently "
            "(slow or stuck handlers, or workers that died holding deliveries until AckWait)"
        ]
    if ack_pending >= NEARLY_FULL * max_ack_pending:
        return [
            f"WARNING: ack-pending window nearly full ({ack_pending}/{max_ack_pending}): "
            "fetches stall once it is full"
        ]
    return []


async def collect(app: App, handlers: Iterable[str] = ()) -> list[HandlerStatus]:
    """The status of the app's handlers (all, or those named).

    Raises :class:`eop.SchemaNotReady` when eop's tables are not migrated and
    :class:`eop.NatsUnavailable` when NATS is unreachable; a missing stream or
    consumer is a ``problem`` of its handler's status.
    """
    specs = select_handlers(app, handlers)
    if not specs:
        raise errors.ConfigurationError("the app has no handlers: register one with @app.handler")
    await migrate.ensure_ready(app.engine, app.settings.schema)
    nc = await jetstream.connect(app.settings, name="eop-status")
    try:
        js = nc.jetstream()
        epochs = jetstream.StreamEpochs(nc)
        statuses = []
        for spec in specs:
            status = HandlerStatus(handler=spec.name, stream=spec.stream, consumer=spec.durable)
            await _from_nats(js, epochs, spec, status)
            await _from_database(app, spec, status)
            statuses.append(status)
        return statuses
    finally:
        await nc.close()


async def _from_nats(
    js: JetStreamContext, epochs: jetstream.StreamEpochs, spec: HandlerSpec, status: HandlerStatus
) -> None:
    try:
        await js.stream_info(spec.stream)
    except nats.js.errors.NotFoundError:
        status.problems.append(f"stream {spec.stream!r} does not exist")
        return
    except jetstream.NATS_ERRORS as exc:
        raise errors.NatsUnavailable(f"cannot read stream {spec.stream!r}: {exc!r}") from exc
    status.epoch = await epochs.refresh(spec.stream)
    try:
        info = await js.consumer_info(spec.stream, spec.durable)
    except nats.js.errors.NotFoundError:
        status.problems.append(
            f"consumer {spec.durable!r} does not exist on stream {spec.stream!r} "
            "(a worker creates it when started with create on)"
        )
        return
    status.num_pending = int(info.num_pending or 0)
    status.ack_pending = int(info.num_ack_pending or 0)
    status.max_ack_pending = int(info.config.max_ack_pending or 0)
    status.redelivered = int(info.num_redelivered or 0)
    status.waiting_pulls = int(info.num_waiting or 0)
    if info.ack_floor is not None:
        status.ack_floor = int(info.ack_floor.stream_seq)
        status.last_ack_at = info.ack_floor.last_active
    status.warnings.extend(window_warnings(status.ack_pending, status.max_ack_pending))


async def _from_database(app: App, spec: HandlerSpec, status: HandlerStatus) -> None:
    t = models.tables(app.settings.schema)
    async with app.sessionmaker() as session:
        rows, last = (await session.execute(sql.inbox_summary(t, spec.name))).one()
        status.inbox_rows, status.last_processed_at = int(rows), last
        total, unreplayed = (await session.execute(sql.dead_letter_summary(t, spec.name))).one()
        status.dead_letters, status.dead_letters_unreplayed = int(total), int(unreplayed)
        status.retrying = int((await session.execute(sql.count_parked(t, spec.name))).scalar_one())
        if status.epoch is not None:
            stmt = sql.watermark(t, spec.name, spec.stream, status.epoch)
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
    for s in statuses:
        lines.extend(f"{s.handler}: {w}" for w in s.warnings)
        lines.extend(f"{s.handler}: ERROR: {p}" for p in s.problems)
    return "\n".join(lines)


def _cell(key: str, s: HandlerStatus) -> str:
    if key == "window":
        if s.ack_pending is None:
            return "?"
        limit = str(s.max_ack_pending) if s.max_ack_pending else "unlimited"
        full = " FULL" if any("window full" in w for w in s.warnings) else ""
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
