"""The Message a handler receives: fingerprint, idempotency key, decoding."""

from __future__ import annotations

import dataclasses
import datetime

import pytest

import eop
from eop import errors, message, testing

BASE = message.Message(
    subscription="orders",
    subject="orders.new",
    data=b'{"id": 1}',
    headers={"Nats-Msg-Id": "m-1"},
    stream="ORDERS",
    stream_epoch="e1",
    seq=5,
    num_delivered=1,
)


def test_fingerprint_is_stable() -> None:
    assert BASE.fingerprint == dataclasses.replace(BASE).fingerprint
    assert len(BASE.fingerprint) == 32


@pytest.mark.parametrize(
    "change",
    [
        {"subject": "orders.old"},
        {"data": b'{"id": 2}'},
        {"headers": {"Nats-Msg-Id": "m-2"}},
        {"headers": {}},
    ],
    ids=["subject", "payload", "msg-id", "no-msg-id"],
)
def test_fingerprint_changes_with_subject_payload_and_msg_id(change: dict[str, object]) -> None:
    assert dataclasses.replace(BASE, **change).fingerprint != BASE.fingerprint  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"num_delivered": 4},
        {"seq": 6},
        {"stream_epoch": "e2"},
        {"headers": {"Nats-Msg-Id": "m-1", "X": "y"}},
    ],
    ids=["redelivery", "sequence", "epoch", "other-header"],
)
def test_fingerprint_ignores_delivery_position_and_other_headers(change: dict[str, object]) -> None:
    assert dataclasses.replace(BASE, **change).fingerprint == BASE.fingerprint  # type: ignore[arg-type]


def test_fingerprint_does_not_confuse_moved_bytes() -> None:
    """Parts are length-prefixed: moving bytes from subject to payload changes the hash."""
    a = dataclasses.replace(BASE, subject="ab", data=b"c", headers={})
    b = dataclasses.replace(BASE, subject="a", data=b"bc", headers={})
    assert a.fingerprint != b.fingerprint


def test_idempotency_key_is_the_same_for_every_delivery() -> None:
    assert dataclasses.replace(BASE, num_delivered=3).idempotency_key == BASE.idempotency_key
    assert BASE.idempotency_key == "orders:ORDERS:e1:5"


@pytest.mark.parametrize(
    "change",
    [{"subscription": "billing"}, {"stream_epoch": "e2"}, {"seq": 6}, {"stream": "OTHER"}],
)
def test_idempotency_key_differs_per_handler_and_stored_message(change: dict[str, object]) -> None:
    assert dataclasses.replace(BASE, **change).idempotency_key != BASE.idempotency_key  # type: ignore[arg-type]


def test_msg_id_is_the_nats_msg_id_header() -> None:
    assert BASE.msg_id == "m-1"
    assert dataclasses.replace(BASE, headers={}).msg_id is None


def test_json_decodes_the_payload() -> None:
    assert BASE.json() == {"id": 1}


@pytest.mark.parametrize("data", [b"{not json", b"", b"\xff\xfe\x00garbage", b'{"a": 1} trailing'])
def test_json_of_garbage_is_undecodable(data: bytes) -> None:
    with pytest.raises(errors.UndecodableMessage, match="not valid JSON"):
        dataclasses.replace(BASE, data=data).json()


def test_undecodable_is_a_reject() -> None:
    """So the processor dead-letters it at once instead of retrying."""
    assert issubclass(errors.UndecodableMessage, eop.Reject)


def test_text_decodes_utf8() -> None:
    assert dataclasses.replace(BASE, data="café".encode()).text() == "café"


def test_text_of_invalid_utf8_is_undecodable() -> None:
    with pytest.raises(errors.UndecodableMessage, match="not UTF-8"):
        dataclasses.replace(BASE, data=b"\xff").text()


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-8-sig"])
def test_json_is_utf8_only_as_for_typed_payloads(encoding: str) -> None:
    """UTF-16, UTF-32 and a byte-order mark are undecodable (dead-lettered), as for pydantic."""
    with pytest.raises(eop.UndecodableMessage):
        dataclasses.replace(BASE, data='{"id": 1}'.encode(encoding)).json()


def test_json_of_deeply_nested_garbage_is_undecodable() -> None:
    with pytest.raises(errors.UndecodableMessage):
        dataclasses.replace(BASE, data=b"[" * 100_000).json()


def test_message_is_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        BASE.seq = 6  # type: ignore[misc]


# ------------------------------------------------------------------ from_nats


def test_from_nats_copies_delivery_coordinates() -> None:
    ts = datetime.datetime(2025, 5, 1, tzinfo=datetime.timezone.utc)
    d = testing.FakeDelivery(
        subject="orders.new",
        data=b"x",
        stream="ORDERS",
        seq=9,
        num_delivered=3,
        headers={"Nats-Msg-Id": "m-9"},
        timestamp=ts,
    )
    msg = message.from_nats(d, subscription="orders", stream_epoch="e7")
    assert (msg.subscription, msg.subject, msg.data, msg.stream, msg.stream_epoch) == (
        "orders",
        "orders.new",
        b"x",
        "ORDERS",
        "e7",
    )
    assert (msg.seq, msg.num_delivered, msg.msg_id, msg.timestamp) == (9, 3, "m-9", ts)


def test_from_nats_without_headers_or_data() -> None:
    d = testing.FakeDelivery.make(data=b"")
    d.headers = None
    msg = message.from_nats(d, subscription="orders", stream_epoch="e1")
    assert (msg.headers, msg.data, msg.msg_id) == ({}, b"", None)


def test_from_nats_of_a_core_nats_message_is_undecodable() -> None:
    class CoreMsg:
        subject = "s"
        data = b""
        headers = None

        @property
        def metadata(self) -> object:
            raise ValueError("nats: not a JetStream message")

    with pytest.raises(errors.UndecodableMessage, match="not a JetStream message"):
        message.from_nats(CoreMsg(), subscription="orders", stream_epoch="e1")
