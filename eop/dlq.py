"""Dead letters: list, show, replay and purge them (``eop dlq``).

A replay is safe to repeat. Each dead letter counts its replays in
``replay_generation``; the ``Nats-Msg-Id`` of a published replay is derived
from the dead letter and that generation (:func:`replay_msg_id`), and it is
committed *before* the publish, with ``replay_requested_at``. So:

- crash before that commit: nothing was published, the next run starts afresh;
- crash after it, before or after the publish: the next run finds the intent
  unfinished and resumes it with the *same* msg-id: it looks for that msg-id
  in the stream, and publishes only if it is not there (the server's duplicate
  window, then the handler's msg-id guard in the inbox, catch a publish the
  scan missed);
- finished (``replayed_at`` set): a second replay is a no-op and says so; only
  ``again=True`` starts a new generation, a new msg-id, a second effect.

A rerun (``--rerun``) runs the handler here, in one transaction with the
bookkeeping: the dead letter row is locked, its ``replayed_at`` and the
handler's writes commit together or not at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import nats.errors
import nats.js.errors
from nats.js import api

from eop import errors, inbox, jetstream, log, message, models, sql

if TYPE_CHECKING:
    from eop.app import App

ReplayMode = Literal["publish", "rerun"]

#: Header naming the dead letter a replayed message came from.
REPLAY_OF_HEADER = "Eop-Replay-Of"

#: How far before the recorded intent a resumed replay looks for its message:
#: the stream stamps messages with the NATS server's clock, the intent carries
#: PostgreSQL's.
SCAN_MARGIN = datetime.timedelta(minutes=5)

_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)([smhdw]))", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


# --- Filters -----------------------------------------------------------------


def parse_when(text: str, now: datetime.datetime | None = None) -> datetime.datetime:
    """A point in time from an ISO 8601 time (UTC if naive) or a duration ago (``2h``, ``1d12h``).

    Durations use the units s, m, h, d and w.
    """
    raw = text.strip()
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if raw and _DURATION.sub("", raw) == "":
        seconds = sum(float(n) * _UNIT_S[u.lower()] for n, u in _DURATION.findall(raw))
        return now - datetime.timedelta(seconds=seconds)
    try:
        # Python 3.10's fromisoformat does not take a trailing Z.
        when = datetime.datetime.fromisoformat(re.sub(r"[zZ]$", "+00:00", raw))
    except ValueError:
        raise errors.ConfigurationError(
            f"{text!r} is neither an ISO time (2026-01-31T12:00:00Z) nor a duration (2h, 30m, 7d)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when


@dataclasses.dataclass(frozen=True)
class Filters:
    """Which dead letters a command applies to (all given conditions hold)."""

    ids: tuple[int, ...] = ()
    handler: str | None = None
    reason: str | None = None
    """A case-insensitive substring of the reason or the error."""
    since: datetime.datetime | None = None
    until: datetime.datetime | None = None
    limit: int | None = None

    @property
    def empty(self) -> bool:
        """True when no condition narrows the selection (every dead letter matches)."""
        return not (self.ids or self.handler or self.reason or self.since or self.until)

    def where(self, tables: models.Tables) -> list[Any]:
        """The SQL conditions of these filters."""
        return sql.dead_letter_where(
            tables,
            ids=self.ids,
            handler=self.handler,
            reason=self.reason,
            since=self.since,
            until=self.until,
        )


# --- Reading -----------------------------------------------------------------


class DeadLetters:
    """The dead letters of an app's database (its ``database_url`` and ``schema``)."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.tables = models.tables(app.settings.schema)

    async def rows(self, filters: Filters) -> list[dict[str, Any]]:
        """The dead letters matching ``filters``, newest first, without payloads."""
        stmt = sql.select_dead_letters(self.tables, filters.where(self.tables), filters.limit)
        async with self.app.sessionmaker() as session:
            return [dict(row._mapping) for row in await session.execute(stmt)]

    async def get(self, dead_letter_id: int) -> dict[str, Any]:
        """One dead letter without its payload; :class:`eop.errors.DeadLetterNotFound` if none."""
        found = await self.rows(Filters(ids=(dead_letter_id,)))
        if not found:
            raise errors.DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
        return found[0]

    async def payload(self, dead_letter_id: int) -> bytes:
        """The stored payload of one dead letter."""
        async with self.app.sessionmaker() as session:
            value = (
                await session.execute(sql.dead_letter_payload(self.tables, dead_letter_id))
            ).scalar()
        if value is None:
            raise errors.DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
        return bytes(value)

    async def count(self, filters: Filters) -> int:
        """How many dead letters match ``filters``."""
        stmt = sql.count_dead_letters(self.tables, filters.where(self.tables))
        async with self.app.sessionmaker() as session:
            return int((await session.execute(stmt)).scalar_one())

    async def ids(self, filters: Filters) -> list[int]:
        """The ids matching ``filters``, oldest first, at most ``filters.limit``."""
        stmt = sql.dead_letter_ids(self.tables, filters.where(self.tables))
        if filters.limit is not None:
            stmt = stmt.limit(filters.limit)
        async with self.app.sessionmaker() as session:
            return [int(i) for (i,) in await session.execute(stmt)]

    async def purge(self, filters: Filters) -> int:
        """Delete the dead letters matching ``filters``; returns how many.

        Their inbox rows stay: they are the record that the message had its
        one outcome.
        """
        stmt = sql.purge_dead_letters(self.tables, filters.where(self.tables))
        async with self.app.sessionmaker() as session:
            deleted = len((await session.execute(stmt)).all())
            await session.commit()
        return deleted


# --- Replay ------------------------------------------------------------------


def replay_msg_id(row: Mapping[str, Any], generation: int) -> str:
    """The ``Nats-Msg-Id`` of replay ``generation`` of a dead letter: the same on every run.

    It names the subscription and the message's stream coordinates as well as
    the row id, so two databases (two eop schemas) replaying into one stream
    do not collide in its duplicate window.
    """
    return (
        f"eop-replay:{row['subscription']}:{row['stream']}:{row['stream_seq']}:"
        f"{row['id']}:{generation}"
    )


def replay_headers(
    stored: Mapping[str, str], dead_letter_id: int, msg_id: str
) -> tuple[dict[str, str], list[str]]:
    """The headers of a published replay, and the names of stored headers left out.

    NATS's own headers (``Nats-Msg-Id``, ``Nats-Expected-*``, ...) of the
    original publish are dropped: the replay gets its own msg-id, and the
    original's expectations would fail the publish. Headers stored redacted
    (``***``) are dropped too: their values were never kept.
    """
    headers: dict[str, str] = {}
    dropped: list[str] = []
    for name, value in stored.items():
        if name.lower().startswith("nats-") or value == log.REDACTED:
            dropped.append(name)
            continue
        headers[name] = value
    headers[message.MSG_ID_HEADER] = msg_id
    headers[REPLAY_OF_HEADER] = str(dead_letter_id)
    return headers, dropped


#: Kept here for callers of ``dlq.subject_matches``; NATS's rules live in :mod:`eop.jetstream`.
subject_matches = jetstream.subject_matches


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """What one replay did."""

    id: int
    status: Literal["published", "duplicate", "recovered", "rerun", "skipped", "failed"]
    """``published``: a new message; ``duplicate``: the server already had it
    (an earlier run crashed after publishing); ``recovered``: found in the
    stream, not published again; ``rerun``: the handler ran and committed;
    ``skipped``: replayed before, nothing done; ``failed``: the rerun's handler raised."""
    mode: str
    generation: int
    msg_id: str | None = None
    stream_seq: int | None = None
    detail: str = ""

    def describe(self) -> str:
        """One line for people."""
        parts = [f"dead letter {self.id}: {self.status}"]
        if self.msg_id:
            parts.append(f"msg-id {self.msg_id}")
        if self.stream_seq is not None:
            parts.append(f"stream seq {self.stream_seq}")
        if self.detail:
            parts.append(self.detail)
        return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class _Intent:
    row: dict[str, Any]
    generation: int
    msg_id: str
    resumed: bool


class Replayer:
    """Replays dead letters of an app: publishes them again, or reruns their handler.

    ``js`` (a JetStream context) is needed for publishing only.
    ``allow_fanout`` publishes even when durable consumers other than the
    handler's own would receive the message too (each of them would process it
    again, as a new message).
    """

    def __init__(self, app: App, js: Any = None, *, allow_fanout: bool = False) -> None:
        self.app = app
        self.js = js
        self.allow_fanout = allow_fanout
        self.tables = models.tables(app.settings.schema)
        self._checked_fanout: set[tuple[str, str, str]] = set()

    async def replay_many(
        self, ids: Iterable[int], *, mode: ReplayMode = "publish", again: bool = False
    ) -> list[ReplayResult]:
        """Replay each dead letter in turn (see :meth:`replay`)."""
        return [await self.replay(i, mode=mode, again=again) for i in ids]

    async def replay(
        self, dead_letter_id: int, *, mode: ReplayMode = "publish", again: bool = False
    ) -> ReplayResult:
        """Replay one dead letter once; repeating the call is a no-op unless ``again``."""
        if mode == "rerun":
            return await self._rerun(dead_letter_id, again)
        if self.js is None:
            raise errors.ConfigurationError("publishing a replay needs a NATS connection")
        intent = await self._begin(dead_letter_id, again)
        if isinstance(intent, ReplayResult):
            return intent
        seq = await self._find_in_stream(intent) if intent.resumed else None
        status: Literal["published", "duplicate", "recovered"] = "recovered"
        dropped: list[str] = []
        if seq is None:
            seq, duplicate, dropped = await self._publish(intent)
            status = "duplicate" if duplicate else "published"
        await self._finish(intent, seq)
        detail = f"left out headers {sorted(dropped)}" if dropped else ""
        return ReplayResult(
            id=dead_letter_id,
            status=status,
            mode=models.REPLAY_PUBLISH,
            generation=intent.generation,
            msg_id=intent.msg_id,
            stream_seq=seq,
            detail=detail,
        )

    async def _begin(self, dead_letter_id: int, again: bool) -> _Intent | ReplayResult:
        """Commit the intent of a publish (or find the unfinished one to resume)."""
        async with self.app.sessionmaker() as session, session.begin():
            row = await self._locked(session.execute, dead_letter_id)
            done = _already_done(row, again)
            if done is not None:
                return done
            if _pending_publish(row):
                return _Intent(row, row["replay_generation"], row["replay_msg_id"], resumed=True)
            await self._check_fanout(row)
            generation = row["replay_generation"] + 1
            msg_id = replay_msg_id(row, generation)
            await session.execute(
                sql.start_replay(
                    self.tables,
                    dead_letter_id,
                    generation=generation,
                    mode=models.REPLAY_PUBLISH,
                    msg_id=msg_id,
                    done=False,
                )
            )
        return _Intent(row, generation, msg_id, resumed=False)

    async def _locked(self, execute: Any, dead_letter_id: int) -> dict[str, Any]:
        result = await execute(sql.lock_dead_letter(self.tables, dead_letter_id))
        found = result.mappings().first()
        if found is None:
            raise errors.DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
        return dict(found)

    async def _check_fanout(self, row: Mapping[str, Any]) -> None:
        """Refuse to publish where other durable consumers would process the message again."""
        spec = self.app.handlers.get(row["subscription"])
        own = spec.durable if spec is not None else f"eop-{row['subscription']}"
        key = (row["stream"], row["subject"], own)
        if self.allow_fanout or key in self._checked_fanout:
            return
        others = []
        try:
            consumers = await self.js.consumers_info(row["stream"])
        except nats.js.errors.NotFoundError:
            raise errors.ReplayRefused(
                f"stream {row['stream']!r} does not exist: nothing to publish the replay into"
            ) from None
        for info in consumers:
            config = info.config
            if not config.durable_name or config.durable_name == own:
                continue
            filters = jetstream.consumer_filters(config.filter_subjects, config.filter_subject)
            if any(jetstream.subject_matches(f, row["subject"]) for f in filters or (">",)):
                others.append(config.durable_name)
        if others:
            raise errors.ReplayRefused(
                f"a published replay of {row['subject']!r} would also reach consumers "
                f"{sorted(others)}, which would process it again: use --rerun to run "
                f"handler {row['subscription']!r} alone, or --allow-fanout if they should"
            )
        self._checked_fanout.add(key)

    async def _find_in_stream(self, intent: _Intent) -> int | None:
        """Look for the intent's msg-id among the messages stored since the intent."""
        row = intent.row
        start = row["replay_requested_at"] - SCAN_MARGIN
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.BY_START_TIME,
            opt_start_time=start.astimezone(datetime.timezone.utc).isoformat(),
            filter_subject=row["subject"],
            inactive_threshold=30.0,
            mem_storage=True,
        )
        try:
            psub = await self.js.pull_subscribe(row["subject"], stream=row["stream"], config=config)
        except nats.js.errors.NotFoundError:
            return None
        try:
            return await _scan_for(psub, intent.msg_id)
        finally:
            name = (await psub.consumer_info()).name
            await psub.unsubscribe()
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.js.delete_consumer(row["stream"], name)

    async def _publish(self, intent: _Intent) -> tuple[int, bool, list[str]]:
        row = intent.row
        headers, dropped = replay_headers(row["headers"], row["id"], intent.msg_id)
        try:
            ack = await self.js.publish(
                row["subject"], bytes(row["payload"]), stream=row["stream"], headers=headers
            )
        except jetstream.NATS_ERRORS as exc:
            raise errors.NatsUnavailable(
                f"publishing the replay of dead letter {row['id']} failed ({type(exc).__name__}: "
                f"{exc}); running the same command again resumes it safely"
            ) from exc
        return int(ack.seq), bool(ack.duplicate), dropped

    async def _finish(self, intent: _Intent, seq: int) -> None:
        stmt = sql.finish_replay(self.tables, intent.row["id"], intent.msg_id, seq)
        async with self.app.sessionmaker() as session, session.begin():
            # No row: a concurrent run of the same replay finished it first.
            await session.execute(stmt)

    async def _rerun(self, dead_letter_id: int, again: bool) -> ReplayResult:
        """Run the handler on the stored message, in one transaction with the bookkeeping."""
        store = inbox.PostgresStore(self.app)
        # The row's subscription is not known before reading it; any spec of
        # the right kind opens the transaction, the real one is checked below.
        async with self.app.sessionmaker() as session:
            peek = (
                (
                    await session.execute(
                        sql.select_dead_letters(
                            self.tables, Filters(ids=(dead_letter_id,)).where(self.tables)
                        )
                    )
                )
                .mappings()
                .first()
            )
        if peek is None:
            raise errors.DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
        spec = self.app.handlers.get(peek["subscription"])
        if spec is None:
            known = ", ".join(sorted(self.app.handlers)) or "none"
            raise errors.ConfigurationError(
                f"dead letter {dead_letter_id} belongs to handler {peek['subscription']!r}, "
                f"which this app does not register (registered: {known}); pass the app that does"
            )
        async with store.transaction(spec) as tx:
            assert isinstance(tx, inbox.SqlTransaction)
            rows = await tx._rows(sql.lock_dead_letter(self.tables, dead_letter_id))
            if not rows:
                raise errors.DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
            row = dict(zip(self.tables.dead_letters.columns.keys(), rows[0], strict=True))
            done = _already_done(row, again)
            if done is not None:
                return done
            if _pending_publish(row):
                raise errors.ReplayRefused(
                    f"dead letter {dead_letter_id} has a published replay in flight "
                    f"(msg-id {row['replay_msg_id']}): finish it with `eop dlq replay "
                    f"{dead_letter_id}` rather than running the handler a second time"
                )
            msg = _message_of(row)
            try:
                await tx.run(msg)
            except Exception as exc:
                await tx.rollback()
                return ReplayResult(
                    id=dead_letter_id,
                    status="failed",
                    mode=models.REPLAY_RERUN,
                    generation=row["replay_generation"],
                    detail=f"{type(exc).__name__}: {exc}"[:500],
                )
            generation = row["replay_generation"] + 1
            await tx._rows(
                sql.settle_rerun_inbox(
                    self.tables,
                    row["subscription"],
                    row["stream"],
                    row["stream_epoch"],
                    row["stream_seq"],
                    row["fingerprint"],
                )
            )
            await tx._rows(
                sql.start_replay(
                    self.tables,
                    dead_letter_id,
                    generation=generation,
                    mode=models.REPLAY_RERUN,
                    msg_id=None,
                    done=True,
                )
            )
            try:
                await tx.commit()
            except errors.AmbiguousCommit:
                raise errors.AmbiguousCommit(
                    f"the connection dropped while committing the rerun of dead letter "
                    f"{dead_letter_id}: `eop dlq show {dead_letter_id}` tells whether it "
                    "committed (replayed_at set); do not rerun it before checking"
                ) from None
        return ReplayResult(
            id=dead_letter_id, status="rerun", mode=models.REPLAY_RERUN, generation=generation
        )


def _already_done(row: Mapping[str, Any], again: bool) -> ReplayResult | None:
    if row["replayed_at"] is None or again:
        return None
    when = row["replayed_at"].astimezone(datetime.timezone.utc).isoformat(timespec="seconds")
    return ReplayResult(
        id=row["id"],
        status="skipped",
        mode=row["replay_mode"],
        generation=row["replay_generation"],
        msg_id=row["replay_msg_id"],
        stream_seq=row["replay_stream_seq"],
        detail=f"already replayed ({row['replay_mode']}) at {when}; "
        "--again replays it once more, as a new message",
    )


def _pending_publish(row: Mapping[str, Any]) -> bool:
    return bool(row["replay_requested_at"] is not None and row["replayed_at"] is None)


def _message_of(row: Mapping[str, Any]) -> message.Message:
    """The message a rerun hands the handler: the stored one, as it was delivered."""
    return message.Message(
        subscription=row["subscription"],
        subject=row["subject"],
        data=bytes(row["payload"]),
        headers={str(k): str(v) for k, v in (row["headers"] or {}).items()},
        stream=row["stream"],
        stream_epoch=row["stream_epoch"],
        seq=int(row["stream_seq"]),
        num_delivered=int(row["delivery_count"]) + 1,
    )


async def _scan_for(psub: Any, msg_id: str) -> int | None:
    while True:
        try:
            batch = await psub.fetch(256, timeout=1.0)
        except (nats.errors.TimeoutError, TimeoutError):
            return None
        for msg in batch:
            if (msg.headers or {}).get(message.MSG_ID_HEADER) == msg_id:
                return int(msg.metadata.sequence.stream)
        if not batch or batch[-1].metadata.num_pending == 0:
            return None


# --- Formatting --------------------------------------------------------------

_TABLE_COLUMNS = (
    ("ID", "id"),
    ("HANDLER", "subscription"),
    ("STREAM", "stream"),
    ("SEQ", "stream_seq"),
    ("REASON", "reason"),
    ("ERROR", "error"),
    ("DELIV", "delivery_count"),
    ("CREATED (UTC)", "created_at"),
    ("REPLAYED", "replay"),
)


def replay_state(row: Mapping[str, Any]) -> str:
    """``-``, ``pending`` (a publish not yet confirmed), or how and when it was replayed."""
    if row.get("replay_requested_at") is None:
        return "-"
    if row.get("replayed_at") is None:
        return "pending"
    state = f"{row['replay_mode']} #{row['replay_generation']}"
    if row.get("replay_stream_seq") is not None:
        state += f" seq {row['replay_stream_seq']}"
    return state


def format_table(rows: Sequence[Mapping[str, Any]], *, error_width: int = 40) -> str:
    """The dead letters as an aligned text table (errors cut to ``error_width``)."""
    cells = [[title for title, _ in _TABLE_COLUMNS]]
    for row in rows:
        cells.append([_cell(key, row, error_width) for _, key in _TABLE_COLUMNS])
    widths = [max(len(line[i]) for line in cells) for i in range(len(_TABLE_COLUMNS))]
    return "\n".join(
        "  ".join(value.ljust(width) for value, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    )


def _cell(key: str, row: Mapping[str, Any], error_width: int) -> str:
    if key == "replay":
        return replay_state(row)
    value = row.get(key)
    if isinstance(value, datetime.datetime):
        return value.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    text = " ".join(str(value).split()) if value is not None else ""
    if key == "error" and len(text) > error_width:
        text = text[: error_width - 1] + "…"
    return text


def to_json(row: Mapping[str, Any]) -> dict[str, Any]:
    """A dead letter (without payload) as JSON-able values; headers redacted once more."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key in ("payload", "fingerprint"):
            if key == "fingerprint" and value is not None:
                out[key] = bytes(value).hex()
            continue
        if isinstance(value, datetime.datetime):
            value = value.astimezone(datetime.timezone.utc).isoformat()
        if key == "headers":
            value = log.redact_headers(value or {})
        out[key] = value
    out["replay"] = replay_state(row)
    return out


def format_details(row: Mapping[str, Any]) -> str:
    """Everything about one dead letter, for people (no payload: ``--payload`` prints it)."""
    data = to_json(row)
    lines = []
    for key in (
        "id", "subscription", "stream", "stream_epoch", "stream_seq", "subject", "msg_id",
        "reason", "delivery_count", "created_at", "payload_size", "fingerprint",
    ):  # fmt: skip
        lines.append(f"{key + ':':<16}{data.get(key)}")
    lines.append(f"{'replay:':<16}{data['replay']}")
    for key in ("replay_generation", "replay_msg_id", "replay_requested_at", "replayed_at"):
        if data.get(key) not in (None, 0):
            lines.append(f"{key + ':':<16}{data[key]}")
    lines.append("headers:")
    lines.append(_indent(json.dumps(data.get("headers") or {}, indent=2, sort_keys=True)))
    lines.append("error:")
    lines.append(_indent(str(data.get("error") or "")))
    if data.get("traceback"):
        lines.append("traceback:")
        lines.append(_indent(str(data["traceback"]).rstrip()))
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
