"""A published replay: resumable, once per generation (see :mod:`eop.ops.dlq`)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from eop import errors, message, redaction
from eop.broker import consumers, jetstream
from eop.ops.dlq import rerun, state
from eop.ordering import partitions
from eop.pg import models
from eop.pg.sql import dead_letters as dead_letters_sql

if TYPE_CHECKING:
    from eop.app import App

#: Header naming the dead letter a replayed message came from.
REPLAY_OF_HEADER = "Eop-Replay-Of"

#: How far before the recorded intent a resumed replay looks for its message:
#: the stream stamps messages with the NATS server's clock, the intent carries
#: PostgreSQL's.
SCAN_MARGIN = datetime.timedelta(minutes=5)


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
        if name.lower().startswith("nats-") or value == redaction.REDACTED:
            dropped.append(name)
            continue
        headers[name] = value
    headers[message.MSG_ID_HEADER] = msg_id
    headers[REPLAY_OF_HEADER] = str(dead_letter_id)
    return headers, dropped


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

    def __init__(
        self, app: App, js: JetStreamContext | None = None, *, allow_fanout: bool = False
    ) -> None:
        self.app = app
        self.js = js
        self.allow_fanout = allow_fanout
        self.tables = models.tables(app.settings.schema)
        self._checked_fanout: set[tuple[str, str, str]] = set()
        self._transforms: dict[str, tuple[str, str] | None] = {}

    async def replay_many(
        self,
        ids: Iterable[int],
        *,
        mode: state.ReplayMode = "publish",
        again: bool = False,
        on_result: Callable[[state.ReplayResult], None] | None = None,
    ) -> list[state.ReplayResult]:
        """Replay each dead letter in turn (see :meth:`replay`); ``on_result`` is given
        each result as it comes, so that a run cut short has told what it did."""
        results = []
        for i in ids:
            results.append(await self.replay(i, mode=mode, again=again))
            if on_result is not None:
                on_result(results[-1])
        return results

    @property
    def _nats(self) -> JetStreamContext:
        if self.js is None:
            raise errors.ConfigurationError("publishing a replay needs a NATS connection")
        return self.js

    async def replay(
        self, dead_letter_id: int, *, mode: state.ReplayMode = "publish", again: bool = False
    ) -> state.ReplayResult:
        """Replay one dead letter once; repeating the call is a no-op unless ``again``."""
        if mode == "rerun":
            return await self._rerun(dead_letter_id, again)
        self._nats  # noqa: B018  # fails here, before any change, without a connection
        intent = await self._begin(dead_letter_id, again)
        if isinstance(intent, state.ReplayResult):
            return intent
        seq = await self._find_in_stream(intent) if intent.resumed else None
        status: Literal["published", "duplicate", "recovered"] = "recovered"
        dropped: list[str] = []
        if seq is None:
            seq, duplicate, dropped = await self._publish(intent)
            status = "duplicate" if duplicate else "published"
        await self._finish(intent, seq)
        detail = f"left out headers {sorted(dropped)}" if dropped else ""
        return state.ReplayResult(
            id=dead_letter_id,
            status=status,
            mode=models.REPLAY_PUBLISH,
            generation=intent.generation,
            msg_id=intent.msg_id,
            stream_seq=seq,
            detail=detail,
        )

    async def _begin(self, dead_letter_id: int, again: bool) -> _Intent | state.ReplayResult:
        """Commit the intent of a publish (or find the unfinished one to resume)."""
        async with self.app.sessionmaker() as session, session.begin():
            row = await self._locked(session.execute, dead_letter_id)
            done = state.already_done(row, again)
            if done is not None:
                return done
            if state.pending_publish(row):
                return _Intent(row, row["replay_generation"], row["replay_msg_id"], resumed=True)
            await self._check_fanout(row)
            generation = row["replay_generation"] + 1
            msg_id = replay_msg_id(row, generation)
            await session.execute(
                dead_letters_sql.start_replay(
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
        result = await execute(dead_letters_sql.lock_dead_letter(self.tables, dead_letter_id))
        found = result.mappings().first()
        if found is None:
            raise state.not_found(dead_letter_id)
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
            infos = await self._nats.consumers_info(row["stream"])
        except nats.js.errors.NotFoundError:
            raise errors.ReplayRefused(
                f"stream {row['stream']!r} does not exist: nothing to publish the replay into"
            ) from None
        stored = await self._stored_subject(row)
        for info in infos:
            config = info.config
            name = config.durable_name
            # An ordered handler's own consumers are its partitions' (see eop.ordering.partitions).
            if not name or name == own or partitions.is_consumer_of(own, name):
                continue
            filters = consumers.consumer_filters(config.filter_subjects, config.filter_subject)
            if any(consumers.subject_matches(f, stored) for f in filters or (">",)):
                others.append(name)
        if others:
            raise errors.ReplayRefused(
                f"a published replay of {row['subject']!r} would also reach consumers "
                f"{sorted(others)}, which would process it again: use --rerun to run "
                f"handler {row['subscription']!r} alone, or --allow-fanout if they should"
            )
        self._checked_fanout.add(key)

    async def _stored_subject(self, row: Mapping[str, Any]) -> str:
        """The subject the stream stores the replay under: behind its partition when the
        stream spreads an ordered handler's subjects over partitions (a dead letter
        keeps the subject as published, as its handler saw it)."""
        stream = row["stream"]
        if stream not in self._transforms:
            try:
                info = await self._nats.stream_info(stream)
            except nats.js.errors.NotFoundError:
                return str(row["subject"])
            have = info.config.subject_transform
            self._transforms[stream] = (have.src, have.dest) if have is not None else None
        return partitions.stored_subject(self._transforms[stream], row["subject"])

    async def _find_in_stream(self, intent: _Intent) -> int | None:
        """Look for the intent's msg-id among the messages stored since the intent."""
        row = intent.row
        start = row["replay_requested_at"] - SCAN_MARGIN
        stored = await self._stored_subject(row)
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.BY_START_TIME,
            opt_start_time=start.astimezone(datetime.timezone.utc).isoformat(),
            filter_subject=stored,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        try:
            psub = await self._nats.pull_subscribe(stored, stream=row["stream"], config=config)
        except nats.js.errors.NotFoundError:
            return None
        try:
            return await _scan_for(psub, intent.msg_id)
        finally:
            name = (await psub.consumer_info()).name
            await psub.unsubscribe()
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self._nats.delete_consumer(row["stream"], name)

    async def _publish(self, intent: _Intent) -> tuple[int, bool, list[str]]:
        row = intent.row
        headers, dropped = replay_headers(row["headers"], row["id"], intent.msg_id)
        try:
            ack = await self._nats.publish(
                row["subject"], bytes(row["payload"]), stream=row["stream"], headers=headers
            )
        except jetstream.NATS_ERRORS as exc:
            raise errors.NatsUnavailable(
                f"publishing the replay of dead letter {row['id']} failed ({type(exc).__name__}: "
                f"{exc}); running the same command again resumes it safely"
            ) from exc
        return int(ack.seq), bool(ack.duplicate), dropped

    async def _finish(self, intent: _Intent, seq: int) -> None:
        stmt = dead_letters_sql.finish_replay(self.tables, intent.row["id"], intent.msg_id, seq)
        async with self.app.sessionmaker() as session, session.begin():
            # No row: a concurrent run of the same replay finished it first.
            await session.execute(stmt)

    async def _rerun(self, dead_letter_id: int, again: bool) -> state.ReplayResult:
        return await rerun.rerun(self.app, dead_letter_id, again=again)


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
