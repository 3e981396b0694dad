"""The database side of the audit: one handler's recorded outcomes, by sequence range.

Inbox rows and dead letters of one epoch, the msg-id rows that stand for a
duplicate's outcome, and the inbox watermark, all read with eop's own
statements from :mod:`eop.pg.sql`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from eop import log
from eop.app import App
from eop.handler import HandlerSpec
from eop.ordering import sql as ownership_sql
from eop.pg import failures, floors, models
from eop.pg.sql import audit as audit_sql
from eop.pg.sql import inbox as inbox_sql


@dataclasses.dataclass(frozen=True)
class Recorded:
    """An inbox row or a dead letter at a sequence."""

    seq: int
    fingerprint: bytes
    outcome: str
    """The inbox outcome, or ``dead_letter`` for a row of the dead letters."""
    ref: str = ""
    """For a dead letter: its id and reason."""
    reason: str = ""
    """For a dead letter: its reason (see ``eop.pg.models.REASON_*``)."""
    error: str = ""
    """For a dead letter: the start of its error (``eop.pg.sql.audit.AUDIT_ERROR_CHARS``)."""


def _unavailable() -> contextlib.AbstractContextManager[None]:
    """PostgreSQL gone during the audit raises :class:`eop.DatabaseUnavailable`."""
    return failures.unavailable_when_unreachable(
        "PostgreSQL failed during the audit", log.describe_error
    )


class Outcomes:
    """Reads the outcomes recorded for one handler of an app."""

    def __init__(self, app: App, spec: HandlerSpec) -> None:
        self.app, self.spec = app, spec
        self.tables = models.tables(app.settings.schema)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Any]:
        """A session whose lost connection raises :class:`eop.DatabaseUnavailable`."""
        with _unavailable():
            async with self.app.sessionmaker() as session:
                yield session

    async def observed_floors(self) -> dict[str, floors.Observed]:
        """The handler's consumers as the workers last recorded them, by name."""
        with _unavailable():
            return await floors.read(self.app.engine, self.tables, self.spec.name, self.spec.stream)

    async def count(self, epoch: str, lo: int, hi: int) -> int:
        """How many inbox rows of ``epoch`` lie in ``lo..hi``."""
        stmt = audit_sql.audit_count_inbox(
            self.tables, self.spec.name, self.spec.stream, epoch, lo, hi
        )
        async with self.session() as session:
            return int((await session.execute(stmt)).scalar_one())

    async def recorded(
        self, session: AsyncSession, epoch: str, lo: int, hi: int | None, limit: int | None = None
    ) -> tuple[list[Recorded], list[Recorded]]:
        """Inbox rows and dead letters of one epoch in ``lo..hi``."""
        t, name, stream = self.tables, self.spec.name, self.spec.stream
        rows = await session.execute(
            audit_sql.audit_inbox_rows(t, name, stream, epoch, lo, hi, limit)
        )
        inbox_rows = [Recorded(int(r[0]), bytes(r[1]), str(r[3])) for r in rows]
        rows = await session.execute(
            audit_sql.audit_dead_letters(t, name, stream, epoch, lo, hi, limit)
        )
        dead = [
            Recorded(int(r[0]), bytes(r[1]), "dead_letter", f"#{r[2]} ({r[3]})", r[3], r[4] or "")
            for r in rows
        ]
        return inbox_rows, dead

    async def by_msg_id(self, session: AsyncSession, ids: list[str]) -> dict[str, str]:
        """Where the msg-ids ``ids`` have their outcome, by msg-id."""
        rows = await session.execute(audit_sql.audit_by_msg_ids(self.tables, self.spec.name, ids))
        return {str(r[0]): f"stream {r[1]} sequence {r[3]} (epoch {r[2]}, {r[4]})" for r in rows}

    async def watermark(self, session: AsyncSession, epoch: str) -> int:
        """The inbox watermark of ``epoch`` (0 before the first compaction)."""
        stmt = inbox_sql.watermark(self.tables, self.spec.name, self.spec.stream, epoch)
        value = (await session.execute(stmt)).scalar()
        return int(value or 0)

    async def partition_consumers(self) -> dict[int, str | None]:
        """An ordered handler's current consumer of each partition (None: never owned)."""
        stmt = ownership_sql.consumers(self.tables, self.spec.name)
        async with self.session() as session:
            return {int(p): name for p, name in await session.execute(stmt)}

    async def epochs(self) -> list[str]:
        """Every epoch of the stream with recorded outcomes, sorted."""
        stmt = audit_sql.audit_epochs(self.tables, self.spec.name, self.spec.stream)
        async with self.session() as session:
            return sorted(str(e) for (e,) in await session.execute(stmt))

    async def pages(
        self, epoch: str, lo: int, hi: int | None, page_size: int
    ) -> AsyncIterator[list[Recorded]]:
        """Rows, then dead letters, of one epoch in ``lo..hi``, page by page."""
        for which in (0, 1):
            cursor = lo
            while True:
                async with self.session() as session:
                    page = (await self.recorded(session, epoch, cursor, hi, page_size))[which]
                if len(page) < page_size:
                    if page:
                        yield page
                    break
                # Dead letters may share a sequence: never split one across pages.
                last = page[-1].seq
                whole = [r for r in page if r.seq < last] or page
                yield whole
                cursor = last if len(whole) < len(page) else last + 1
