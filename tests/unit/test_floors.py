"""The stuck-delivery rule on a recorded ack floor (no servers)."""

from __future__ import annotations

import datetime

from eop.pg.floors import Observed, waited_s

NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.timezone.utc)
CREATED = NOW - datetime.timedelta(days=1)


def row(floor: int = 20, waited: float | None = 100.0) -> Observed:
    """A consumer recorded at ``floor``, its delivery above waiting ``waited`` s."""
    return Observed(
        consumer="eop-orders",
        partition=None,
        consumer_created=CREATED,
        floor=floor,
        delivered=25,
        waiting_since=None if waited is None else NOW - datetime.timedelta(seconds=waited),
        waited_s=waited,
        observed_at=NOW,
    )


def test_a_wait_holds_while_the_floor_is_where_it_began() -> None:
    """Same floor, same consumer: the recorded wait is the delivery's, at least."""
    assert waited_s(row(), 20, CREATED) == 100.0
    assert waited_s(row(), 20, None) == 100.0


def test_no_wait_once_the_floor_moved_or_the_consumer_was_recreated() -> None:
    """A moved floor, a consumer of the same name created anew, or nothing recorded:
    nothing is known to have waited."""
    assert waited_s(row(), 21, CREATED) is None
    assert waited_s(row(), 20, CREATED + datetime.timedelta(seconds=5)) is None
    assert waited_s(row(waited=None), 20, CREATED) is None
    assert waited_s(None, 20, CREATED) is None
