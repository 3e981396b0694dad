"""eop's NATS client: the read loop watched, a delivery's metadata read cheaply, raw replies."""

from __future__ import annotations

import asyncio
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from eop.broker import client
from eop.broker.delivered import Delivered


async def test_a_connection_that_says_connected_but_whose_read_loop_ended_is_not_reading() -> None:
    """What /readyz's nats_connected check adds to is_connected: the reading task still runs."""
    loop = asyncio.get_running_loop()
    ended, reading = loop.create_future(), loop.create_future()
    ended.set_result(None)
    assert not client.reading(types.SimpleNamespace(is_connected=True, _reading_task=ended))
    assert client.reading(types.SimpleNamespace(is_connected=True, _reading_task=reading))
    # Reconnecting or closed: nats-py ended the loop itself, is_connected already says so.
    assert client.reading(types.SimpleNamespace(is_connected=False, _reading_task=ended))
    reading.cancel()


@given(
    stream=st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True),
    consumer=st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True),
    numbers=st.tuples(*[st.integers(0, 2**63 - 1)] * 5),
    domain=st.none() | st.from_regex(r"[a-z]{1,8}", fullmatch=True),
)
def test_delivered_metadata_reads_the_reply_subject_as_nats_py_does(
    stream: str, consumer: str, numbers: tuple[int, ...], domain: str | None
) -> None:
    """The cheaper metadata parse gives every field nats-py's gives, in both reply formats."""
    delivered, sseq, cseq, ns, pending = numbers
    tail = f"{stream}.{consumer}.{delivered}.{sseq}.{cseq}.{ns}.{pending}"
    reply = f"$JS.ACK.{tail}" if domain is None else f"$JS.ACK.{domain}.ACCHASH.{tail}.token"
    ours = Delivered(_client=None, reply=reply).metadata  # type: ignore[arg-type]
    theirs = Msg(_client=None, reply=reply).metadata  # type: ignore[arg-type]
    assert (ours.stream, ours.consumer, ours.num_delivered, ours.num_pending) == (
        theirs.stream,
        theirs.consumer,
        theirs.num_delivered,
        theirs.num_pending,
    )
    assert (ours.sequence.stream, ours.sequence.consumer) == (
        theirs.sequence.stream,
        theirs.sequence.consumer,
    )
    assert ours.timestamp == theirs.timestamp
    assert ours.domain == theirs.domain


def test_a_reply_subject_that_is_not_jetstreams_has_no_metadata_as_in_nats_py() -> None:
    """Not a JetStream delivery: nats-py's error, which message.from_nats turns into undecodable."""
    with pytest.raises(NotJSMessageError):
        _ = Delivered(_client=None, reply="_INBOX.x").metadata  # type: ignore[arg-type]


def test_status_of_reads_the_inline_status_of_a_raw_header_block() -> None:
    """The no-responders reply of a confirmed ack is told apart from a plain reply, as bytes."""
    assert client.status_of(b"NATS/1.0 503\r\n\r\n") == b"503"
    assert client.status_of(b"NATS/1.0 503 No Responders\r\n\r\n") == b"503"
    assert client.status_of(b"NATS/1.0\r\nX: y\r\n\r\n") is None
    assert client.status_of(None) is None
