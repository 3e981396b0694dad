"""Which dead letters a command applies to: ``--id``, ``--handler``, ``--since``, ...."""

from __future__ import annotations

import dataclasses
import datetime
import re
from typing import Any

from eop import errors
from eop.pg import models
from eop.pg.sql import dead_letters as dead_letters_sql

_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)([smhdw]))", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_when(text: str, now: datetime.datetime | None = None) -> datetime.datetime:
    """A point in time from an ISO 8601 time (UTC if naive) or a duration ago (``2h``, ``1d12h``).

    Durations use the units s, m, h, d and w.
    """
    raw = text.strip()
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if raw and _DURATION.sub("", raw) == "":
        seconds = sum(float(n) * _UNIT_S[u.lower()] for n, u in _DURATION.findall(raw))
        return now - datetime.timedelta(seconds=seconds)
    try:
        # Python 3.10's fromisoformat does not take a trailing Z.
        when = datetime.datetime.fromisoformat(re.sub(r"[zZ]$", "+00:00", raw))
    except ValueError:
        raise errors.ConfigurationError(
            f"{text!r} is neither an ISO time (2026-01-31T12:00:00Z) nor a duration (2h, 30m, 7d)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when


@dataclasses.dataclass(frozen=True)
class Filters:
    """Which dead letters a command applies to (all given conditions hold)."""

    ids: tuple[int, ...] = ()
    handler: str | None = None
    reason: str | None = None
    """A case-insensitive substring of the reason or the error."""
    since: datetime.datetime | None = None
    until: datetime.datetime | None = None
    limit: int | None = None

    @property
    def empty(self) -> bool:
        """True when no condition narrows the selection (every dead letter matches)."""
        return not (self.ids or self.handler or self.reason or self.since or self.until)

    def where(self, tables: models.Tables) -> list[Any]:
        """The SQL conditions of these filters."""
        return dead_letters_sql.dead_letter_where(
            tables,
            ids=self.ids,
            handler=self.handler,
            reason=self.reason,
            since=self.since,
            until=self.until,
        )
