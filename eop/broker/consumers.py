"""Handlers' durable pull consumers: bound or created, checked against what the
protocol needs (explicit acks, the handler's subject, every message delivered, no
server-side delivery limit) and given the AckWait the workers time leases by."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api

from eop import errors, log
from eop.broker import fetcher, jetstream
from eop.handler import HandlerSpec
from eop.settings import Settings


async def ensure_consumer(
    js: JetStreamContext, spec: HandlerSpec, settings: Settings, *, create: bool
) -> None:
    """Bind to the handler's durable pull consumer, creating it when allowed.

    An existing consumer must ack explicitly and filter the handler's subject;
    anything else would break the protocol, so it is an error, not a warning.
    """
    with jetstream.translated(f"consumer {spec.durable!r} on stream {spec.stream!r}"):
        subjects = await stream_subjects(js, spec.stream)
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
            subjects = await stream_subjects(js, spec.stream)
            hint = (
                f" (stream {spec.stream!r} holds subjects {', '.join(subjects)}: the handler's "
                f"subject {spec.subject} must fall under one of them)"
                if subjects is not None
                else ""
            )
            raise errors.ConfigurationError(
                f"cannot create consumer {spec.durable!r} on stream {spec.stream!r} for "
                f"handler {spec.name!r}: {jetstream.describe(exc)}{hint}"
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


async def stream_subjects(js: JetStreamContext, stream: str) -> list[str] | None:
    try:
        info = await js.stream_info(stream)
    except jetstream.NATS_ERRORS:
        return None
    return list(info.config.subjects or [])


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
