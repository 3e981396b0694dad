"""NATS JetStream at the edge: connecting, provisioning streams and consumers, epochs.

nats-py errors are translated here into :mod:`eop.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors
import tenacity
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api

from eop import errors, log, retry, wire
from eop.broker import connection, fetcher
from eop.handler import HandlerSpec, StreamSpec
from eop.settings import Settings

#: Stream metadata key under which eop records the epoch of streams it creates.
EPOCH_METADATA_KEY = "eop_epoch"

#: The subject prefix of the JetStream API (of the default account domain).
API_PREFIX = "$JS.API"

#: What nats-py raises when the server cannot be reached or does not answer.
NATS_ERRORS = connection.NATS_ERRORS


async def connect(
    settings: Settings,
    *,
    name: str = "eop",
    on_lost: Callable[[errors.NatsUnavailable], None] | None = None,
) -> wire.Client:
    """Connect to NATS, failing fast if it is unreachable now, reconnecting for ever later.

    For ever, unless the server keeps refusing the credentials it accepted
    at first (``settings.nats_auth_refusals`` reconnects in a row) or closes
    the connection itself: then ``on_lost`` gets the error, once, and the
    caller decides what to do (a worker stops). The connection is left to
    the caller to close.
    """
    logger = log.get_logger()
    nc: wire.Client | None = None
    access = settings.nats_access
    refusals = connection.Refusals(access, settings.nats_auth_refusals)
    handed_over = False
    lost = False

    def give_up(error: errors.NatsUnavailable) -> None:
        nonlocal lost
        if on_lost is not None and handed_over and not lost:
            lost = True
            on_lost(error)

    async def on_error(exc: Exception) -> None:
        logger.warning(log.Event.NATS_ERROR, error=type(exc).__name__)
        refused = refusals.error(exc)
        if refused is not None:
            give_up(refused)

    async def on_disconnect() -> None:
        # nats-py calls this on our own close() too: that is no news for the operator.
        if nc is None or not nc.is_closed:
            logger.warning(log.Event.NATS_DISCONNECTED)

    async def on_reconnect() -> None:
        refusals.connected()
        logger.info(log.Event.NATS_RECONNECTED)

    async def on_closed() -> None:
        # nats-py closes a connection by itself when the server ends it with
        # an error: it will not reconnect. Our own close() is no news.
        if nc is not None and not nc.eop_closing:
            give_up(refusals.closed(nc.last_error))

    # A few tries only for the first connection, so that a worker started
    # against a dead server says so within seconds (its start-up retries the
    # whole connection, logging each retry: eop.runtime.startup), and fails at
    # once when the server refuses its credentials or certificate...
    nc = await connection.connect_nats(
        access,
        name=name,
        max_reconnect_attempts=2,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        closed_cb=on_closed,
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
    handed_over = True
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

    retrying = retry.retrying(
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

    def first_seq(self, stream: str) -> int:
        """The stream's first sequence at the last reading (1 if never read)."""
        return self._first_seq.get(stream, 1)

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

        retrying = retry.retrying(
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
        info = await raw_stream_info(self._nc, stream, prefix=self._prefix)
        created = parse_time(info["created"])
        epoch = epoch_from_info(info)
        history = self._history.setdefault(stream, [])
        if not history or history[-1][1] != epoch:
            history.append((created, epoch))
            history.sort(key=lambda item: item[0])
        self._as_of[stream] = parse_time(info["ts"]) if "ts" in info else created
        self._first_seq[stream] = int(info.get("state", {}).get("first_seq", 1))
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


async def ensure_stream(
    js: JetStreamContext,
    spec: StreamSpec,
    *,
    create: bool,
    transform: tuple[str, str] | None = None,
) -> None:
    """Bind to the stream, creating it when allowed (with a fresh epoch id in its metadata).

    ``transform`` is the subject transform (src, dest) a stream eop creates gets
    for a handler whose keys are spread over partitions (:mod:`eop.broker.partitions`,
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
            return
        try:
            await js.add_stream(stream_config(spec, transform))
        except nats.js.errors.APIError as exc:
            # Another worker may have created it first, with its own epoch id;
            # if it still does not exist, the server refused it (overlapping
            # subjects, an invalid subject, limits, more replicas than servers).
            try:
                await js.stream_info(spec.name)
            except nats.js.errors.NotFoundError:
                raise errors.ConfigurationError(
                    f"cannot create stream {spec.name!r} with subjects "
                    f"{', '.join(spec.subjects)}: {_describe(exc)} ({_create_hint(spec, exc)})"
                ) from None


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
    if "replica" in _describe(exc).lower() or "placement" in _describe(exc).lower():
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


async def ensure_consumer(
    js: JetStreamContext, spec: HandlerSpec, settings: Settings, *, create: bool
) -> None:
    """Bind to the handler's durable pull consumer, creating it when allowed.

    An existing consumer must ack explicitly and filter the handler's subject;
    anything else would break the protocol, so it is an error, not a warning.
    """
    with translated(f"consumer {spec.durable!r} on stream {spec.stream!r}"):
        subjects = await _stream_subjects(js, spec.stream)
        if subjects is not None and not any(subject_matches(s, spec.subject) for s in subjects):
            # The server accepts such a consumer: it would wait for ever, silently.
            raise errors.ConfigurationError(
                f"stream {spec.stream!r} holds subjects {', '.join(subjects)}, which do not "
                f"cover handler {spec.name!r}'s subject {spec.subject}: add it to the stream's "
                "subjects, or fix the handler's stream= or subject="
            )
        try:
            info = await js.consumer_info(spec.stream, spec.durable)
        except nats.js.errors.NotFoundError:
            if not create:
                raise errors.ConfigurationError(
                    f"consumer {spec.durable!r} on stream {spec.stream!r} does not exist and "
                    "creating consumers is off (--no-create, EOP_CREATE=false): let eop "
                    "create it, or create a durable pull consumer with ack policy explicit "
                    f"and filter subject {spec.subject}"
                ) from None
        else:
            _check_consumer(info.config, spec, settings)
            await _match_ack_wait(js, info.config, spec, settings, create=create)
            return
        config = api.ConsumerConfig(
            durable_name=spec.durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=api.DeliverPolicy.ALL,
            ack_wait=spec.ack_wait_s or settings.ack_wait_s,
            # eop counts attempts itself and dead-letters the last one; a server-side
            # limit would silently drop a message before eop could record it.
            max_deliver=-1,
            max_ack_pending=settings.max_ack_pending,
            filter_subject=spec.subject,
            # num_replicas unset (0): the server gives the consumer its stream's replicas,
            # so that it keeps its place when the stream's leader dies.
        )
        try:
            await js.add_consumer(spec.stream, config)
        except nats.js.errors.APIError as exc:
            subjects = await _stream_subjects(js, spec.stream)
            hint = (
                f" (stream {spec.stream!r} holds subjects {', '.join(subjects)}: the handler's "
                f"subject {spec.subject} must fall under one of them)"
                if subjects is not None
                else ""
            )
            raise errors.ConfigurationError(
                f"cannot create consumer {spec.durable!r} on stream {spec.stream!r} for "
                f"handler {spec.name!r}: {_describe(exc)}{hint}"
            ) from None


async def _match_ack_wait(
    js: JetStreamContext,
    config: api.ConsumerConfig,
    spec: HandlerSpec,
    settings: Settings,
    *,
    create: bool,
) -> None:
    """Give an existing consumer the AckWait the worker times its leases by.

    The server takes a durable's AckWait from the config it was created with;
    a worker that renews and checks leases by another one would either let
    them lapse (a longer setting: redeliveries of messages still held) or
    count them short. So a changed ``ack_wait_s`` updates the consumer (the
    last worker started sets it, as for any rollout), and where eop may not
    touch consumers the mismatch is an error naming both fixes.
    """
    want = spec.ack_wait_s or settings.ack_wait_s
    have = config.ack_wait
    if have is None or abs(have - want) < 0.001:
        return
    if not create:
        raise errors.ConfigurationError(
            f"consumer {spec.durable!r} on stream {spec.stream!r} has AckWait {have:g} s but "
            f"handler {spec.name!r} times its leases by ack_wait_s {want:g} s, and creating "
            f"consumers is off (--no-create): set EOP_ACK_WAIT_S={have:g} (or the handler's "
            f"ack_wait_s=), or `nats consumer edit {spec.stream} {spec.durable} "
            f"--wait {want:g}s`"
        )
    await js.add_consumer(spec.stream, dataclasses.replace(config, ack_wait=want))
    log.get_logger().info(
        log.Event.CONSUMER_ACK_WAIT_CHANGED,
        handler=spec.name,
        stream=spec.stream,
        durable=spec.durable,
        ack_wait_s=want,
        was_s=have,
    )


async def _stream_subjects(js: JetStreamContext, stream: str) -> list[str] | None:
    try:
        info = await js.stream_info(stream)
    except NATS_ERRORS:
        return None
    return list(info.config.subjects or [])


def _describe(exc: BaseException) -> str:
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
            f"{what}: JetStream is not available for now ({_describe(exc)})"
        ) from exc
    except nats.js.errors.APIError as exc:
        raise errors.ConfigurationError(f"{what}: the server refused: {_describe(exc)}") from exc
    except NATS_ERRORS as exc:
        raise errors.NatsUnavailable(
            f"{what}: NATS did not answer ({type(exc).__name__}): is JetStream enabled "
            "and the server reachable?"
        ) from exc


def _check_consumer(config: Any, spec: HandlerSpec, settings: Settings | None = None) -> None:
    """Refuse an existing consumer whose configuration would break the protocol.

    The error names every field that differs, what eop needs instead, and
    the fix: deleting the consumer is safe (eop recreates it, and its inbox
    and watermark skip what was already processed).
    """
    problems = []
    if config.ack_policy != api.AckPolicy.EXPLICIT:
        problems.append(f"ack_policy is {_value(config.ack_policy)}, eop needs explicit")
    filters = set(consumer_filters(config.filter_subjects, config.filter_subject))
    if filters and spec.subject not in filters:
        problems.append(
            f"filter_subject is {', '.join(sorted(filters))}, "
            f"handler {spec.name!r} subscribes to {spec.subject}"
        )
    deliver = config.deliver_policy
    if deliver is not None and deliver != api.DeliverPolicy.ALL:
        problems.append(
            f"deliver_policy is {_value(deliver)}, eop needs all "
            "(messages stored before the consumer would never be processed)"
        )
    if getattr(config, "deliver_subject", None):
        problems.append("it is a push consumer (deliver_subject set), eop needs a pull consumer")
    max_attempts = spec.max_attempts or (settings.max_attempts if settings else 1)
    if config.max_deliver not in (None, -1, 0) and config.max_deliver <= max_attempts:
        problems.append(
            f"max_deliver is {config.max_deliver}, eop needs -1 (unlimited) or above "
            f"max_attempts ({max_attempts}): the server would drop a message before eop "
            "dead-letters it"
        )
    if problems:
        raise errors.ConfigurationError(
            f"consumer {spec.durable!r} on stream {spec.stream!r} conflicts with handler "
            f"{spec.name!r}: {'; '.join(problems)}. Fix: delete it "
            f"(`nats consumer rm {spec.stream} {spec.durable}`; eop recreates it and its inbox "
            f"skips what was already processed), or give the handler another durable= name"
        )


def _value(option: Any) -> str:
    return str(getattr(option, "value", option))


def consumer_filters(
    filter_subjects: Sequence[str] | None, filter_subject: str | None
) -> tuple[str, ...]:
    """A consumer's subject filters, from whichever of its two config fields is set.

    Empty when it filters nothing (it receives every subject of its stream).
    """
    if filter_subjects:
        return tuple(filter_subjects)
    return (filter_subject,) if filter_subject else ()


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether the NATS subject filter ``pattern`` matches ``subject``, as the server does.

    ``*`` stands for one token, ``>`` (as the last token only) for one or
    more. ``subject`` may be a filter too: then True when the pattern
    matches every subject it does. A subject or pattern with an empty token
    (``a..b``, ``.a``, ``""``) is no valid subject and matches nothing.
    """
    have, want = pattern.split("."), subject.split(".")
    if "" in have or "" in want:
        return False
    for i, token in enumerate(have):
        if token == ">" and i == len(have) - 1:
            return len(want) > i
        if i >= len(want) or (want[i] == ">" and i == len(want) - 1):
            # The pattern ends, or the subject's ``>`` stands for more than this token.
            return False
        if token != "*" and token != want[i]:
            return False
    return len(want) == len(have)


async def subscribe(nc: NATS, spec: HandlerSpec) -> fetcher.Fetcher:
    """A :class:`eop.broker.fetcher.Fetcher` of the handler's durable consumer."""
    return await fetcher.Fetcher(nc, spec.stream, spec.durable).start()
