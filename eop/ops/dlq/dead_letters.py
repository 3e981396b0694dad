"""The dead letters of an app's database: listed, shown, counted, purged."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eop.ops.dlq import state
from eop.ops.dlq.filters import Filters
from eop.pg import models
from eop.pg.sql import dead_letters as dead_letters_sql

if TYPE_CHECKING:
    from eop.app import App


class DeadLetters:
    """The dead letters of an app's database (its ``database_url`` and ``schema``)."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.tables = models.tables(app.settings.schema)

    async def rows(self, filters: Filters) -> list[dict[str, Any]]:
        """The dead letters matching ``filters``, newest first, without payloads."""
        stmt = dead_letters_sql.select_dead_letters(
            self.tables, filters.where(self.tables), filters.limit
        )
        async with self.app.sessionmaker() as session:
            return [dict(row._mapping) for row in await session.execute(stmt)]

    async def get(self, dead_letter_id: int) -> dict[str, Any]:
        """One dead letter without its payload; :class:`eop.errors.DeadLetterNotFound` if none."""
        found = await self.rows(Filters(ids=(dead_letter_id,)))
        if not found:
            raise state.not_found(dead_letter_id)
        return found[0]

    async def payload(self, dead_letter_id: int) -> bytes:
        """The stored payload of one dead letter."""
        async with self.app.sessionmaker() as session:
            value = (
                await session.execute(
                    dead_letters_sql.dead_letter_payload(self.tables, dead_letter_id)
                )
            ).scalar()
        if value is None:
            raise state.not_found(dead_letter_id)
        return bytes(value)

    async def count(self, filters: Filters) -> int:
        """How many dead letters match ``filters``."""
        stmt = dead_letters_sql.count_dead_letters(self.tables, filters.where(self.tables))
        async with self.app.sessionmaker() as session:
            return int((await session.execute(stmt)).scalar_one())

    async def ids(self, filters: Filters) -> list[int]:
        """The ids matching ``filters``, oldest first, at most ``filters.limit``."""
        stmt = dead_letters_sql.dead_letter_ids(self.tables, filters.where(self.tables))
        if filters.limit is not None:
            stmt = stmt.limit(filters.limit)
        async with self.app.sessionmaker() as session:
            return [int(i) for (i,) in await session.execute(stmt)]

    async def purge(self, filters: Filters) -> int:
        """Delete the dead letters matching ``filters``; returns how many.

        Their inbox rows stay: they are the record that the message had its
        one outcome.
        """
        stmt = dead_letters_sql.purge_dead_letters(self.tables, filters.where(self.tables))
        async with self.app.sessionmaker() as session:
            deleted = len((await session.execute(stmt)).all())
            await session.commit()
        return deleted
