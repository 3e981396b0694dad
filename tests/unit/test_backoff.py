"""The retry policy: one backoff formula (doubling, capped), its jitter, tenacity's wait."""

from __future__ import annotations

import random

import pytest
import tenacity

from eop import backoff


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (8, 60.0), (100, 60.0)],
)
def test_backoff_doubles_with_each_attempt_up_to_the_cap(attempt: int, expected: float) -> None:
    assert backoff.backoff_s(attempt, 0.5, 60.0) == expected


def test_backoff_of_a_first_or_unknown_attempt_is_the_base() -> None:
    assert backoff.backoff_s(0, 0.5, 60.0) == 0.5
    assert backoff.backoff_s(-3, 0.5, 60.0) == 0.5


def test_backoff_of_a_huge_attempt_count_stays_capped() -> None:
    assert backoff.backoff_s(10**9, 0.5, 60.0) == 60.0


def test_backoff_is_a_float() -> None:
    assert isinstance(backoff.backoff_s(2, 1, 60), float)


def test_backoff_never_exceeds_a_cap_below_the_base() -> None:
    """The cap wins even over the first delay."""
    assert backoff.backoff_s(1, 5.0, 2.0) == 2.0


@pytest.mark.parametrize("attempt", [1, 2, 5, 40])
def test_jitter_lies_between_half_the_backoff_and_all_of_it(attempt: int) -> None:
    """The jittered delay spans [backoff/2, backoff): its ends at the ends of rand's range."""
    full = backoff.backoff_s(attempt, 0.5, 60.0)
    assert backoff.jittered_s(attempt, 0.5, 60.0, rand=lambda: 0.0) == full / 2
    assert backoff.jittered_s(attempt, 0.5, 60.0, rand=lambda: 1.0) == full
    rng = random.Random(7)
    for _ in range(200):
        assert full / 2 <= backoff.jittered_s(attempt, 0.5, 60.0, rand=rng.random) <= full


def test_jitter_spreads_the_delays() -> None:
    """Two retries of the same attempt do not wait alike (they would collide again)."""
    rng = random.Random(3)
    assert len({backoff.jittered_s(3, 0.5, 60.0, rand=rng.random) for _ in range(20)}) > 1


def test_tenacity_wait_is_the_backoff_of_the_failed_attempt() -> None:
    """tenacity's attempt numbers start at 1: its waits are backoff_s of 1, 2, 3, ..."""
    wait = backoff.wait(0.05, 1.0)
    retrying = tenacity.Retrying()
    waits = []
    for number in range(1, 8):
        state = tenacity.RetryCallState(retrying, fn=None, args=(), kwargs={})
        state.attempt_number = number
        waits.append(wait(state))
    assert waits == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
