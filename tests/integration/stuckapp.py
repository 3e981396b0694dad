"""An app whose handler hangs on the message ``stuck``, for the stop tests (`eop worker`).

``STUCKAPP_KIND`` picks the handler: ``sync`` (a plain ``def`` that sleeps in
its thread), ``lock`` (a plain ``def`` whose UPDATE waits on a row of
``stuck_lock`` another connection holds), ``pg_sleep`` (a plain ``def`` whose
statement sleeps in PostgreSQL for 30 s, the first time in the process only)
or ``async`` (awaits for ever). With ``STUCKAPP_HANG=0`` it does not hang: the
worker that processes the message afterwards.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import eop

from .bed import STREAM, SUBJECT, record_effect

app = eop.App()
app.stream(STREAM, subjects=["ORDERS.>"])

_HANG = os.environ.get("STUCKAPP_HANG", "1") == "1"
_INSERT = sa.text("INSERT INTO effects (handler, msg_key, body) VALUES ('stuck', :k, :b)")
_KIND = os.environ.get("STUCKAPP_KIND", "sync")
_SLEPT = threading.Event()

if _KIND == "sync":

    @app.handler(stream=STREAM, subject=SUBJECT, name="stuck")
    def hang_in_thread(msg: eop.Message, session: Session) -> None:
        """Write the effect, then sleep (a thread cannot be cancelled)."""
        session.execute(_INSERT, {"k": msg.idempotency_key, "b": msg.data.decode()})
        if _HANG and msg.data == b"stuck":
            time.sleep(10_000)

elif _KIND == "lock":

    @app.handler(stream=STREAM, subject=SUBJECT, name="stuck")
    def wait_on_a_row_lock(msg: eop.Message, session: Session) -> None:
        """Write the effect, then UPDATE a row locked elsewhere (eop's I/O is the only wait)."""
        session.execute(_INSERT, {"k": msg.idempotency_key, "b": msg.data.decode()})
        if _HANG and msg.data == b"stuck":
            session.execute(sa.text("UPDATE stuck_lock SET n = n + 1"))

elif _KIND == "pg_sleep":

    @app.handler(stream=STREAM, subject=SUBJECT, name="stuck")
    def sleep_in_postgres(msg: eop.Message, session: Session) -> None:
        """Write the effect, then sleep in PostgreSQL: 30 s the first time, then not at all."""
        session.execute(_INSERT, {"k": msg.idempotency_key, "b": msg.data.decode()})
        seconds = 0.0 if _SLEPT.is_set() else 30.0
        _SLEPT.set()
        session.execute(sa.text("SELECT pg_sleep(:s)"), {"s": seconds})

else:

    @app.handler(stream=STREAM, subject=SUBJECT, name="stuck")
    async def hang_in_loop(msg: eop.Message, session: AsyncSession) -> None:
        """Write the effect, then await for ever."""
        await record_effect(session, "stuck", msg)
        if _HANG and msg.data == b"stuck":
            await asyncio.Event().wait()
