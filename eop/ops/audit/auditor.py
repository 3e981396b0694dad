"""Running the audit: each handler's stream walked beside its recorded outcomes.

Per handler, the consumer is read first (its ack floor bounds what the inbox
must hold), then the stream is walked in batches; each batch is checked
against the rows and dead letters of its whole sequence range, and the rows
the walk did not meet (after its end, of earlier epochs) are checked by the
messages the stream holds at their sequences.

An ordered handler's partitions each have their consumer: a message is
judged by its partition's ack floor and delivered sequence, and the
unacknowledged and stuck checks run per partition.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping

from nats.aio.client import Client as NATS
from sqlalchemy.ext.asyncio import AsyncSession

from eop import errors
from eop.app import App, select_handlers
from eop.broker import jetstream
from eop.handler import HandlerSpec
from eop.ops.audit import rules
from eop.ops.audit.outcomes import Outcomes, Recorded
from eop.ops.audit.report import HandlerAudit, PartitionConsumer, Report
from eop.ops.audit.rules import Anomaly, Position, Verdict
from eop.ops.audit.walk import Consumer, Stream, Walked, Walker, combined
from eop.pg import migrate

#: Walk with full payloads when at least this share of the range has inbox rows to verify.
_DENSE_ROWS = 0.25

#: The verdicts that settle a message (neither in flight nor never delivered).
_SETTLED = (Verdict.OUTCOME, Verdict.DEAD_LETTER)


@dataclasses.dataclass(frozen=True)
class Options:
    """What to audit and how."""

    from_seq: int | None = None
    to_seq: int | None = None
    limit: int | None = None
    """Stop after checking this many messages (the report names where to go on)."""
    batch: int = 500
    stuck_after_s: float | None = None
    """A delivery unacked for longer is stuck (default: ``stuck_after_ack_waits``, 3,
    AckWaits of the consumer)."""
    current_epoch_only: bool = False
    """Ignore outcomes recorded for earlier incarnations of the stream."""


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
            with contextlib.suppress(*jetstream.NATS_ERRORS):
                await nc.close()
    finally:
        await app.dispose()
    return Report(audits)


class _Auditor:
    """The audit of one handler."""

    def __init__(self, nc: NATS, app: App, spec: HandlerSpec, options: Options) -> None:
        self.spec, self.options, self.settings = spec, options, app.settings
        self.walker = Walker(nc, spec)
        self.outcomes = Outcomes(app, spec)
        self.report = HandlerAudit(handler=spec.name, stream=spec.stream, durable=spec.durable)
        self.by_partition: dict[int, Consumer] = {}
        """An ordered handler's consumer of each partition (empty for another handler)."""
        # Per partition (None for a handler without partitions): delivered messages
        # without an outcome, a sample of them, and the first one above the ack floor.
        self._open_count: Counter[int | None] = Counter()
        self._open_sample: dict[int | None, list[int]] = {}
        self._first_open: dict[int | None, Walked] = {}

    async def run(self) -> HandlerAudit:
        """Read the consumer first (its ack floor bounds what the inbox must hold), then walk."""
        self.stream = await self.walker.stream()
        # Before the consumers: a recorded wait holds if their floors did not move since.
        self.observed = await self.outcomes.observed_floors()
        await self._read_consumers()
        r, s, c = self.report, self.stream, self.consumer
        r.epoch, r.filters = s.epoch, list(c.filters)
        r.stream_first_seq, r.stream_last_seq = s.first_seq, s.last_seq
        r.ack_floor, r.delivered, r.consumer_pending = c.ack_floor, c.delivered, c.pending
        r.ack_pending, r.redelivered = c.ack_pending, c.redelivered
        lo = max(self.options.from_seq or 1, 1)
        self.audit_to = min(self.options.to_seq or s.last_seq, s.last_seq)
        start = max(lo, s.first_seq, c.start_seq)
        r.range_from, r.range_to = lo, self.audit_to
        walk = self.walker.walk(
            start,
            self.audit_to,
            c.filters,
            headers_only=await self._sparse(start, self.audit_to),
            batch=self.options.batch,
            limit=self.options.limit,
        )
        segment_lo = lo
        async with contextlib.aclosing(walk) as batches:
            async for batch in batches:
                await self._segment(segment_lo, batch[-1].seq, batch)
                segment_lo = batch[-1].seq + 1
        r.truncated = self.walker.truncated
        if r.truncated:
            r.range_to, r.next_seq = segment_lo - 1, segment_lo
        else:
            await self._tail(segment_lo)
        if not self.options.current_epoch_only:
            await self._old_epochs(lo)
        self._finish()
        if (await self.walker.stream()).epoch != s.epoch:
            raise errors.EopError(f"stream {s.name!r} was recreated during the audit: run it again")
        return r

    async def _read_consumers(self) -> None:
        """The handler's consumer, or an ordered handler's partition consumers (and them
        combined, for the report)."""
        notes = self.report.notes
        if self.spec.order_by is None:
            self.consumer = await self.walker.consumer(notes)
            return
        names = await self.outcomes.partition_consumers()
        self.by_partition = await self.walker.partition_consumers(names, notes)
        self.consumer = combined(self.by_partition)
        self.report.durable = f"{self.spec.durable}-p*-e*"
        self.report.partitions = [
            PartitionConsumer(
                partition=p,
                consumer=names.get(p) if c.exists else None,
                ack_floor=c.ack_floor,
                delivered=c.delivered,
                pending=c.pending,
                ack_pending=c.ack_pending,
                redelivered=c.redelivered,
            )
            for p, c in sorted(self.by_partition.items())
        ]

    def _consumer_of(self, m: Walked) -> Consumer:
        """The consumer whose ack floor ``m`` stands under."""
        if m.partition is None:
            return self.consumer
        return self.by_partition.get(m.partition, self.consumer)

    def _finish(self) -> None:
        groups: dict[int | None, Consumer] = {p: c for p, c in self.by_partition.items()}
        if not groups:
            groups[None] = self.consumer
        after_s, multiple = self.options.stuck_after_s, self.settings.stuck_after_ack_waits
        for key, c in groups.items():
            found = rules.unacked_without_outcome(
                self._open_count[key], self._open_sample.get(key, []), c
            )
            anomalies = [found] if found is not None else []
            observed = self.observed.get(c.name)
            if observed is None and c.exists and c.ack_pending:
                self.report.notes.append(
                    f"consumer {c.name!r}: no worker has recorded its ack floor yet, so how "
                    "long its unacknowledged deliveries have waited is not known"
                )
            anomalies += rules.stuck(
                self._first_open.get(key),
                c,
                observed,
                multiple * c.ack_wait_s if after_s is None else after_s,
            )
            for anomaly in anomalies:
                if key is not None:
                    detail = f"partition {key}: {anomaly.detail}"
                    anomaly = dataclasses.replace(anomaly, detail=detail)
                self.report.add(anomaly)

    async def _sparse(self, start: int, end: int) -> bool:
        """Few rows to verify in the range: walk headers only, fetch the few payloads."""
        if start > end:
            return True
        rows = await self.outcomes.count(self.stream.epoch, start, end)
        return rows < _DENSE_ROWS * (end - start + 1)

    async def _segment(self, lo: int, hi: int, batch: list[Walked]) -> None:
        """Check one walked batch against the rows of its whole sequence range."""
        epoch = self.stream.epoch
        async with self.outcomes.session() as session:
            rows, dead = await self.outcomes.recorded(session, epoch, lo, hi)
            by_seq = {r.seq: r for r in rows}
            dead_by_seq: dict[int, list[Recorded]] = {}
            for d in dead:
                dead_by_seq.setdefault(d.seq, []).append(d)
            by_msg_id = await self._by_msg_id(session, batch, by_seq, dead_by_seq)
            # Read last: compaction raises the watermark before it deletes rows, so
            # a row missing above was covered by the watermark read here.
            watermark = await self.outcomes.watermark(session, epoch)
        self.report.watermark = max(self.report.watermark, watermark)
        batch = await self._with_fingerprints(batch, set(by_seq) | set(dead_by_seq))
        for m in batch:
            c = self._consumer_of(m)
            pos = Position(watermark=watermark, ack_floor=c.ack_floor, delivered=c.delivered)
            row, at = by_seq.get(m.seq), dead_by_seq.get(m.seq, [])
            verdict, detail = rules.classify(m, row, at, by_msg_id.get(m.msg_id or ""), pos)
            self._tally(m, verdict, detail, pos, at)
        walked = {m.seq for m in batch}
        await self._unseen([r for r in [*rows, *dead] if r.seq not in walked], self.stream)

    async def _with_fingerprints(self, batch: list[Walked], recorded: set[int]) -> list[Walked]:
        need = [m.seq for m in batch if m.fingerprint is None and m.seq in recorded]
        if not need:
            return batch
        fetched = await self.walker.get_many(need)
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
        session: AsyncSession,
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
        return await self.outcomes.by_msg_id(session, ids)

    def _tally(
        self, m: Walked, verdict: Verdict, detail: str, pos: Position, dead: list[Recorded]
    ) -> None:
        """Count one walked message in its class (or as an anomaly)."""
        r = self.report
        r.checked += 1
        key = m.partition if self.by_partition else None
        if m.seq > pos.ack_floor and key not in self._first_open:
            self._first_open[key] = m
        if verdict in _SETTLED and m.seq <= pos.watermark:
            r.verified_below_watermark += 1
        if verdict is Verdict.OUTCOME:
            r.processed.add(m.seq)
        elif verdict is Verdict.DEAD_LETTER:
            self._dead_lettered(m, dead)
        elif verdict is Verdict.DUPLICATE:
            r.duplicates += 1
        elif verdict is Verdict.COMPACTED:
            r.compacted += 1
        elif verdict is Verdict.HELD:
            r.tally(r.in_flight, detail, m.seq)
        elif verdict is Verdict.DELIVERED:
            r.tally(r.in_flight, rules.DELIVERED_NO_OUTCOME, m.seq)
            self._open_count[key] += 1
            sample = self._open_sample.setdefault(key, [])
            if len(sample) < 20:
                sample.append(m.seq)
        elif verdict is Verdict.NEVER_DELIVERED:
            r.never_delivered.add(m.seq)
        else:
            r.add(Anomaly(verdict.value, m.seq, self.stream.epoch, detail))

    def _dead_lettered(self, m: Walked, own: list[Recorded]) -> None:
        """A dead-lettered message: by rule, or an anomaly when no rule explains it.

        ``own`` are its dead letters: :func:`rules.classify` calls a message
        with another message's dead letter a reused sequence instead.
        """
        r = self.report
        reason, not_a_rule = rules.dead_letter_reason(own)
        if reason is None:
            r.dead_lettered_purged.add(m.seq)
        elif not_a_rule:
            r.tally(r.dead_lettered_other, reason, m.seq)
            r.add(Anomaly(rules.DEAD_LETTER_NOT_BY_RULE, m.seq, self.stream.epoch, not_a_rule))
        else:
            r.tally(r.dead_lettered_by_rule, reason, m.seq)

    async def _unseen(self, recorded: list[Recorded], stream: Stream) -> None:
        """Outcomes of the current epoch at sequences the walk did not deliver."""
        if not recorded:
            return
        held = [r.seq for r in recorded if stream.first_seq <= r.seq <= self.audit_to]
        occupants = await self.walker.get_many(held)
        for rec in recorded:
            kind, label = rules.classify_unseen(rec, occupants.get(rec.seq), stream, self.audit_to)
            if kind is not None:
                what = "inbox row" if rec.outcome != "dead_letter" else f"dead letter {rec.ref}"
                self.report.add(Anomaly(kind, rec.seq, stream.epoch, f"{what}: {label}"))
            elif label == "removed":
                self.report.removed_with_outcome += 1
            elif label == "outside_filter":
                self.report.outside_filter += 1

    def _pages(self, epoch: str, lo: int) -> AsyncIterator[list[Recorded]]:
        """Rows and dead letters of one epoch from ``lo`` (to ``--to-seq``), page by page."""
        return self.outcomes.pages(epoch, lo, self.options.to_seq, self.options.batch)

    async def _tail(self, lo: int) -> None:
        """Rows of the current epoch after the last walked message."""
        async for page in self._pages(self.stream.epoch, lo):
            # Read after the rows: a row's message was stored before its row.
            fresh = await self.walker.stream()
            await self._unseen(page, dataclasses.replace(fresh, epoch=self.stream.epoch))

    async def _old_epochs(self, lo: int) -> None:
        """Outcomes recorded for earlier incarnations of the stream."""
        s = self.stream
        found = 0
        for epoch in (e for e in await self.outcomes.epochs() if e != s.epoch):
            async for page in self._pages(epoch, lo):
                occupants = await self.walker.get_many(
                    r.seq for r in page if s.first_seq <= r.seq <= s.last_seq
                )
                for rec in page:
                    found += 1
                    self.report.add(
                        rules.classify_old_epoch(rec, epoch, occupants.get(rec.seq), s.epoch)
                    )
        if found:
            self.report.notes.append(
                f"{found} of the anomalies are outcomes recorded for earlier incarnations of "
                "the stream (it was deleted and recreated): "
                "after a deliberate recreation, --current-epoch-only leaves them out, and "
                "compaction deletes most of their rows epoch_sweep_after_s after it"
            )
