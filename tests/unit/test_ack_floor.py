"""A consumer's ack floor as eop reads it from NATS (eop.broker.floors), no servers."""

from __future__ import annotations

from eop.broker import floors


def test_a_consumer_created_at_a_start_sequence_has_acked_everything_below_it() -> None:
    """A replicated consumer created at sequence 40 says its ack floor is 0 until it acks
    one (a single server says 39): eop reads 39 either way, and above it what the server
    says."""
    assert floors.ack_floor(0, 40) == 39
    assert floors.ack_floor(39, 40) == 39
    assert floors.ack_floor(57, 40) == 57
    assert floors.ack_floor(0, None) == 0
    assert floors.ack_floor(0, 1) == 0


def test_the_start_sequence_counts_only_for_a_consumer_that_starts_at_one() -> None:
    """Only the by_start_sequence policy starts a consumer at opt_start_seq; a raw
    CONSUMER.INFO of a replicated consumer gives the raised floor."""
    start = {"deliver_policy": "by_start_sequence", "opt_start_seq": 40}
    assert floors.start_seq(start) == 40
    assert floors.start_seq({"deliver_policy": "all", "opt_start_seq": 40}) is None
    assert floors.start_seq({}) is None
    info = {"config": start, "ack_floor": {"stream_seq": 0}, "delivered": {"stream_seq": 0}}
    assert floors.from_info("c", info).floor == 39
    assert floors.from_info("c", {**info, "config": {"deliver_policy": "all"}}).floor == 0
