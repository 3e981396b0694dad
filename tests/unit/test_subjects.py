"""NATS subject matching: the one matcher behind stream coverage, DLQ fan-out and Spark's skip."""

from __future__ import annotations

import pytest

from eop.broker.consumers import subject_matches


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("ORDERS.created", "ORDERS.created", True),
        ("ORDERS.created", "ORDERS.cancelled", False),
        ("ORDERS.updated", "ORDERS.created", False),
        ("ORDERS.*", "ORDERS.created", True),
        ("*.created", "ORDERS.created", True),
        ("ORDERS.>", "ORDERS.created.eu", True),
        ("ORDERS.>", "ORDERS.created", True),
        (">", "ORDERS.created", True),
        (">", "ORDERS", True),
    ],
)
def test_wildcards_match_as_nats_does(pattern: str, subject: str, matches: bool) -> None:
    """A literal token matches itself; ``*`` one token; a final ``>`` one or more."""
    assert subject_matches(pattern, subject) is matches


@pytest.mark.parametrize(
    ("pattern", "subject"),
    [
        ("ORDERS.*", "ORDERS.created.eu"),  # `*` is exactly one token
        ("ORDERS.*", "ORDERS"),  # ... not none
        ("*", "ORDERS.created"),
        ("ORDERS.>", "ORDERS"),  # `>` is one or more tokens, not none
        ("ORDERS.created.eu", "ORDERS.created"),  # a longer pattern
        ("ORDERS", "ORDERS.created"),  # a shorter pattern
    ],
)
def test_token_counts_must_agree(pattern: str, subject: str) -> None:
    """``*`` stands for exactly one token and ``>`` for at least one."""
    assert subject_matches(pattern, subject) is False


def test_gt_is_a_wildcard_only_as_the_last_token() -> None:
    """``>`` inside a pattern is no wildcard: it matches only a literal ``>`` token."""
    assert subject_matches("ORDERS.>.eu", "ORDERS.created.eu") is False
    assert subject_matches("ORDERS.>.eu", "ORDERS.created.fr.eu") is False


@pytest.mark.parametrize(
    ("pattern", "subject"),
    [
        ("ORDERS.*", "ORDERS."),
        ("*.created", ".created"),
        ("ORDERS.*.eu", "ORDERS..eu"),
        (">", ""),
        ("ORDERS..eu", "ORDERS..eu"),
        ("", ""),
        ("ORDERS.", "ORDERS."),
    ],
)
def test_empty_tokens_match_nothing(pattern: str, subject: str) -> None:
    """A subject or pattern with an empty token is no valid NATS subject: no match."""
    assert subject_matches(pattern, subject) is False


@pytest.mark.parametrize(
    ("stream_subject", "filter_subject", "covered"),
    [
        ("ORDERS.>", "ORDERS.>", True),
        ("ORDERS.>", "ORDERS.*", True),
        ("ORDERS.>", "ORDERS.*.eu", True),
        (">", "ORDERS.>", True),
        ("ORDERS.*", "ORDERS.*", True),
        ("ORDERS.*", "ORDERS.>", False),  # `>` reaches deeper than one token
        ("ORDERS.*.eu", "ORDERS.*.>", False),
        ("ORDERS.created", "ORDERS.*", False),  # `*` stands for more than one subject
        ("ORDERS.>", "ORDERS", False),
    ],
)
def test_a_filter_matches_when_the_pattern_matches_every_subject_it_does(
    stream_subject: str, filter_subject: str, covered: bool
) -> None:
    """A consumer's filter is within a stream's subject only if all it stands for is."""
    assert subject_matches(stream_subject, filter_subject) is covered
