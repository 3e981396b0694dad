"""The relay's publishing seam: what JetStream's answers come to, row by row.

A fake NATS connection stands in for the server: what is checked here is the
mapping from nats-py's answers to receipts, which has no I/O of its own. The
real server's answers are in tests/integration/test_outbox.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats.js.errors

from eop.outbox import jetstream_publisher
from eop.outbox.publishing import (
    PARK_BAD_HEADER,
    PARK_NO_STREAM,
    PARK_REFUSED,
    PARK_TOO_LARGE,
    Fate,
    Receipt,
    Row,
)
from eop.settings import Settings

SETTINGS = Settings(outbox_batch=10, publish_timeout_s=0.2)


class _Ack:
    def __init__(self, seq: int) -> None:
        self.stream = "OUT"
        self.seq = seq


class _JetStream:
    """Answers each subject as ``answers`` says: an int is a PubAck's sequence, an
    exception is raised on the future, None is never answered."""

    def __init__(self, answers: dict[str, object], streams: set[str]) -> None:
        self.answers = answers
        self.streams = streams
        self.sent: list[str] = []
        self.looked_up: list[str] = []

    async def publish_async(self, subject: str, payload: bytes, headers: Any) -> Any:
        self.sent.append(subject)
        assert headers["Nats-Msg-Id"]
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        answer = self.answers[subject]
        if isinstance(answer, int):
            future.set_result(_Ack(answer))
        elif isinstance(answer, BaseException):
            future.set_exception(answer)
        return future

    async def find_stream_name_by_subject(self, subject: str) -> str:
        self.looked_up.append(subject)
        if subject in self.streams:
            return "SOMEWHERE"
        raise nats.js.errors.NotFoundError(code=404, description="no stream matches subject")


class _Nats:
    def __init__(self, js: _JetStream, *, connected: bool = True) -> None:
        self.js = js
        self.max_payload = 200
        self.is_connected = connected

    def jetstream(self, **_: object) -> _JetStream:
        return self.js


def _row(i: int, subject: str, payload: bytes = b"x", headers: dict[str, str] | None = None) -> Row:
    return Row(i, f"m{i}", subject, headers or {}, payload, attempts=0)


def _publisher(js: _JetStream, *, connected: bool = True) -> jetstream_publisher.JetStreamPublisher:
    nc: Any = _Nats(js, connected=connected)  # the attributes and the method the publisher uses
    return jetstream_publisher.JetStreamPublisher(nc, SETTINGS)


async def test_jetstreams_answers_become_a_receipt_per_row_in_the_rows_order() -> None:
    """A PubAck is published at its sequence; too large, by the client's max_payload or the
    server's error 10054, and a subject or header NATS cannot frame are parked without a
    send; no stream (as JetStream confirms) and another 4xx are refused, to be counted; a
    5xx or no answer in time is unanswered."""
    js = _JetStream(
        {
            "OK.a": 7,
            "GONE.a": nats.js.errors.NoStreamResponseError(),
            "BIG.a": nats.js.errors.APIError(code=400, err_code=10054, description="too big"),
            "FULL.a": nats.js.errors.APIError(code=400, description="maximum messages"),
            "DOWN.a": nats.js.errors.APIError(code=503, description="no leader"),
            "SLOW.a": None,
        },
        streams=set(),
    )
    rows = [
        _row(1, "OK.a"),
        _row(2, "GONE.a"),
        _row(3, "HUGE.a", b"y" * 300),
        _row(4, "BAD .subject"),
        _row(5, "OK.a", headers={"Bad Name": "v"}),
        _row(6, "BIG.a"),
        _row(7, "FULL.a"),
        _row(8, "DOWN.a"),
        _row(9, "SLOW.a"),
    ]
    receipts = await _publisher(js).publish(rows)
    assert [(r.fate, r.reason) for r in receipts] == [
        (Fate.PUBLISHED, ""),
        (Fate.REFUSED, PARK_NO_STREAM),
        (Fate.PARKED, PARK_TOO_LARGE),
        (Fate.PARKED, PARK_REFUSED),
        (Fate.PARKED, PARK_BAD_HEADER),
        (Fate.PARKED, PARK_TOO_LARGE),
        (Fate.REFUSED, PARK_REFUSED),
        (Fate.UNANSWERED, ""),
        (Fate.UNANSWERED, ""),
    ]
    assert receipts[0] == Receipt.published("OUT", 7)
    assert receipts[1].error == "no stream holds subject GONE.a"
    assert js.sent == ["OK.a", "GONE.a", "BIG.a", "FULL.a", "DOWN.a", "SLOW.a"]


async def test_no_responders_not_confirmed_by_jetstream_hold_the_subject_uncounted() -> None:
    """'No responders' while a stream exists for the subject (JetStream restarting) is
    held, not refused; JetStream is asked once per subject."""
    js = _JetStream({"BACK.a": nats.js.errors.NoStreamResponseError()}, streams={"BACK.a"})
    receipts = await _publisher(js).publish([_row(1, "BACK.a"), _row(2, "BACK.a")])
    assert [r.fate for r in receipts] == [Fate.HELD, Fate.HELD]
    assert js.looked_up == ["BACK.a"]


async def test_nothing_is_sent_while_nats_is_not_connected() -> None:
    """Disconnected, rows are unsent: nats-py would take a publish slot it never gives back."""
    js = _JetStream({"OK.a": 1}, streams=set())
    receipts = await _publisher(js, connected=False).publish([_row(1, "OK.a")])
    assert [r.fate for r in receipts] == [Fate.UNSENT]
    assert js.sent == []
