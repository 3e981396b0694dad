"""Text off the NATS wire that is not UTF-8: decoded losslessly, named, stored as valid text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
