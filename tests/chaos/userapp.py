"""A user's own app under `eop chaos`: what the harness needs from it, and nothing more."""

from __future__ import annotations

import random

import sqlalchemy as sa
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncSession

import eop
from eop.tools.chaos import Payload

app = eop.App()
app.stream("NOTES", subjects=["notes.>"], duplicate_window_s=2.0)

EFFECTS_SQL = "SELECT note, count(*) FROM notes GROUP BY note"


_NOTE = sa.text("INSERT INTO notes (note) VALUES (:n)")


@app.handler(stream="NOTES", subject="notes.new", name="notes")
async def save(msg: eop.Message, writes: eop.Writes) -> None:
    """Queue one note (eop.Writes, sent with its batch's); a note that says 'poison' is refused."""
    text = msg.text()
    if text.startswith("poison"):
        raise eop.Reject("poisonous note")
    writes.add(_NOTE, {"n": text})


class _Base(orm.DeclarativeBase):
    pass


class Note(_Base):
    """A note as the README's models are written: a key the database makes."""

    __tablename__ = "notes"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    note: orm.Mapped[str]


@app.handler(stream="NOTES", subject="notes.new", name="orm_notes")
async def save_object(msg: eop.Message, session: AsyncSession) -> None:
    """The README's first style: add one note object to the session; 'poison' is refused."""
    text = msg.text()
    if text.startswith("poison"):
        raise eop.Reject("poisonous note")
    session.add(Note(note=text))


def payload(index: int, rng: random.Random) -> Payload:
    """Note ``index``; every 50th is poison."""
    key = f"{'poison' if index % 50 == 49 else 'note'}-{index}"
    return Payload(key=key, data=key.encode(), poison=key.startswith("poison"))


def setup(sync_url: str) -> None:
    """The notes table, without a unique key, so that a second effect shows."""
    engine = sa.create_engine(sync_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE notes (id serial PRIMARY KEY, note text NOT NULL)"))
    engine.dispose()
