"""eop.publish without a server: which error a publish that no stream answered becomes."""

from __future__ import annotations

import json
from typing import Any

import nats.errors
import nats.js.errors
import pytest

import eop


class _Reply:
    def __init__(self, data: bytes) -> None:
        self.data = data


class _JetStream:
    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        raise nats.js.errors.NoStreamResponseError


class _Client:
    """A connection whose publishes get no stream's answer, and a STREAM.NAMES reply."""

    max_payload = 1024 * 1024

    def __init__(self, names: Any) -> None:
        self._names = names  # the reply's JSON, raw bytes, or the error the request raises
        self.requests: list[tuple[str, bytes]] = []

    def jetstream(self) -> _JetStream:
        return _JetStream()

    async def request(self, subject: str, payload: bytes, timeout: float) -> _Reply:
        self.requests.append((subject, payload))
        if isinstance(self._names, BaseException):
            raise self._names
        if isinstance(self._names, bytes):
            return _Reply(self._names)
        return _Reply(json.dumps(self._names).encode())


async def test_no_answer_from_a_stream_that_holds_the_subject_is_unavailable_not_config() -> None:
    """During a leader election the stream holding the subject does not answer: that is
    eop.NatsUnavailable (retry with the same msg_id), never a ConfigurationError that
    tells the user to fix a stream they have."""
    nc = _Client({"total": 1, "streams": ["ORDERS"]})
    with pytest.raises(eop.NatsUnavailable, match=r"no leader.*same msg_id"):
        await eop.publish(nc, "ORDERS.created", b"{}", msg_id="m1")  # type: ignore[arg-type]  # a fake client
    assert nc.requests == [("$JS.API.STREAM.NAMES", b'{"subject": "ORDERS.created"}')]


@pytest.mark.parametrize("names", [nats.errors.TimeoutError(), b"not json"])
async def test_no_answer_when_jetstream_cannot_say_which_stream_is_unavailable(names: Any) -> None:
    """A STREAM.NAMES that times out or answers garbage leaves the publish a retry."""
    with pytest.raises(eop.NatsUnavailable):
        await eop.publish(_Client(names), "ORDERS.created", b"{}")  # type: ignore[arg-type]  # a fake client


@pytest.mark.parametrize("names", [{"total": 0, "streams": None}, nats.errors.NoRespondersError()])
async def test_no_answer_when_no_stream_holds_the_subject_is_a_configuration_error(
    names: Any,
) -> None:
    """No stream holds the subject (or JetStream is off): ConfigurationError, as before."""
    with pytest.raises(eop.ConfigurationError, match="no stream holds it"):
        await eop.publish(_Client(names), "NOWHERE.x", b"{}")  # type: ignore[arg-type]  # a fake client
