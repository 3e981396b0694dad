"""Text off the NATS wire that is not UTF-8: decoded losslessly, named, stored as valid text."""

from __future__ import annotations

import asyncio
import json
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from eop import message, wire
from eop.pg import models
from eop.types import Outcome

from . import support


@given(st.binary())
def test_decode_is_lossless_for_any_bytes(raw: bytes) -> None:
    """Every byte string decodes, and encodes back to itself."""
    assert wire.decode(raw).encode("utf-8", "surrogateescape") == raw


@given(st.binary())
def test_storable_text_is_valid_utf8_without_nul_and_json_safe(raw: bytes) -> None:
    """What PostgreSQL text and jsonb refuse (NUL, bytes not UTF-8) never survives storable."""
    text = wire.storable(wire.decode(raw))
    text.encode("utf-8")  # strict: raises on a leftover surrogate
    assert "\x00" not in text
    assert json.loads(json.dumps(text, ensure_ascii=False)) == text


def test_storable_puts_one_replacement_per_bad_byte_as_the_jetstream_api_json_does() -> None:
    """The server's JSON shows each byte that is not UTF-8 as one U+FFFD; so does storable."""
    assert wire.storable(wire.decode(b"a.\xff\xe2\x82.b")) == "a.\ufffd\ufffd\ufffd.b"
    assert wire.storable("valid.\u00e9.\ufffd") == "valid.\u00e9.\ufffd"
    assert wire.storable("nul\x00") == "nul\ufffd"


def test_valid_text_is_not_escaped() -> None:
    """Valid UTF-8, ASCII or not, is never taken for bad bytes."""
    assert not wire.escaped(wire.decode("orders.\u00e9\u4e2d\U0001f600".encode()))
    assert wire.escaped(wire.decode(b"orders.\xff"))


@pytest.mark.parametrize(
    ("subject", "headers", "expected"),
    [
        (b"orders.\xff", None, "subject is not valid UTF-8 (byte 0xff at offset 7)"),
        (b"o", {b"X-\xfe": b"v"}, "a header name is not valid UTF-8 (byte 0xfe at offset 2)"),
        (b"o", {b"X-Bad": b"ab\xc3"}, "header X-Bad is not valid UTF-8 (byte 0xc3 at offset 2)"),
        (b"orders.\xc3\xa9", {b"X": b"\xc3\xa9"}, None),
    ],
    ids=["subject", "header-name", "header-value", "valid"],
)
def test_problem_names_the_part_the_byte_and_its_offset_never_the_content(
    subject: bytes, headers: dict[bytes, bytes] | None, expected: str | None
) -> None:
    """The dead letter's error says what is wrong and where, without quoting a value."""
    decoded = {wire.decode(k): wire.decode(v) for k, v in (headers or {}).items()}
    assert wire.problem(wire.decode(subject), decoded or None) == expected


def test_parse_headers_keeps_every_byte_and_nats_py_shape() -> None:
    """Names and values keep bad bytes as escapes; an inline status is parsed as nats-py does."""
    block = b"NATS/1.0\r\nX-Bad: a\xffb\r\nX-\xfe: v\r\nNats-Msg-Id: id-1\r\nno colon\r\n\r\n"
    parsed = wire.parse_headers(block)
    assert parsed == {"X-Bad": "a\udcffb", "X-\udcfe": "v", "Nats-Msg-Id": "id-1"}
    status = wire.parse_headers(b"NATS/1.0 100 Idle \xff\r\nX: y\r\n\r\n")
    assert status == {"Status": "100", "Description": "Idle \udcff", "X": "y"}


def test_from_nats_stores_bad_bytes_as_replacement_characters() -> None:
    """The Message built for a dead letter holds valid text; undecodable names the problem."""
    raw = support.delivery(
        subject=wire.decode(b"orders.\xff"),
        headers={"X-Bad": wire.decode(b"a\xff"), "Nats-Msg-Id": "m"},
    )
    msg = message.from_nats(raw, subscription="s", stream_epoch="e")
    assert msg.subject == "orders.\ufffd"
    assert msg.headers == {"X-Bad": "a\ufffd", "Nats-Msg-Id": "m"}
    assert message.undecodable(raw) == "subject is not valid UTF-8 (byte 0xff at offset 7)"


async def test_a_delivery_with_bad_bytes_is_dead_lettered_once_and_never_handled(
    harness: support.Harness,
) -> None:
    """Undecodable subject: one undecodable dead letter, termed; the handler is never called."""
    d = support.delivery(subject=wire.decode(b"orders.\xff"))
    assert await harness.handle(d) is Outcome.DEAD_LETTERED
    assert harness.calls == []
    [dead] = harness.store.dead_letters
    assert dead.reason == models.REASON_UNDECODABLE
    assert dead.error == "subject is not valid UTF-8 (byte 0xff at offset 7)"
    assert d.termed
    assert await harness.handle(d.redeliver()) is Outcome.DUPLICATE
    assert harness.calls == []


async def test_a_connection_that_says_connected_but_whose_read_loop_ended_is_not_reading() -> None:
    """What /readyz's nats_connected check adds to is_connected: the reading task still runs."""
    loop = asyncio.get_running_loop()
    ended, reading = loop.create_future(), loop.create_future()
    ended.set_result(None)
    assert not wire.reading(types.SimpleNamespace(is_connected=True, _reading_task=ended))
    assert wire.reading(types.SimpleNamespace(is_connected=True, _reading_task=reading))
    # Reconnecting or closed: nats-py ended the loop itself, is_connected already says so.
    assert wire.reading(types.SimpleNamespace(is_connected=False, _reading_task=ended))
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
    ours = wire.Delivered(_client=None, reply=reply).metadata  # type: ignore[arg-type]
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
        _ = wire.Delivered(_client=None, reply="_INBOX.x").metadata  # type: ignore[arg-type]


def test_status_of_reads_the_inline_status_of_a_raw_header_block() -> None:
    """The no-responders reply of a confirmed ack is told apart from a plain reply, as bytes."""
    assert wire.status_of(b"NATS/1.0 503\r\n\r\n") == b"503"
    assert wire.status_of(b"NATS/1.0 503 No Responders\r\n\r\n") == b"503"
    assert wire.status_of(b"NATS/1.0\r\nX: y\r\n\r\n") is None
    assert wire.status_of(None) is None
