"""``eop audit``: check on your own data that every message has exactly one outcome.

The audit walks a handler consumer's range of the stream (the consumer's
subject filters, skipping deleted messages) with a throwaway ordered
consumer, headers only when few inbox rows need a fingerprint, and reads
the inbox and the dead letters by sequence ranges beside it. Its findings:

- ``acked_without_outcome``: the consumer's ack floor passed a message (or,
  above the floor, more messages lack an outcome than the consumer holds
  unacknowledged), yet the message has no inbox row, no dead letter and no
  msg-id row, and lies above the inbox watermark.
- ``outcome_message_gone``: an inbox row or dead letter whose message the
  stream no longer holds (deleted from its middle, beyond its last sequence,
  or of an epoch whose stream was deleted).
- ``reused_sequence``: an outcome recorded at a sequence that now holds
  another message (another fingerprint in the same epoch, or a new epoch).
- ``stuck_delivery``: a delivered message left unacknowledged for several
  AckWaits, or a full ack-pending window.

What the watermark hides: eop deletes inbox rows at or below the watermark,
which only ever rises to the consumer's ack floor (or below the stream's first
sequence), and eop acks a message only after its outcome committed. Below the
watermark the audit can therefore only show that the consumer acked (or
termed) every message, that no retained row or dead letter belongs to another
message, and, through msg-id rows kept for ``msg_id_retention_s``, the
outcomes of recent messages that carry a ``Nats-Msg-Id``; it cannot show a
compacted message's outcome individually.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import enum
import json
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from eop import errors, inbox, jetstream, message, migrate, models, sql
from eop.app import App, select_handlers
from eop.handler import HandlerSpec

ACKED_WITHOUT_OUTCOME = "acked_without_outcome"
OUTCOME_MESSAGE_GONE = "outcome_message_gone"
REUSED_SEQUENCE = "reused_sequence"
STUCK_DELIVERY = "stuck_delivery"
KINDS = (ACKED_WITHOUT_OUTCOME, OUTCOME_MESSAGE_GONE, REUSED_SEQUENCE, STUCK_DELIVERY)

#: Anomalies listed per kind and handler (all are counted).
LISTED_PER_KIND = 100
#: Walk with full payloads when at least this share of the range has inbox rows to verify.
_DENSE_ROWS = 0.25
_GETS_IN_FLIGHT = 64
_NATS_ERRORS = (OSError, asyncio.TimeoutError, nats.errors.Error)


@dataclasses.dataclass(frozen=True)
class Options:
    """What to audit and how."""

    from_seq: int | None = None
    to_seq: int | None = None
    limit: int | None = None
    """Stop after checking this many messages (the report names where to go on)."""
    batch: int = 500
    stuck_after_s: float | None = None
    """A delivery unacked for longer is stuck (default: 3 AckWaits of the consumer)."""
    current_epoch_only: bool = False
    """Ignore outcomes recorded for earlier incarnations of the stream."""


class Verdict(enum.Enum):
    """What the audit concludes about one message of the stream."""

    OUTCOME = "outcome"
    DEAD_LETTER = "dead_letter"
    DUPLICATE = "duplicate_by_msg_id"
    COMPACTED = "compacted"
    UNSETTLED = "unsettled"
    ACKED_WITHOUT_OUTCOME = ACKED_WITHOUT_OUTCOME
    REUSED_SEQUENCE = REUSED_SEQUENCE


@dataclasses.dataclass(frozen=True)
class Walked:
    """A message of the stream as the walk saw it."""

    seq: int
    subject: str
    msg_id: str | None
    stored_at: datetime.datetime | None = None
    fingerprint: bytes | None = None
    """Known when the walk carried payloads or the message was fetched to verify a row."""


@dataclasses.dataclass(frozen=True)
class Recorded:
    """An inbox row or a dead letter at a sequence."""

    seq: int
    fingerprint: bytes
    outcome: str
    """The inbox outcome, or ``dead_letter`` for a row of the dead letters."""
    ref: str = ""
    """For a dead letter: its id and reason."""


@dataclasses.dataclass(frozen=True)
class Position:
    """Where the consumer and the inbox stood when the rows were read."""

    watermark: int
    ack_floor: int


@dataclasses.dataclass(frozen=True)
class Consumer:
    """The handler's durable consumer, read before the database."""

    exists: bool
    filters: tuple[str, ...]
    ack_floor: int = 0
    ack_floor_at: datetime.datetime | None = None
    delivered: int = 0
    ack_pending: int = 0
    redelivered: int = 0
    max_ack_pending: int = 0
    ack_wait_s: float = 30.0
    created_at: datetime.datetime | None = None
    start_seq: int = 1
    deliver_policy: str = "all"


@dataclasses.dataclass(frozen=True)
class Stream:
    """The stream's incarnation and state."""

    name: str
    epoch: str
    first_seq: int
    last_seq: int
    now: datetime.datetime
    interior_removal: bool
    """Retention itself removes messages from the middle (interest, work queue, per subject)."""


@dataclasses.dataclass(frozen=True)
class Anomaly:
    """One finding that contradicts exactly-once."""

    kind: str
    seq: int | None
    epoch: str | None
    detail: str


@dataclasses.dataclass
class HandlerAudit:
    """The audit of one handler: what was walked, what was found."""

    handler: str
    stream: str
    durable: str
    epoch: str = ""
    filters: list[str] = dataclasses.field(default_factory=list)
    stream_first_seq: int = 0
    stream_last_seq: int = 0
    range_from: int = 0
    range_to: int = 0
    truncated: bool = False
    next_seq: int | None = None
    watermark: int = 0
    ack_floor: int = 0
    delivered: int = 0
    ack_pending: int = 0
    redelivered: int = 0
    checked: int = 0
    outcomes: int = 0
    dead_letters: int = 0
    duplicates: int = 0
    compacted: int = 0
    verified_below_watermark: int = 0
    unsettled: int = 0
    removed_with_outcome: int = 0
    outside_filter: int = 0
    counts: Counter[str] = dataclasses.field(default_factory=Counter)
    anomalies: list[Anomaly] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def add(self, anomaly: Anomaly) -> None:
        """Count an anomaly; list it while its kind has fewer than :data:`LISTED_PER_KIND`."""
        self.counts[anomaly.kind] += 1
        if self.counts[anomaly.kind] <= LISTED_PER_KIND:
            self.anomalies.append(anomaly)

    @property
    def clean(self) -> bool:
        """True when nothing contradicts exactly-once."""
        return not self.counts

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able view."""
        data = dataclasses.asdict(self)
        data["counts"] = {kind: self.counts.get(kind, 0) for kind in KINDS}
        data["clean"] = self.clean
        return data


@dataclasses.dataclass
class Report:
    """The audit of every handler asked for."""

    handlers: list[HandlerAudit]

    @property
    def clean(self) -> bool:
        """True when no handler has an anomaly."""
        return all(h.clean for h in self.handlers)

    def as_json(self) -> str:
        """The report as JSON, for scripts."""
        return json.dumps(
            {"clean": self.clean, "handlers": [h.as_dict() for h in self.handlers]}, indent=2
        )


# --- classification: pure functions, one message or row at a time -------------------


def classify(
    msg: Walked,
    row: Recorded | None,
    dead: Sequence[Recorded],
    by_msg_id: str | None,
    pos: Position,
) -> tuple[Verdict, str]:
    """The verdict on one walked message of the current epoch, and why.

    ``row`` is its inbox row, ``dead`` the dead letters at its sequence,
    ``by_msg_id`` where another row holds its ``Nats-Msg-Id``. A message with
    a row or a dead letter must carry its fingerprint.
    """
    fp = msg.fingerprint
    foreign = [d for d in dead if d.fingerprint != fp]
    if (row is not None and row.fingerprint != fp) or foreign:
        return Verdict.REUSED_SEQUENCE, _reused_detail(msg, row, dead, pos)
    if row is not None:
        if row.outcome == models.OUTCOME_DEAD_LETTERED:
            return Verdict.DEAD_LETTER, ""
        return Verdict.OUTCOME, ""
    if dead:
        return Verdict.DEAD_LETTER, ""
    if by_msg_id is not None:
        return Verdict.DUPLICATE, f"msg-id {msg.msg_id!r} has its outcome at {by_msg_id}"
    if msg.seq <= pos.watermark:
        return Verdict.COMPACTED, ""
    if msg.seq <= pos.ack_floor:
        return Verdict.ACKED_WITHOUT_OUTCOME, (
            f"at or below the ack floor {pos.ack_floor} and above the watermark "
            f"{pos.watermark}, but no inbox row, dead letter or msg-id row"
        )
    return Verdict.UNSETTLED, ""


def _reused_detail(
    msg: Walked, row: Recorded | None, dead: Sequence[Recorded], pos: Position
) -> str:
    own = [d for d in dead if d.fingerprint == msg.fingerprint]
    recorded = "an inbox row" if row is not None and row.fingerprint != msg.fingerprint else ""
    if not recorded:
        recorded = "a dead letter " + ", ".join(
            d.ref for d in dead if d.fingerprint != msg.fingerprint
        )
    text = f"{recorded} of another message (another fingerprint) is recorded at this sequence"
    if own:
        return f"{text}; the message now there was quarantined as dead letter {own[0].ref}"
    if row is not None and row.fingerprint == msg.fingerprint:
        return f"{text}; the message now there has its own inbox row"
    acked = " although the consumer acked it" if msg.seq <= pos.ack_floor else ""
    return f"{text}; the message now there has no outcome{acked}"


def classify_unseen(
    row: Recorded, occupant: Walked | None, stream: Stream, audit_to: int
) -> tuple[str | None, str]:
    """An outcome of the current epoch at a sequence the walk did not deliver.

    ``occupant`` is the message the stream holds there now (fetched by
    sequence, with its fingerprint), None when it holds none. Returns an
    anomaly kind (or None) and a label: ``removed``, ``outside_filter``,
    ``newer`` or the anomaly's detail.
    """
    if row.seq < stream.first_seq:
        return None, "removed"
    if row.seq > stream.last_seq:
        return OUTCOME_MESSAGE_GONE, (
            f"beyond the stream's last sequence {stream.last_seq}: the stream lost its tail"
        )
    if row.seq > audit_to:
        return None, "newer"
    if occupant is None:
        if stream.interior_removal:
            return None, "removed"
        return OUTCOME_MESSAGE_GONE, "the message was deleted from the stream"
    if occupant.fingerprint == row.fingerprint:
        return None, "outside_filter"
    return REUSED_SEQUENCE, (
        "the stream now holds another message (another fingerprint) at this sequence"
    )


def classify_old_epoch(row: Recorded, epoch: str, occupant: Walked | None, current: str) -> Anomaly:
    """An outcome recorded for an earlier incarnation (epoch) of the stream."""
    if occupant is None:
        detail = f"epoch {epoch} of the stream is gone (the stream was recreated as {current})"
        return Anomaly(OUTCOME_MESSAGE_GONE, row.seq, epoch, detail)
    same = occupant.fingerprint == row.fingerprint
    detail = f"the recreated stream (epoch {current}) holds " + (
        "the same message again (same fingerprint): it may take effect once per epoch"
        if same
        else "another message at this sequence"
    )
    return Anomaly(REUSED_SEQUENCE, row.seq, epoch, detail)


def unacked_without_outcome(
    open_count: int, sample: Sequence[int], consumer: Consumer
) -> Anomaly | None:
    """Above the ack floor: more messages lack an outcome than the consumer holds unacked.

    ``open_count`` delivered messages above the floor have no outcome
    (``sample``: some of their sequences). The consumer was read before the
    inbox: every delivered message it did not hold unacknowledged then was
    acked, so its outcome had committed. Which ones cannot be told apart.
    """
    excess = open_count - consumer.ack_pending
    if excess <= 0:
        return None
    listed = ", ".join(str(s) for s in sample)
    return Anomaly(
        ACKED_WITHOUT_OUTCOME,
        None,
        None,
        f"{open_count} delivered messages above the ack floor {consumer.ack_floor} "
        f"have no outcome, but the consumer holds only {consumer.ack_pending} unacknowledged: "
        f"at least {excess} were acked without an outcome (among {listed})",
    )


def stuck(
    first_open: Walked | None, consumer: Consumer, now: datetime.datetime, after_s: float
) -> list[Anomaly]:
    """Deliveries that are not moving: the oldest unacked message, a full window."""
    found = []
    if consumer.max_ack_pending > 0 and consumer.ack_pending >= consumer.max_ack_pending:
        found.append(
            Anomaly(
                STUCK_DELIVERY,
                None,
                None,
                f"ack-pending window full ({consumer.ack_pending}/{consumer.max_ack_pending}): "
                "fetches stall until a delivery is acked",
            )
        )
    if first_open is None or first_open.seq > consumer.delivered or consumer.ack_pending == 0:
        return found
    # The floor has not moved since it was last active, and the message was
    # stored no earlier than that: both bound how long it has been unacked.
    since = [t for t in (consumer.ack_floor_at or consumer.created_at, first_open.stored_at) if t]
    if not since:
        return found
    age_s = (now - max(since)).total_seconds()
    if age_s > after_s:
        found.append(
            Anomaly(
                STUCK_DELIVERY,
                first_open.seq,
                None,
                f"delivered but unacknowledged for at least {age_s:.0f} s (> {after_s:g} s, "
                f"AckWait {consumer.ack_wait_s:g} s); the consumer holds "
                f"{consumer.ack_pending} unacknowledged, {consumer.redelivered} of them "
                "redelivered",
            )
        )
    return found


def fingerprint(subject: str, headers: Mapping[str, str] | None, data: bytes | None) -> bytes:
    """The fingerprint eop stores for a message (see :attr:`eop.Message.fingerprint`)."""
    return message.Message(
        subscription="",
        subject=subject,
        data=bytes(data or b""),
        headers={str(k): str(v) for k, v in (headers or {}).items()},
        stream="",
        stream_epoch="",
        seq=0,
        num_delivered=0,
    ).fingerprint


# --- the walk: NATS and PostgreSQL ---------------------------------------------------


async def run(app: App, handlers: Iterable[str] = (), options: Options | None = None) -> Report:
    """Audit the handlers called ``handlers`` (all when empty) of ``app``."""
    options = options or Options()
    specs = select_handlers(app, handlers)
    if not specs:
        raise errors.ConfigurationError("the app has no handlers: nothing to audit")
    try:
        await migrate.ensure_ready(app.engine, app.settings.schema)
        nc = await jetstream.connect(app.settings, name="eop-audit")
        try:
            audits = [await _Auditor(nc, app, spec, options).run() for spec in specs]
        finally:
            with contextlib.suppress(*_NATS_ERRORS):
                await nc.close()
    finally:
        await app.dispose()
    return Report(audits)


@contextlib.contextmanager
def _nats_edge(what: str) -> Any:
    try:
        yield
    except _NATS_ERRORS as exc:
        raise errors.NatsUnavailable(f"{what}: {type(exc).__name__} {exc}".strip()) from exc


class _Auditor:
    """The audit of one handler."""

    def __init__(self, nc: Any, app: App, spec: HandlerSpec, options: Options) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.app, self.spec, self.options = app, spec, options
        self.tables = models.tables(app.settings.schema)
        self.report = HandlerAudit(handler=spec.name, stream=spec.stream, durable=spec.durable)
        self.headers_only = True
        self._open_count = 0
        self._open_sample: list[int] = []
        self._first_open: Walked | None = None

    async def run(self) -> HandlerAudit:
        """Read the consumer first (its ack floor bounds what the inbox must hold), then walk."""
        self.stream = await self._stream()
        self.consumer = await self._consumer()
        r, s, c = self.report, self.stream, self.consumer
        r.epoch, r.filters = s.epoch, list(c.filters)
        r.stream_first_seq, r.stream_last_seq = s.first_seq, s.last_seq
        r.ack_floor, r.delivered = c.ack_floor, c.delivered
        r.ack_pending, r.redelivered = c.ack_pending, c.redelivered
        lo = max(self.options.from_seq or 1, 1)
        self.audit_to = min(self.options.to_seq or s.last_seq, s.last_seq)
        start = max(lo, s.first_seq, c.start_seq)
        r.range_from, r.range_to = lo, self.audit_to
        self.headers_only = await self._sparse(start, self.audit_to)
        segment_lo = lo
        async with contextlib.aclosing(self._walk(start, self.audit_to)) as batches:
            async for batch in batches:
                await self._segment(segment_lo, batch[-1].seq, batch)
                segment_lo = batch[-1].seq + 1
        if r.truncated:
            r.range_to, r.next_seq = segment_lo - 1, segment_lo
        else:
            await self._tail(segment_lo)
        if not self.options.current_epoch_only:
            await self._old_epochs(lo)
        self._finish()
        if (await self._stream()).epoch != s.epoch:
            raise errors.EopError(f"stream {s.name!r} was recreated during the audit: run it again")
        return r

    def _finish(self) -> None:
        c = self.consumer
        found = unacked_without_outcome(self._open_count, self._open_sample, c)
        if found is not None:
            self.report.add(found)
        after_s = self.options.stuck_after_s
        for anomaly in stuck(
            self._first_open, c, self.stream.now, 3 * c.ack_wait_s if after_s is None else after_s
        ):
            self.report.add(anomaly)

    # -- NATS --

    async def _api(self, subject: str) -> dict[str, Any]:
        with _nats_edge(f"cannot reach JetStream ({subject})"):
            reply = await self.nc.request(f"$JS.API.{subject}", b"", timeout=5)
        info: dict[str, Any] = json.loads(reply.data)
        return info

    async def _stream(self) -> Stream:
        info = await self._api(f"STREAM.INFO.{self.spec.stream}")
        if "error" in info:
            raise errors.ConfigurationError(
                f"cannot read stream {self.spec.stream!r}: {info['error'].get('description')}"
            )
        state, config = info.get("state", {}), info.get("config", {})
        return Stream(
            name=self.spec.stream,
            epoch=jetstream.epoch_from_info(info),
            first_seq=int(state.get("first_seq", 0)),
            last_seq=int(state.get("last_seq", 0)),
            now=jetstream.parse_time(info["ts"])
            if "ts" in info
            else datetime.datetime.now(datetime.timezone.utc),
            interior_removal=config.get("retention", "limits") != "limits"
            or int(config.get("max_msgs_per_subject") or -1) > 0,
        )

    async def _consumer(self) -> Consumer:
        info = await self._api(f"CONSUMER.INFO.{self.spec.stream}.{self.spec.durable}")
        if "error" in info:
            self.report.notes.append(
                f"consumer {self.spec.durable!r} not found ({info['error'].get('description')}): "
                "no ack floor, so nothing can be shown acked without an outcome"
            )
            return Consumer(exists=False, filters=(self.spec.subject,))
        return _consumer_from_info(info, self.report.notes)

    async def _walk(self, start: int, end: int) -> AsyncGenerator[list[Walked], None]:
        """The consumer's messages from ``start`` to ``end``, in batches, by a throwaway consumer.

        An ordered, unacknowledged consumer with the durable's filters: the
        server skips deleted messages and other subjects for us.
        """
        if start > end:
            return
        name = f"eop-audit-{uuid.uuid4().hex[:12]}"
        filters = list(self.consumer.filters)
        config = api.ConsumerConfig(
            name=name,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_policy=api.AckPolicy.NONE,
            headers_only=self.headers_only or None,
            mem_storage=True,
            # The server removes it by itself should the audit die.
            inactive_threshold=60.0,
            filter_subject=filters[0] if len(filters) == 1 else None,
            filter_subjects=filters if len(filters) > 1 else None,
        )
        with _nats_edge("cannot create the audit's consumer"):
            info = await self.js.add_consumer(self.stream.name, config)
        try:
            if info.num_pending == 0:
                return
            psub = await self.js.pull_subscribe_bind(consumer=name, stream=self.stream.name)
            try:
                async for batch in self._fetch(psub, end):
                    yield batch
            finally:
                with contextlib.suppress(*_NATS_ERRORS):
                    await psub.unsubscribe()
        finally:
            with contextlib.suppress(*_NATS_ERRORS):
                await self.js.delete_consumer(self.stream.name, name)

    async def _fetch(self, psub: Any, end: int) -> AsyncIterator[list[Walked]]:
        remaining = self.options.limit
        while remaining is None or remaining > 0:
            want = self.options.batch if remaining is None else min(self.options.batch, remaining)
            try:
                with _nats_edge("the audit's fetch failed"):
                    msgs = await psub.fetch(want, timeout=5)
            except errors.NatsUnavailable as exc:
                if isinstance(exc.__cause__, (nats.errors.TimeoutError, asyncio.TimeoutError)):
                    return
                raise
            batch, done = self._batch(msgs, end)
            if batch:
                yield batch
            if done or not msgs:
                return
            if remaining is not None:
                remaining -= len(batch)
        self.report.truncated = True

    def _batch(self, msgs: list[Any], end: int) -> tuple[list[Walked], bool]:
        batch: list[Walked] = []
        for m in msgs:
            meta = m.metadata
            seq = int(meta.sequence.stream)
            if seq > end:
                return batch, True
            headers = m.headers or {}
            batch.append(
                Walked(
                    seq=seq,
                    subject=m.subject,
                    msg_id=headers.get(message.MSG_ID_HEADER),
                    stored_at=meta.timestamp,
                    fingerprint=None
                    if self.headers_only
                    else fingerprint(m.subject, headers, m.data),
                )
            )
            if seq >= end or meta.num_pending == 0:
                return batch, True
        return batch, False

    async def _get_many(self, seqs: Iterable[int]) -> dict[int, Walked | None]:
        """The stream's messages at ``seqs`` (None where it holds none), fetched concurrently."""
        gate = asyncio.Semaphore(_GETS_IN_FLIGHT)

        async def get(seq: int) -> tuple[int, Walked | None]:
            async with gate:
                try:
                    with _nats_edge(f"cannot read sequence {seq}"):
                        raw = await self.js.get_msg(self.stream.name, seq)
                except errors.NatsUnavailable as exc:
                    if isinstance(exc.__cause__, nats.js.errors.NotFoundError):
                        return seq, None
                    raise
            headers = raw.headers or {}
            subject = str(raw.subject)
            return seq, Walked(
                seq=seq,
                subject=subject,
                msg_id=headers.get(message.MSG_ID_HEADER),
                fingerprint=fingerprint(subject, headers, raw.data),
            )

        return dict(await asyncio.gather(*(get(seq) for seq in sorted(set(seqs)))))

    # -- PostgreSQL --

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[Any]:
        try:
            async with self.app.sessionmaker() as session:
                yield session
        except Exception as exc:
            if isinstance(exc, OSError) or inbox.classify(exc) is inbox.DbFailure.CONNECTION:
                raise errors.DatabaseUnavailable(
                    f"PostgreSQL failed during the audit: {exc}"
                ) from exc
            raise

    async def _sparse(self, start: int, end: int) -> bool:
        """Few rows to verify in the range: walk headers only, fetch the few payloads."""
        if start > end:
            return True
        stmt = sql.audit_count_inbox(
            self.tables, self.spec.name, self.spec.stream, self.stream.epoch, start, end
        )
        async with self._session() as session:
            rows = int((await session.execute(stmt)).scalar_one())
        return rows < _DENSE_ROWS * (end - start + 1)

    async def _recorded(
        self, session: Any, epoch: str, lo: int, hi: int | None, limit: int | None = None
    ) -> tuple[list[Recorded], list[Recorded]]:
        """Inbox rows and dead letters of one epoch in ``lo..hi``."""
        t, name, stream = self.tables, self.spec.name, self.spec.stream
        rows = await session.execute(sql.audit_inbox_rows(t, name, stream, epoch, lo, hi, limit))
        inbox_rows = [Recorded(int(r[0]), bytes(r[1]), str(r[3])) for r in rows]
        rows = await session.execute(sql.audit_dead_letters(t, name, stream, epoch, lo, hi, limit))
        dead = [Recorded(int(r[0]), bytes(r[1]), "dead_letter", f"#{r[2]} ({r[3]})") for r in rows]
        return inbox_rows, dead

    async def _segment(self, lo: int, hi: int, batch: list[Walked]) -> None:
        """Check one walked batch against the rows of its whole sequence range."""
        epoch = self.stream.epoch
        async with self._session() as session:
            rows, dead = await self._recorded(session, epoch, lo, hi)
            by_seq = {r.seq: r for r in rows}
            dead_by_seq: dict[int, list[Recorded]] = {}
            for d in dead:
                dead_by_seq.setdefault(d.seq, []).append(d)
            by_msg_id = await self._by_msg_id(session, batch, by_seq, dead_by_seq)
            # Read last: compaction raises the watermark before it deletes rows, so
            # a row missing above was covered by the watermark read here.
            watermark = await self._watermark(session)
        self.report.watermark = max(self.report.watermark, watermark)
        batch = await self._with_fingerprints(batch, set(by_seq) | set(dead_by_seq))
        pos = Position(watermark=watermark, ack_floor=self.consumer.ack_floor)
        for m in batch:
            row, at = by_seq.get(m.seq), dead_by_seq.get(m.seq, [])
            self._tally(m, *classify(m, row, at, by_msg_id.get(m.msg_id or ""), pos), pos)
        walked = {m.seq for m in batch}
        await self._unseen([r for r in [*rows, *dead] if r.seq not in walked], self.stream)

    async def _with_fingerprints(self, batch: list[Walked], recorded: set[int]) -> list[Walked]:
        need = [m.seq for m in batch if m.fingerprint is None and m.seq in recorded]
        if not need:
            return batch
        fetched = await self._get_many(need)
        out = []
        for m in batch:
            if m.seq in fetched:
                now = fetched[m.seq]
                if now is None:  # deleted since the walk saw it: its rows are unseen
                    continue
                m = dataclasses.replace(m, fingerprint=now.fingerprint)
            out.append(m)
        return out

    async def _by_msg_id(
        self,
        session: Any,
        batch: list[Walked],
        by_seq: Mapping[int, Recorded],
        dead_by_seq: Mapping[int, list[Recorded]],
    ) -> dict[str, str]:
        """Where the msg-ids of the batch's messages without a row have their outcome."""
        if not self.spec.msg_id_guard:
            return {}
        ids = [
            m.msg_id for m in batch if m.msg_id and m.seq not in by_seq and m.seq not in dead_by_seq
        ]
        if not ids:
            return {}
        rows = await session.execute(sql.audit_by_msg_ids(self.tables, self.spec.name, ids))
        return {str(r[0]): f"stream {r[1]} sequence {r[3]} (epoch {r[2]}, {r[4]})" for r in rows}

    async def _watermark(self, session: Any, epoch: str | None = None) -> int:
        stmt = sql.watermark(
            self.tables, self.spec.name, self.spec.stream, epoch or self.stream.epoch
        )
        value = (await session.execute(stmt)).scalar()
        return int(value or 0)

    def _tally(self, m: Walked, verdict: Verdict, detail: str, pos: Position) -> None:
        r = self.report
        r.checked += 1
        if m.seq > self.consumer.ack_floor and self._first_open is None:
            self._first_open = m
        counter = _COUNTERS.get(verdict)
        if counter is None:
            r.add(Anomaly(verdict.value, m.seq, self.stream.epoch, detail))
            return
        setattr(r, counter, getattr(r, counter) + 1)
        if verdict in (Verdict.OUTCOME, Verdict.DEAD_LETTER) and m.seq <= pos.watermark:
            r.verified_below_watermark += 1
        if verdict is Verdict.UNSETTLED and m.seq <= self.consumer.delivered:
            self._open_count += 1
            if len(self._open_sample) < 20:
                self._open_sample.append(m.seq)

    async def _unseen(self, recorded: list[Recorded], stream: Stream) -> None:
        """Outcomes of the current epoch at sequences the walk did not deliver."""
        if not recorded:
            return
        held = [r.seq for r in recorded if stream.first_seq <= r.seq <= self.audit_to]
        occupants = await self._get_many(held)
        for rec in recorded:
            kind, label = classify_unseen(rec, occupants.get(rec.seq), stream, self.audit_to)
            if kind is not None:
                what = "inbox row" if rec.outcome != "dead_letter" else f"dead letter {rec.ref}"
                self.report.add(Anomaly(kind, rec.seq, stream.epoch, f"{what}: {label}"))
            elif label == "removed":
                self.report.removed_with_outcome += 1
            elif label == "outside_filter":
                self.report.outside_filter += 1

    async def _pages(self, epoch: str, lo: int) -> AsyncIterator[list[Recorded]]:
        """Rows and dead letters of one epoch from ``lo`` (to ``--to-seq``), page by page."""
        page_size, hi = self.options.batch, self.options.to_seq
        for which in (0, 1):
            cursor = lo
            while True:
                async with self._session() as session:
                    page = (await self._recorded(session, epoch, cursor, hi, page_size))[which]
                if len(page) < page_size:
                    if page:
                        yield page
                    break
                # Dead letters may share a sequence: never split one across pages.
                last = page[-1].seq
                whole = [r for r in page if r.seq < last] or page
                yield whole
                cursor = last if len(whole) < len(page) else last + 1

    async def _tail(self, lo: int) -> None:
        """Rows of the current epoch after the last walked message."""
        async for page in self._pages(self.stream.epoch, lo):
            # Read after the rows: a row's message was stored before its row.
            fresh = await self._stream()
            await self._unseen(page, dataclasses.replace(fresh, epoch=self.stream.epoch))

    async def _old_epochs(self, lo: int) -> None:
        """Outcomes recorded for earlier incarnations of the stream."""
        stmt = sql.audit_epochs(self.tables, self.spec.name, self.spec.stream)
        async with self._session() as session:
            epochs = sorted(str(e) for (e,) in await session.execute(stmt))
        s = self.stream
        for epoch in (e for e in epochs if e != s.epoch):
            async for page in self._pages(epoch, lo):
                occupants = await self._get_many(
                    r.seq for r in page if s.first_seq <= r.seq <= s.last_seq
                )
                for rec in page:
                    self.report.add(classify_old_epoch(rec, epoch, occupants.get(rec.seq), s.epoch))


_COUNTERS = {
    Verdict.OUTCOME: "outcomes",
    Verdict.DEAD_LETTER: "dead_letters",
    Verdict.DUPLICATE: "duplicates",
    Verdict.COMPACTED: "compacted",
    Verdict.UNSETTLED: "unsettled",
}


def _consumer_from_info(info: Mapping[str, Any], notes: list[str]) -> Consumer:
    config = info.get("config", {})
    filters = tuple(config.get("filter_subjects") or ()) or (
        (config["filter_subject"],) if config.get("filter_subject") else ()
    )
    floor, delivered = info.get("ack_floor", {}), info.get("delivered", {})
    policy = str(config.get("deliver_policy", "all"))
    start = int(config.get("opt_start_seq") or 1) if policy == "by_start_sequence" else 1
    if policy not in ("all", "by_start_sequence"):
        notes.append(
            f"the consumer's deliver policy is {policy!r}: messages before its first delivery "
            "were never meant for it and would show as acked without an outcome; "
            "pass --from-seq to start after them"
        )
    return Consumer(
        exists=True,
        filters=filters,
        ack_floor=int(floor.get("stream_seq", 0)),
        ack_floor_at=_time(floor.get("last_active")),
        delivered=int(delivered.get("stream_seq", 0)),
        ack_pending=int(info.get("num_ack_pending", 0)),
        redelivered=int(info.get("num_redelivered", 0)),
        max_ack_pending=int(config.get("max_ack_pending") or 0),
        ack_wait_s=int(config.get("ack_wait") or 30_000_000_000) / 1e9,
        created_at=_time(info.get("created")),
        start_seq=start,
        deliver_policy=policy,
    )


def _time(text: str | None) -> datetime.datetime | None:
    if not text or text.startswith("0001-"):
        return None
    return jetstream.parse_time(text)


# --- the report for people -------------------------------------------------------------

_WATERMARK_NOTE = (
    "Below the watermark eop deleted the inbox rows once the consumer's ack floor passed "
    "them (eop acks only after the outcome committed): there the audit shows that the "
    "consumer acked every message and that no retained row or dead letter belongs to "
    "another message, and verifies the rows kept for msg_id_retention_s; it cannot show "
    "each compacted message's outcome."
)


def render(report: Report) -> str:
    """The report as text: a summary per handler, then its anomalies."""
    lines: list[str] = []
    for h in report.handlers:
        lines.extend(_render_handler(h))
        lines.append("")
    total = sum(sum(h.counts.values()) for h in report.handlers)
    lines.append(_WATERMARK_NOTE)
    lines.append(
        "result: clean, every message checked has exactly one outcome or is still in flight"
        if report.clean
        else f"result: {total} anomal{'y' if total == 1 else 'ies'}"
    )
    return "\n".join(lines)


def _render_handler(h: HandlerAudit) -> list[str]:
    walked = f"{h.range_from}..{h.range_to}" if h.range_to >= h.range_from else "nothing"
    if h.truncated:
        walked += f" (stopped at --limit; go on with --from-seq {h.next_seq})"
    lines = [
        f"handler {h.handler}: stream {h.stream} (epoch {h.epoch}), consumer {h.durable}, "
        f"filter {', '.join(h.filters) or '(all subjects)'}",
        f"  range walked      {walked}; the stream holds {h.stream_first_seq}..{h.stream_last_seq}",
        f"  messages checked  {h.checked}",
        f"  outcomes found    {h.outcomes} processed, {h.dead_letters} dead-lettered, "
        f"{h.duplicates} duplicates of an earlier msg-id",
        f"  dead letters      {h.dead_letters}",
        f"  compacted         {h.compacted} at or below the watermark {h.watermark} "
        f"({h.verified_below_watermark} more there verified by retained rows)",
        f"  in flight         {h.unsettled} above the ack floor without an outcome yet",
        f"  consumer          ack floor {h.ack_floor}, delivered {h.delivered}, "
        f"ack pending {h.ack_pending}, redelivered {h.redelivered}",
        f"  other outcomes    {h.removed_with_outcome} of messages removed by retention, "
        f"{h.outside_filter} of messages outside the consumer's filter or start",
    ]
    lines.extend(f"  note: {note}" for note in h.notes)
    if h.clean:
        lines.append("  anomalies         none")
        return lines
    counts = ", ".join(f"{h.counts[k]} {k}" for k in KINDS if h.counts.get(k))
    lines.append(f"  anomalies         {counts}")
    for a in h.anomalies:
        where = f"seq {a.seq}" if a.seq is not None else "consumer"
        epoch = f" (epoch {a.epoch})" if a.epoch and a.epoch != h.epoch else ""
        lines.append(f"    {a.kind}  {where}{epoch}: {a.detail}")
    hidden = sum(h.counts.values()) - len(h.anomalies)
    if hidden:
        lines.append(f"    ... and {hidden} more (see --json for the counts)")
    return lines
