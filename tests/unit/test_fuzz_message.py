"""Fuzz: a Message built from any bytes and headers decodes, hashes and keys without surprise."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eop import errors, message, payload, redaction, testing
from eop.pg import contract

# What a header map from nats-py can hold: any text, NUL and lone surrogates' stand-ins included.
header_text = st.text(st.characters(codec="utf-8"), max_size=40)
headers = st.dictionaries(header_text, header_text, max_size=6)
msg_ids = st.one_of(st.none(), st.just(""), header_text)
payloads = st.one_of(
    st.binary(max_size=2048),
    st.builds(
        lambda v: json.dumps(v).encode(),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
            lambda kids: (
                st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
            ),
            max_leaves=20,
        ),
    ),
)


def build(data: bytes, hdrs: dict[str, str], msg_id: str | None, seq: int = 7) -> message.Message:
    if msg_id is not None:
        hdrs = {**hdrs, message.MSG_ID_HEADER: msg_id}
    delivery = testing.FakeDelivery.make(data=data, subject="orders.new", headers=hdrs, seq=seq)
    return message.from_nats(delivery, subscription="fuzz", stream_epoch="e1")


@given(data=payloads, hdrs=headers, msg_id=msg_ids)
def test_any_delivery_builds_a_message_postgres_can_store(
    data: bytes, hdrs: dict[str, str], msg_id: str | None
) -> None:
    """No NUL survives into headers or subject (PostgreSQL text and jsonb refuse it)."""
    msg = build(data, hdrs, msg_id)
    assert msg.data == data
    for key, value in msg.headers.items():
        assert "\x00" not in key
        assert "\x00" not in value
    assert msg.msg_id is None or "\x00" not in msg.msg_id
    # The dead letter's headers are stored as jsonb: they must round-trip through JSON.
    stored = json.loads(json.dumps(redaction.redact_headers(msg.headers)))
    assert set(stored) == set(msg.headers)


@given(data=payloads, hdrs=headers, msg_id=msg_ids, delivered=st.integers(1, 1000))
def test_fingerprint_and_idempotency_key_are_stable_across_deliveries(
    data: bytes, hdrs: dict[str, str], msg_id: str | None, delivered: int
) -> None:
    msg = build(data, hdrs, msg_id)
    again = dataclasses.replace(msg, num_delivered=delivered, headers=dict(msg.headers))
    assert len(msg.fingerprint) == 32
    assert again.fingerprint == msg.fingerprint
    assert (
        again.idempotency_key
        == msg.idempotency_key
        == "fuzz:ORDERS:e1:7".replace("ORDERS", msg.stream)
    )


@given(data=payloads)
def test_text_and_json_either_decode_or_raise_undecodable(data: bytes) -> None:
    """Never another exception: the worker dead-letters UndecodableMessage at once."""
    msg = build(data, {}, None)
    for decode in (msg.text, msg.json):
        with contextlib.suppress(errors.UndecodableMessage):
            decode()


@dataclasses.dataclass
class Point:
    x: int
    y: float | None = None
    tags: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Shape:
    name: str
    points: list[Point]
    meta: dict[str, Any] | None = None


class Model(pydantic.BaseModel):
    name: str
    points: list[int]


async def dataclass_handler(shape: Shape, session: Any) -> None: ...


async def pydantic_handler(model: Model, session: Any) -> None: ...


@pytest.mark.parametrize(
    "func", [dataclass_handler, pydantic_handler], ids=["dataclass", "pydantic"]
)
@settings(max_examples=100)
@given(data=payloads)
def test_typed_decoding_either_returns_the_type_or_raises_undecodable(
    func: Any, data: bytes
) -> None:
    binding = payload.bind(func, batch=False, handler="fuzz")
    assert binding is not None
    try:
        value, _ = binding.arguments([build(data, {}, None)])
    except errors.UndecodableMessage as exc:
        problem = str(exc)
    else:
        assert isinstance(value, (Shape, Model))
        return
    assert problem.startswith(("payload does not validate", "payload is not valid JSON"))


@given(text=st.text(max_size=200))
def test_dead_letter_text_is_storable(text: str) -> None:
    dead = contract.DeadLetter(reason="rejected", error=text, traceback=text)
    assert "\x00" not in dead.error
    assert dead.traceback is not None
    assert "\x00" not in dead.traceback
