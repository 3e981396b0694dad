"""The messages in flight: what a failure of eop's own I/O says about them."""

from __future__ import annotations

from typing import Any

from eop.runtime import inflight

from .support import STREAM, delivery


def test_a_failed_groups_line_names_its_stream_and_sequences() -> None:
    """`message.failed` gives the stream and the first and last sequence as fetched, as
    `batch.processed` does, so an operator can find the messages it nak'ed."""
    msgs = [delivery(seq=7), delivery(seq=3), delivery(seq=9)]
    assert inflight._coordinates(msgs) == {
        "stream": STREAM,
        "first_seq": 7,
        "last_seq": 9,
        "messages": 3,
    }


def test_a_failed_groups_line_survives_metadata_it_cannot_read() -> None:
    """A delivery whose metadata cannot be read leaves the count only: a failure's line
    must not fail."""

    class Unreadable:
        @property
        def metadata(self) -> Any:
            raise ValueError("not a JetStream reply subject")

    assert inflight._coordinates([Unreadable()]) == {"messages": 1}  # type: ignore[list-item]
