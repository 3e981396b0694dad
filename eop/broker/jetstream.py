"""NATS JetStream at the edge: connecting, provisioning streams and consumers, epochs.

nats-py errors are translated here into :mod:`eop.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import nats
import nats.errors
import nats.js.errors
import tenacity
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api

from eop import backoff, errors, futures, log
from eop.broker import client, connection
from eop.handler import StreamSpec
from eop.settings import Settings

#: Stream metadata key under which eop records the epoch of streams it creates.
EPOCH_METADATA_KEY = "eop_epoch"

#: The subject prefix of the JetStream API (of the default account domain).
API_PREFIX = "$JS.API"

#: What nats-py raises when the server cannot be reached or does not answer.
NATS_ERRORS = connection.NATS_ERRORS


class _Events:
    """What a connection's callbacks log and decide, from the first try to the close."""

    def __init__(
        self,
        refusals: connection.Refusals,
        on_lost: Callable[[errors.NatsUnavailable], None] | None,
    ) -> None:
        self.logger = log.get_logger()
        self.refusals = refusals
        self.on_lost = on_lost
        self.nc: client.Client | None = None
        self.handed_over = False
        """Whether the caller has the connection (after its first connection and check)."""
        self.lost = False
        self.outage_errors: int | None = None
        """The errors of the reconnect attempts since the connection dropped; None while up."""

    def give_up(self, error: errors.NatsUnavailable) -> None:
        if self.on_lost is not None and self.handed_over and not self.lost:
            self.lost = True
            self.on_lost(error)

    async def error(self, exc: Exception) -> None:
        # Before the first connection is handed over, the caller's error (one line, or a
        # start-up retry's) tells of the failure: a warning per try was noise before it.
        # While the connection is down (nats.disconnected, a warning, said so), each
        # reconnect attempt fails, every 0.5 s or so: debug lines, counted on
        # nats.reconnected.
        warn = self.handed_over and self.outage_errors is None
        if self.outage_errors is not None:
            self.outage_errors += 1
        (self.logger.warning if warn else self.logger.debug)(
            log.Event.NATS_ERROR, error=type(exc).__name__
        )
        refused = self.refusals.error(exc)
        if refused is not None:
            self.give_up(refused)

    async def disconnected(self) -> None:
        # nats-py calls this on our own close() too: that is no news for the operator.
        if self.nc is None or not self.nc.is_closed:
            if self.outage_errors is None:
                self.outage_errors = 0
            self.logger.warning(log.Event.NATS_DISCONNECTED)

    async def reconnected(self) -> None:
        self.refusals.connected()
        failed, self.outage_errors = self.outage_errors or 0, None
        self.logger.info(log.Event.NATS_RECONNECTED, failed_attempts=failed)

    async def closed(self) -> None:
        # nats-py closes a connection by itself when the server ends it with
        # an error: it will not reconnect. Our own close() is no news.
        if self.nc is not None and not self.nc.eop_closing:
            self.give_up(self.refusals.closed(self.nc.last_error))


async def connect(
    settings: Settings,
    *,
    name: str = "eop",
    on_lost: Callable[[errors.NatsUnavailable], None] | None = None,
) -> client.Client:
    """Connect to NATS, failing fast if it is unreachable now, reconnecting for ever later.

    For ever, unless the server keeps refusing the credentials it accepted
    at first (``settings.nats_auth_refusals`` reconnects in a row) or closes
    the connection itself: then ``on_lost`` gets the error, once, and the
    caller decides what to do (a worker stops). The connection is left to
    the caller to close.
    """
    access = settings.nats_access
    events = _Events(connection.Refusals(access, settings.nats_auth_refusals), on_lost)
    # A few tries only for the first connection, so that a worker started
    # against a dead server says so within seconds (its start-up retries the
    # whole connection, logging each retry: eop.runtime.startup), and fails at
    # once when the server refuses its credentials or certificate...
    nc = events.nc = await connection.connect_nats(
        access,
        name=name,
        max_reconnect_attempts=2,
        error_cb=events.error,
        disconnected_cb=events.disconnected,
        reconnected_cb=events.reconnected,
        closed_cb=events.closed,
    )
    # ...and, once connected, reconnect for as long as it takes. nats-py reads
    # this option on every reconnect cycle.
    nc.options["max_reconnect_attempts"] = -1
    try:
        await _jetstream_answers(nc)
    except asyncio.CancelledError:
        await connection.close_quietly(nc)
        raise
    except NATS_ERRORS as exc:
        await nc.close()
        raise errors.NatsUnavailable(
            f"JetStream is not available at {access.where} (start nats-server with -js; "
            f"in a cluster, a quorum of its servers must be up): {type(exc).__name__}"
        ) from exc
    events.handed_over = True
    return nc


#: How many times a silent JetStream is asked before eop gives up on it.
JETSTREAM_TRIES = 3


async def _jetstream_answers(nc: NATS) -> None:
    """Ask JetStream for the account's info, a few times if it does not answer.

    No responders means no JetStream: that fails at once. Silence is what a
    cluster electing its meta leader (a server just died) looks like for a
    few seconds: asked again, it answers.
    """

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.get_logger().info(
            log.Event.JETSTREAM_INFO_RETRY,
            attempt=state.attempt_number,
            error=type(exc).__name__,
        )

    retrying = backoff.retrying(
        stop=tenacity.stop_after_attempt(JETSTREAM_TRIES),
        retry=tenacity.retry_if_exception_type((nats.errors.TimeoutError, asyncio.TimeoutError)),
        base_s=_EPOCH_RETRY_FIRST_S,
        max_s=_EPOCH_RETRY_MAX_S,
        before_sleep=before_sleep,
    )
    async for attempt in retrying:
        with attempt:
            await nc.jetstream().account_info()


class StreamEpochs:
    """Which epoch a delivered message belongs to, by the time it was stored.

    Every epoch starts at its stream's creation time, so a message belongs to
    the newest epoch created at or before its own timestamp. Epochs are
    re-read from the server whenever a message is newer than the last reading
    (the stream may have been recreated since); a message older than every
    known epoch belongs to a deleted stream and gets None.
    """

    def __init__(self, nc: NATS, api_prefix: str = API_PREFIX) -> None:
        self._nc = nc
        self._prefix = api_prefix
        self._history: dict[str, list[tuple[datetime.datetime, str]]] = {}
        self._as_of: dict[str, datetime.datetime] = {}
        self._first_seq: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._ahead: set[asyncio.Task[str | None]] = set()
        """Readings started by :meth:`read_ahead`, kept until they end."""
        self._read_at: dict[str, float] = {}
        """When (monotonic) each stream's last reading that answered was asked for."""

    def first_seq(self, stream: str) -> int:
        """The stream's first sequence at the last reading (1 if never read)."""
        return self._first_seq.get(stream, 1)

    def current_for(self, stream: str, epoch: str) -> datetime.timedelta | None:
        """How long ``epoch``, the stream's newest, existed at the last reading (server time);
        None if never read or a later epoch was seen. Every other epoch ended before it."""
        history, as_of = self._history.get(stream), self._as_of.get(stream)
        if not history or as_of is None or history[-1][1] != epoch:
            return None
        return as_of - history[-1][0]

    async def read_within(self, stream: str, within_s: float, timeout_s: float) -> bool | None:
        """Make sure the last reading of ``stream`` was asked for at most ``within_s`` ago, or
        read it now (callers meanwhile share it), ``timeout_s`` at most: True then; False if
        the stream is gone; None if it cannot be read in time (:mod:`eop.broker.fence`)."""
        if self._read_since(stream, within_s):
            return True  # no task, no timer: the usual case of a drained backlog's batch
        try:
            return await asyncio.wait_for(self._read_fresh(stream, within_s), timeout_s)
        except (errors.NatsUnavailable, asyncio.TimeoutError):
            return None
        except errors.ConfigurationError:
            return False  # no such stream: its messages are gone

    async def _read_fresh(self, stream: str, within_s: float) -> bool:
        async with self._locks.setdefault(stream, asyncio.Lock()):
            if not self._read_since(stream, within_s):
                await self.refresh(stream)
        return True

    def _read_since(self, stream: str, within_s: float) -> bool:
        asked = self._read_at.get(stream)
        return asked is not None and time.monotonic() - asked <= within_s

    def of_current(self, stream: str, stored_at: datetime.datetime | None) -> bool:
        """Whether a message stored at ``stored_at`` is of the stream's incarnation at the
        last reading: stored since its creation (no time, or never read: True)."""
        history = self._history.get(stream)
        if not history or stored_at is None:
            return True
        return stored_at >= history[-1][0]

    async def epoch_of(self, stream: str, stored_at: datetime.datetime | None) -> str | None:
        """The epoch of the message of ``stream`` stored at ``stored_at``."""
        if stored_at is None or stream not in self._history or stored_at > self._as_of[stream]:
            async with self._locks.setdefault(stream, asyncio.Lock()):
                # Another message of the batch may have refreshed it meanwhile.
                if stored_at is None or stored_at > self._as_of.get(stream, _EPOCH_MIN):
                    await self._refresh_retried(stream)
        history = self._history[stream]
        if stored_at is None:
            return history[-1][1]
        for created, epoch in reversed(history):
            if created <= stored_at:
                return epoch
        return None

    def read_ahead(self, stream: str, stored_at: datetime.datetime | None) -> None:
        """Start the reading that a message stored at ``stored_at`` will wait for, now.

        At a steady rate every fetched batch holds messages newer than the last
        reading, so each batch reads the epochs again before its claim: a round
        trip to the server inside every message's latency. A fetch loop calls
        this as soon as its fetch returns, so that the reading runs while the
        batch's task is still being scheduled; the batch's own :meth:`epoch_of`
        then waits for it (the stream's lock) and finds it current. Nothing is
        started while a reading is under way (the batch waits for that one and
        checks again) or when the message is older than the last reading. A
        failed reading is the batch's to retry, and to report.
        """
        if stored_at is None or stream not in self._history or stored_at <= self._as_of[stream]:
            return
        if self._locks.setdefault(stream, asyncio.Lock()).locked():
            return
        task = asyncio.create_task(self.epoch_of(stream, stored_at))
        self._ahead.add(task)
        task.add_done_callback(self._ahead_done)

    def _ahead_done(self, task: asyncio.Task[str | None]) -> None:
        self._ahead.discard(task)
        futures.retrieve(task)  # the batch that needs the reading reports a failure

    async def _refresh_retried(self, stream: str) -> None:
        """:meth:`refresh`, asked again while nobody answers for the stream.

        A replicated stream whose leader died answers nothing until its servers
        elect another (5 to 8 s, docs/nats-cluster.md); a message waiting for
        its epoch is better kept (its lease is checked afterwards) than failed
        and sent back for a minute. ``JETSTREAM_TRIES`` requests of 5 s at most.
        """

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.get_logger().info(
                log.Event.STREAM_INFO_RETRY,
                stream=stream,
                attempt=state.attempt_number,
                error=type(exc).__name__,
            )

        retrying = backoff.retrying(
            stop=tenacity.stop_after_attempt(JETSTREAM_TRIES),
            retry=tenacity.retry_if_exception_type(errors.NatsUnavailable),
            base_s=_EPOCH_RETRY_FIRST_S,
            max_s=_EPOCH_RETRY_MAX_S,
            before_sleep=before_sleep,
        )
        async for attempt in retrying:
            with attempt:
                await self.refresh(stream)

    async def refresh(self, stream: str) -> str:
        """Read the stream's current epoch from the server; returns it."""
        asked = time.monotonic()
        info = await raw_stream_info(self._nc, stream, prefix=self._prefix)
        created = parse_time(info["created"])
        epoch = epoch_from_info(info)
        history = self._history.setdefault(stream, [])
        if not history or history[-1][1] != epoch:
            history.append((created, epoch))
            history.sort(key=lambda item: item[0])
        self._as_of[stream] = parse_time(info["ts"]) if "ts" in info else created
        self._first_seq[stream] = int(info.get("state", {}).get("first_seq", 1))
        self._read_at[stream] = max(asked, self._read_at.get(stream, asked))
        return epoch


_EPOCH_MIN = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
_EPOCH_RETRY_FIRST_S = 0.5
_EPOCH_RETRY_MAX_S = 2.0


def epoch_from_info(info: Mapping[str, Any]) -> str:
    """A stream's epoch from its raw ``STREAM.INFO`` response: eop's id, else its creation time."""
    metadata = info.get("config", {}).get("metadata") or {}
    return str(metadata.get(EPOCH_METADATA_KEY) or parse_time(info["created"]).isoformat())


async def api_request(nc: NATS, subject: str, *, what: str, prefix: str = API_PREFIX) -> Any:
    """The decoded reply of a raw JetStream API request (``STREAM.INFO.X``, ...).

    Raw, since nats-py's typed infos drop the server's time (``ts``) that
    epochs and the audit's clock rely on. A reply that reports an error is
    returned as it is (its ``error`` key); an unreachable server raises
    :class:`eop.NatsUnavailable`, its message starting with ``what``.
    """
    try:
        reply = await nc.request(f"{prefix}.{subject}", b"", timeout=5)
    except NATS_ERRORS as exc:
        raise errors.NatsUnavailable(f"{what}: {exc!r}") from exc
    return json.loads(reply.data)


async def raw_stream_info(nc: NATS, stream: str, *, prefix: str = API_PREFIX) -> dict[str, Any]:
    """The raw ``STREAM.INFO`` of ``stream``; :class:`eop.ConfigurationError` if it is missing."""
    what = f"cannot read stream {stream!r}"
    info: dict[str, Any] = await api_request(nc, f"STREAM.INFO.{stream}", what=what, prefix=prefix)
    if "error" in info:
        raise errors.ConfigurationError(f"{what}: {info['error'].get('description')}")
    return info


def parse_time(text: str) -> datetime.datetime:
    """An RFC 3339 time from nats-server (nanoseconds, 'Z'), to microseconds, UTC."""
    main, _, rest = text.rstrip("Z").partition(".")
    fraction = "".join(ch for ch in rest if ch.isdigit())[:6].ljust(6, "0")
    return datetime.datetime.fromisoformat(f"{main}.{fraction}").replace(
        tzinfo=datetime.timezone.utc
    )


@dataclasses.dataclass(frozen=True)
class BoundStream:
    """A stream :func:`ensure_stream` bound to."""

    info: api.StreamInfo
    """Its info, as the server answered the call that found or created it."""
    created: bool
    """True if this call created it."""


async def ensure_stream(
    js: JetStreamContext,
    spec: StreamSpec,
    *,
    create: bool,
    transform: tuple[str, str] | None = None,
) -> BoundStream:
    """Bind to the stream, creating it when allowed (with a fresh epoch id in its metadata).

    ``transform`` is the subject transform (src, dest) a stream eop creates gets
    for a handler whose keys are spread over partitions (:mod:`eop.ordering.partitions`,
    which checks a stream that exists).

    A stream that exists is used as it is; if it has another number of
    replicas than ``spec`` asks for, a warning says so (changing it is the
    operator's call: scaling down gives up copies, and every worker would race
    to update it).
    """
    with translated(f"stream {spec.name!r}"):
        try:
            info = await js.stream_info(spec.name)
        except nats.js.errors.NotFoundError:
            if not create:
                raise errors.ConfigurationError(
                    f"stream {spec.name!r} does not exist and creating streams is off "
                    f"(--no-create, EOP_CREATE=false): create it (`nats stream add {spec.name} "
                    f"--subjects '{','.join(spec.subjects)}'`) or let eop create it"
                ) from None
        else:
            _check_replicas(spec, info)
            return BoundStream(info, created=False)
        try:
            info = await js.add_stream(stream_config(spec, transform))
        except nats.js.errors.APIError as exc:
            # Another worker may have created it first, with its own epoch id;
            # if it still does not exist, the server refused it (overlapping
            # subjects, an invalid subject, limits, more replicas than servers).
            try:
                info = await js.stream_info(spec.name)
            except nats.js.errors.NotFoundError:
                raise errors.ConfigurationError(
                    f"cannot create stream {spec.name!r} with subjects "
                    f"{', '.join(spec.subjects)}: {describe(exc)} ({_create_hint(spec, exc)})"
                ) from None
            return BoundStream(info, created=False)
        return BoundStream(info, created=True)


def stream_config(spec: StreamSpec, transform: tuple[str, str] | None = None) -> api.StreamConfig:
    """The configuration eop creates ``spec``'s stream with (a fresh epoch id included)."""
    placement = None
    if spec.placement_cluster or spec.placement_tags:
        placement = api.Placement(
            cluster=spec.placement_cluster, tags=list(spec.placement_tags) or None
        )
    return api.StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        storage=api.StorageType.MEMORY if spec.storage == "memory" else api.StorageType.FILE,
        duplicate_window=spec.duplicate_window_s,
        max_age=spec.max_age_s or None,
        num_replicas=spec.replicas,
        placement=placement,
        metadata={EPOCH_METADATA_KEY: uuid.uuid4().hex},
        subject_transform=(
            api.SubjectTransform(src=transform[0], dest=transform[1]) if transform else None
        ),
    )


def _create_hint(spec: StreamSpec, exc: BaseException) -> str:
    if "replica" in describe(exc).lower() or "placement" in describe(exc).lower():
        return (
            f"a stream of {spec.replicas} replicas needs a NATS cluster with at least as many "
            "JetStream servers (matching its placement, if any): lower replicas= or add servers"
        )
    return "does another stream already hold these subjects? declare its name with stream= instead"


def _check_replicas(spec: StreamSpec, info: api.StreamInfo) -> None:
    have = info.config.num_replicas or 1
    if spec.replicas is not None and have != spec.replicas:
        log.get_logger().warning(
            log.Event.STREAM_REPLICAS_DIFFER,
            stream=spec.name,
            replicas=have,
            declared=spec.replicas,
            fix=f"nats stream edit {spec.name} --replicas {spec.replicas}",
        )


def describe(exc: BaseException) -> str:
    return str(getattr(exc, "description", None) or exc or type(exc).__name__)


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """nats-py errors while provisioning, as eop's: unexpected API errors and lost servers.

    A 503 (JetStream not available for now: a cluster without its meta leader,
    a server starting or stopping) is a lost server, not a refusal.
    """
    try:
        yield
    except nats.js.errors.ServiceUnavailableError as exc:
        raise errors.NatsUnavailable(
            f"{what}: JetStream is not available for now ({describe(exc)})"
        ) from exc
    except nats.js.errors.APIError as exc:
        raise errors.ConfigurationError(f"{what}: the server refused: {describe(exc)}") from exc
    except NATS_ERRORS as exc:
        raise errors.NatsUnavailable(
            f"{what}: NATS did not answer ({type(exc).__name__}): is JetStream enabled "
            "and the server reachable?"
        ) from exc
