"""What the outbox relays sent: every outbox row against the messages its stream holds.

After a run, every row must be published (none pending, none parked: a good
message parked by the infrastructure counts as lost), its msg-id must be in
the stream its mark names, at the sequence the mark records, and no logical
message may have two rows for one subject (its transaction committed twice).

A relay that died between publishing and marking sends its rows again. Inside
the stream's duplicate window the server drops the copy; after it, the stream
stores the message a second time and the consuming handler's msg-id guard
must skip it. Those copies are counted (:attr:`Verdict.copies`), and each must
be absorbed: its logical message has exactly one effect in every handler that
consumes the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Mapping, Sequence

import nats.errors
import sqlalchemy as sa
from nats.js import JetStreamContext, api

from eop.message import MSG_ID_HEADER

_ROWS_SQL = (
    "SELECT id, msg_id, subject, headers, published_at IS NOT NULL, park_reason,"
    " parked_at IS NOT NULL, stream, stream_seq FROM {schema}.outbox ORDER BY id"
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One outbox row, without its payload."""

    id: int
    msg_id: str
    subject: str
    key: str | None
    """The logical message's key (its ``key_header``), if it has one."""
    published: bool
    parked: str | None
    """Its park reason, if it is parked."""
    stream: str | None
    stream_seq: int | None


@dataclasses.dataclass(frozen=True)
class Stored:
    """One message of a stream: its sequence and msg-id."""

    seq: int
    msg_id: str | None


@dataclasses.dataclass
class Verdict:
    """The outbox after a run, against the streams its rows were published to."""

    rows: int = 0
    published: int = 0
    parked: list[str] = dataclasses.field(default_factory=list)
    pending: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    """Published rows whose msg-id is not in their stream."""
    misplaced: list[str] = dataclasses.field(default_factory=list)
    """Rows whose marked stream sequence holds another message."""
    doubled: list[str] = dataclasses.field(default_factory=list)
    """Logical messages with two rows for one subject."""
    stored: dict[str, int] = dataclasses.field(default_factory=dict)
    """Messages in each stream the rows went to."""
    copies: dict[str, int] = dataclasses.field(default_factory=dict)
    """msg-id -> copies stored, for the rows' messages stored more than once."""
    copied_in: dict[str, int] = dataclasses.field(default_factory=dict)
    """Stream -> how many of the rows' messages it stores more than once."""
    not_absorbed: list[str] = dataclasses.field(default_factory=list)
    """Copied messages without exactly one effect in a handler of their stream."""
    absorbed: int = 0
    """Copied messages with exactly one effect in every handler of their stream."""

    @property
    def extra_copies(self) -> int:
        """Copies beyond the first, in all."""
        return sum(n - 1 for n in self.copies.values())

    @property
    def problems(self) -> list[str]:
        """Every way the outbox failed (empty: every row went out, and no copy took effect)."""
        found = [f"outbox row parked: {item}" for item in self.parked]
        found += [f"outbox row never published: {item}" for item in self.pending]
        found += [f"outbox row's message not in its stream: {item}" for item in self.missing]
        found += [f"outbox row marked with another message's sequence: {m}" for m in self.misplaced]
        found += [f"two outbox rows for one message: {item}" for item in self.doubled]
        found += [f"a copy sent again took effect: {item}" for item in self.not_absorbed]
        return found

    def to_dict(self) -> dict[str, object]:
        """A JSON-able summary."""
        return {
            "rows": self.rows,
            "published": self.published,
            "parked": len(self.parked),
            "pending": len(self.pending),
            "missing": len(self.missing),
            "misplaced": len(self.misplaced),
            "doubled": len(self.doubled),
            "stored": self.stored,
            "messages_stored_twice_or_more": len(self.copies),
            "stored_twice_or_more_by_stream": self.copied_in,
            "extra_copies": self.extra_copies,
            "absorbed": self.absorbed,
            "not_absorbed": len(self.not_absorbed),
        }


def read_rows(conn: sa.Connection, key_header: str | None, schema: str = "eop") -> list[Row]:
    """Every outbox row (the run keeps published ones: ``EOP_OUTBOX_KEEP_S``)."""
    rows = []
    for r in conn.execute(sa.text(_ROWS_SQL.format(schema=f'"{schema}"'))):
        headers = json.loads(bytes(r[3])) if r[3] is not None else {}
        key = headers.get(key_header) if key_header else None
        rows.append(
            Row(
                id=int(r[0]),
                msg_id=str(r[1]),
                subject=str(r[2]),
                key=None if key is None else str(key),
                published=bool(r[4]),
                parked=str(r[5]) if r[6] else None,
                stream=None if r[7] is None else str(r[7]),
                stream_seq=None if r[8] is None else int(r[8]),
            )
        )
    return rows


async def read_stream(js: JetStreamContext, stream: str, timeout_s: float = 5.0) -> list[Stored]:
    """Every message of ``stream`` (sequence and msg-id), read by an ordered consumer."""
    info = await js.stream_info(stream)
    last = info.state.last_seq
    if info.state.messages == 0:
        return []
    subjects = list(info.config.subjects or [])
    config = api.ConsumerConfig(filter_subjects=subjects) if len(subjects) > 1 else None
    sub = await js.subscribe(
        subjects[0] if subjects else ">", stream=stream, ordered_consumer=True, config=config
    )
    found: list[Stored] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=timeout_s)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                break  # nothing more is coming: the check names what is missing
            seq = msg.metadata.sequence.stream
            found.append(Stored(seq, (msg.headers or {}).get(MSG_ID_HEADER)))
            if seq >= last:
                break
    finally:
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await sub.unsubscribe()
    return found


def check(
    rows: Sequence[Row],
    streams: Mapping[str, Sequence[Stored]],
    effects: Mapping[str, Sequence[Mapping[str, int]]],
) -> Verdict:
    """Judge the outbox: ``streams`` holds every message of the streams the rows went to,
    ``effects`` the effects per key of each handler consuming a stream, by stream."""
    v = Verdict(rows=len(rows), stored={name: len(msgs) for name, msgs in streams.items()})
    by_seq = {(name, m.seq): m.msg_id for name, msgs in streams.items() for m in msgs}
    counts: dict[tuple[str, str], int] = {}
    for name, msgs in streams.items():
        for m in msgs:
            if m.msg_id is not None:
                counts[(name, m.msg_id)] = counts.get((name, m.msg_id), 0) + 1
    seen: dict[tuple[str, str], int] = {}
    for row in rows:
        if row.key is not None:
            first = seen.setdefault((row.key, row.subject), row.id)
            if first != row.id:
                v.doubled.append(f"key {row.key} to {row.subject}: rows {first} and {row.id}")
        _judge(v, row, counts, by_seq, effects)
    return v


def _judge(
    v: Verdict,
    row: Row,
    counts: Mapping[tuple[str, str], int],
    by_seq: Mapping[tuple[str, int], str | None],
    effects: Mapping[str, Sequence[Mapping[str, int]]],
) -> None:
    """One row's verdict: published, in its stream at its sequence, any copy absorbed."""
    label = f"id {row.id} ({row.subject}, key {row.key})"
    if row.parked is not None:
        v.parked.append(f"{label}: {row.parked}")
        return
    if not row.published or row.stream is None:
        v.pending.append(label)
        return
    v.published += 1
    copies = counts.get((row.stream, row.msg_id), 0)
    if copies == 0:
        v.missing.append(f"{label} in {row.stream}")
        return
    if by_seq.get((row.stream, row.stream_seq or 0)) != row.msg_id:
        v.misplaced.append(f"{label}: {row.stream} #{row.stream_seq}")
    if copies > 1:
        v.copies[row.msg_id] = copies
        v.copied_in[row.stream] = v.copied_in.get(row.stream, 0) + 1
        counted = [e.get(row.key or "", 0) for e in effects.get(row.stream, ())]
        if all(n == 1 for n in counted):
            v.absorbed += 1
        else:
            v.not_absorbed.append(f"{label}: stored {copies} times, effects {counted}")
