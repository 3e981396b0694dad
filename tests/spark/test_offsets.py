"""Planning of the jetstream source: options, offsets, ranges (pure functions)."""

from __future__ import annotations

import pytest

from eop import errors as eop_errors
from eop.contrib.spark import errors
from eop.contrib.spark.offsets import (
    Offset,
    SeqRange,
    SourceOptions,
    StreamState,
    batch_bounds,
    initial_offset,
    latest_offset,
    split,
)
from eop.contrib.spark.reader import _Coverage

STATE = StreamState("ORDERS", "e1", first_seq=11, last_seq=40)


def test_options_arrive_lower_cased_and_are_checked() -> None:
    """Spark lower-cases option keys; numbers must be positive integers."""
    opts = SourceOptions.parse(
        {"stream": "ORDERS", "startsequence": "5", "maxmessagesperbatch": "100", "natsurl": "n"}
    )
    assert (opts.start_seq, opts.max_per_batch, opts.nats_url) == (5, 100, "n")
    with pytest.raises(eop_errors.ConfigurationError, match="stream"):
        SourceOptions.parse({})
    with pytest.raises(eop_errors.ConfigurationError, match="at least 1"):
        SourceOptions.parse({"stream": "S", "endsequence": "0"})


def test_a_batch_reads_what_is_stored_between_the_requested_sequences() -> None:
    """Defaults: the stream's first to last; the end is inclusive and clamped to the last."""
    assert batch_bounds(SourceOptions("ORDERS"), STATE) == (11, 41)
    assert batch_bounds(SourceOptions("ORDERS", start_seq=20, end_seq=30), STATE) == (20, 31)
    assert batch_bounds(SourceOptions("ORDERS", start_seq=20, end_seq=99), STATE) == (20, 41)
    assert batch_bounds(SourceOptions("ORDERS", start_seq=50), STATE) == (50, 50)


def test_a_batch_asking_for_removed_sequences_fails() -> None:
    """Sequences below the stream's first were removed: an error, not fewer rows."""
    with pytest.raises(errors.RangeUnavailable, match=r"sequences 5\.\.10"):
        batch_bounds(SourceOptions("ORDERS", start_seq=5), STATE)


def test_micro_batches_respect_the_read_limit_and_the_available_now_bound() -> None:
    """At most max_rows sequences, never past `until`, never backwards."""
    start = initial_offset(SourceOptions("ORDERS"), STATE)
    assert start == Offset("ORDERS", "e1", 11)
    assert latest_offset(start, STATE).seq == 41
    assert latest_offset(start, STATE, max_rows=10).seq == 21
    assert latest_offset(start, STATE, until=15).seq == 15
    assert latest_offset(Offset("ORDERS", "e1", 41), STATE, max_rows=10).seq == 41


def test_a_query_behind_retention_or_on_a_recreated_stream_fails() -> None:
    """Offsets of removed messages, or of another epoch, stop the query loudly."""
    with pytest.raises(errors.RangeUnavailable):
        latest_offset(Offset("ORDERS", "e1", 3), STATE)
    with pytest.raises(errors.StreamRecreated):
        latest_offset(Offset("ORDERS", "e0", 20), STATE)


def test_offsets_round_trip_through_json() -> None:
    """Spark checkpoints offsets as JSON dicts."""
    offset = Offset("ORDERS", "e1", 7)
    assert Offset.from_json(offset.to_json()) == offset


def test_ranges_split_into_partitions() -> None:
    """At most `size` sequences each, covering the range exactly; none when empty."""
    ranges = split("S", "e", None, 1, 26, 10)
    assert [(r.start, r.end) for r in ranges] == [(1, 11), (11, 21), (21, 26)]
    assert split("S", "e", None, 5, 5, 10) == []


def test_a_read_overtaken_by_retention_is_detected_after_the_fact() -> None:
    """Undelivered sequences now below the stream's first may have been lost: fail."""
    seqs = SeqRange("S", "e1", None, 10, 20)
    coverage = _Coverage(10)
    for seq in (10, 11, 13, 14):
        coverage.saw(seq)
    assert coverage.first_unseen == 12
    coverage.check(seqs, StreamState("S", "e1", first_seq=12, last_seq=30))
    with pytest.raises(errors.RangeUnavailable, match="while they were being read"):
        coverage.check(seqs, StreamState("S", "e1", first_seq=13, last_seq=30))
