"""The outbox for operators: its backlog, and the parked rows (``eop outbox``).

A parked row was refused for good (too large, a header NATS rejects) or its
subject had no stream on every try: it waits here, never sent, until it is
retried (``eop outbox retry``, after fixing the cause: a stream for the
subject, a larger max_payload) or purged.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from typing import Any, Literal

from eop.app import App
from eop.ops import tables
from eop.outbox import sql
from eop.pg import models

State = Literal["parked", "pending", "published", "all"]

_COLUMNS = (
    "id",
    "msg_id",
    "subject",
    "bytes",
    "created_at",
    "attempts",
    "parked_at",
    "park_reason",
    "last_error",
    "published_at",
    "stream",
    "stream_seq",
)


@dataclasses.dataclass(frozen=True)
class Backlog:
    """How far the outbox is behind, and who publishes it."""

    pending: int
    oldest_s: float | None
    """Age of the oldest unpublished row (None: none)."""
    parked: int
    relay: str | None
    """The relay holding the lease (None: no relay is publishing)."""
    lease_expires_in_s: float | None = None
    """When the holder's lease runs out unless renewed (every third of it while it runs)."""

    def to_json(self) -> dict[str, Any]:
        """As JSON-able values."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for ``eop status``."""
        oldest = f", oldest {self.oldest_s:.1f} s old" if self.oldest_s is not None else ""
        relay = "no relay publishing"
        if self.relay:
            expiry = self.lease_expires_in_s or 0.0
            relay = f"relay {self.relay} (lease renewed within {expiry:.1f} s, or it is gone)"
        line = (
            f"outbox: {self.pending} pending{oldest}; {count_text(self.parked, 'parked')}; {relay}"
        )
        if self.parked:
            line += "\noutbox: WARNING: parked rows are never sent: see `eop outbox list`"
        if self.pending and not self.relay:
            line += "\noutbox: WARNING: rows wait, but no relay runs (`eop worker` or `eop relay`)"
        return line


class Outbox:
    """The outbox of an app's schema."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.tables = models.tables(app.settings.schema)

    async def backlog(self) -> Backlog:
        """Pending and parked rows, the oldest pending one's age, the lease's holder."""
        async with self.app.engine.connect() as conn:
            row = (await conn.execute(sql.summary(self.tables))).one()
        pending, oldest, parked, holder, expires_in = row
        return Backlog(
            pending=int(pending),
            oldest_s=float(oldest) if oldest is not None else None,
            parked=int(parked),
            relay=holder,
            lease_expires_in_s=float(expires_in) if expires_in is not None else None,
        )

    async def rows(
        self,
        state: State,
        *,
        ids: Sequence[int] = (),
        subject: str | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """Rows in ``state`` (oldest first), without their payloads."""
        conditions = sql.where(self.tables, state=state, ids=ids, subject=subject)
        async with self.app.engine.connect() as conn:
            result = await conn.execute(sql.select_rows(self.tables, conditions, limit))
            return [dict(zip(_COLUMNS, row, strict=True)) for row in result]

    async def retry(self, *, ids: Sequence[int] = (), subject: str | None = None) -> list[int]:
        """Queue parked rows again (all parked ones, or those named); their ids."""
        conditions = sql.where(self.tables, state="parked", ids=ids, subject=subject)
        async with self.app.engine.begin() as conn:
            return [int(r[0]) for r in await conn.execute(sql.unpark(self.tables, conditions))]

    async def purge(
        self, state: State, *, ids: Sequence[int] = (), subject: str | None = None
    ) -> list[int]:
        """Delete rows in ``state`` (parked ones, or published ones early); their ids."""
        conditions = sql.where(self.tables, state=state, ids=ids, subject=subject)
        async with self.app.engine.begin() as conn:
            return [int(r[0]) for r in await conn.execute(sql.delete_rows(self.tables, conditions))]


def count_text(count: int, what: str) -> str:
    """``1 parked row``, ``2 parked rows``."""
    return tables.counted(count, f"{what} row")


def to_json(row: dict[str, Any]) -> dict[str, Any]:
    """A row as JSON-able values (times in ISO 8601, UTC)."""
    return {k: _iso(v) if isinstance(v, datetime.datetime) else v for k, v in row.items()}


def _iso(value: datetime.datetime) -> str:
    return value.astimezone(datetime.timezone.utc).isoformat()


_TABLE = (
    ("ID", "id"),
    ("SUBJECT", "subject"),
    ("BYTES", "bytes"),
    ("CREATED (UTC)", "created_at"),
    ("STATE", "state"),
    ("ATTEMPTS", "attempts"),
    ("ERROR", "last_error"),
)


def format_table(rows: Sequence[dict[str, Any]], *, error_width: int = 90) -> str:
    """Rows as an aligned text table."""
    cells = [[title for title, _ in _TABLE]]
    for row in rows:
        cells.append([_cell(key, row, error_width) for _, key in _TABLE])
    return "\n".join(tables.aligned(cells))


def _cell(key: str, row: dict[str, Any], error_width: int) -> str:
    if key == "state":
        if row["published_at"] is not None:
            return f"published {row['stream']}:{row['stream_seq']}"
        if row["parked_at"] is not None:
            return f"parked ({row['park_reason']})"
        return "pending"
    if key == "last_error" and row["published_at"] is not None:
        return ""  # a refusal it got over
    return tables.text(row.get(key), error_width)
