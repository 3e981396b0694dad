"""NATS JetStream at the edge: connecting, provisioning streams and consumers, epochs.

nats-py errors are translated here into :mod:`eop.errors`.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.js import api

from eop import errors, log
from eop.handler import HandlerSpec, StreamSpec
from eop.settings import Settings

#: Stream metadata key under which eop records the epoch of streams it creates.
EPOCH_METADATA_KEY = "eop_epoch"

_NATS_ERRORS = (OSError, asyncio.TimeoutError, nats.errors.Error)


async def connect(settings: Settings, *, name: str = "eop") -> Any:
    """Connect to NATS, failing fast if it is unreachable now, reconnecting for ever later."""
    logger = log.get_logger()

    async def on_error(exc: Exception) -> None:
        logger.warning(log.Event.NATS_ERROR, error=type(exc).__name__)

    async def on_disconnect() -> None:
        logger.warning(log.Event.NATS_DISCONNECTED)

    async def on_reconnect() -> None:
        logger.info(log.Event.NATS_RECONNECTED)

    servers = [u.strip() for u in settings.nats_url.split(",") if u.strip()]
    try:
        nc = await nats.connect(
            servers=servers,
            name=name,
            connect_timeout=2,
            reconnect_time_wait=0.5,
            # A few tries only for the first connection, so that a worker
            # started against a dead server exits with a clear error...
            max_reconnect_attempts=2,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
    except _NATS_ERRORS as exc:
        raise errors.NatsUnavailable(
            f"NATS is unreachable at {log.redact_urls(settings.nats_url)}: "
            f"{type(exc).__name__} {exc}".strip()
        ) from exc
    # ...and, once connected, reconnect for as long as it takes. nats-py reads
    # this option on every reconnect cycle.
    nc.options["max_reconnect_attempts"] = -1
    try:
        await nc.jetstream().account_info()
    except _NATS_ERRORS as exc:
        await nc.close()
        raise errors.NatsUnavailable(
            f"JetStream is not available at {log.redact_urls(settings.nats_url)} "
            f"(start nats-server with -js): {type(exc).__name__}"
        ) from exc
    return nc


def stream_epoch(info: Any) -> str:
    """The epoch of a stream: eop's id in its metadata, else its creation time.

    Both change when the stream is deleted and recreated, which is when its
    sequences restart at 1.
    """
    metadata = getattr(info.config, "metadata", None) or {}
    if EPOCH_METADATA_KEY in metadata:
        return str(metadata[EPOCH_METADATA_KEY])
    created = getattr(info, "created", None)
    return created.isoformat() if created is not None else "0"


class StreamEpochs:
    """Caches stream epochs; refreshed when a sequence looks reused or a consumer vanishes."""

    def __init__(self, js: Any) -> None:
        self._js = js
        self._epochs: dict[str, str] = {}

    async def get(self, stream: str) -> str:
        """The cached epoch of ``stream`` (read from the server the first time)."""
        if stream not in self._epochs:
            return await self.refresh(stream)
        return self._epochs[stream]

    async def refresh(self, stream: str) -> str:
        """Read the epoch of ``stream`` from the server."""
        info = await self._js.stream_info(stream)
        self._epochs[stream] = stream_epoch(info)
        return self._epochs[stream]


async def ensure_stream(js: Any, spec: StreamSpec, *, create: bool) -> str:
    """Bind to the stream, creating it when allowed; returns its epoch."""
    try:
        return stream_epoch(await js.stream_info(spec.name))
    except nats.js.errors.NotFoundError:
        if not create:
            raise errors.ConfigurationError(
                f"stream {spec.name!r} does not exist: create it, or run with create enabled"
            ) from None
    config = api.StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        storage=api.StorageType.MEMORY if spec.storage == "memory" else api.StorageType.FILE,
        duplicate_window=spec.duplicate_window_s,
        max_age=spec.max_age_s or None,
        metadata={EPOCH_METADATA_KEY: uuid.uuid4().hex},
    )
    try:
        info = await js.add_stream(config)
    except nats.js.errors.BadRequestError:
        # Another worker created it first (with its own epoch id): bind to that one.
        info = await js.stream_info(spec.name)
    return stream_epoch(info)


async def ensure_consumer(js: Any, spec: HandlerSpec, settings: Settings, *, create: bool) -> None:
    """Bind to the handler's durable pull consumer, creating it when allowed.

    An existing consumer must ack explicitly and filter the handler's subject;
    anything else would break the protocol, so it is an error, not a warning.
    """
    try:
        info = await js.consumer_info(spec.stream, spec.durable)
    except nats.js.errors.NotFoundError:
        if not create:
            raise errors.ConfigurationError(
                f"consumer {spec.durable!r} on stream {spec.stream!r} does not exist"
            ) from None
    else:
        _check_consumer(info.config, spec)
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
    )
    await js.add_consumer(spec.stream, config)


def _check_consumer(config: Any, spec: HandlerSpec) -> None:
    if config.ack_policy != api.AckPolicy.EXPLICIT:
        raise errors.ConfigurationError(
            f"consumer {spec.durable!r} must use AckPolicy explicit, not {config.ack_policy}"
        )
    filters = set(config.filter_subjects or []) | (
        {config.filter_subject} if config.filter_subject else set()
    )
    if filters and spec.subject not in filters:
        raise errors.ConfigurationError(
            f"consumer {spec.durable!r} filters {sorted(filters)}, "
            f"but handler {spec.name!r} subscribes to {spec.subject!r}"
        )


async def subscribe(js: Any, spec: HandlerSpec) -> Any:
    """A pull subscription bound to the handler's durable consumer."""
    return await js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)
