"""An app whose handler hangs on the message ``stuck``, for the stop tests (`eop worker`).

``STUCKAPP_KIND`` picks the handler: ``sync`` (a plain ``def`` that sleeps in
its thread) or ``async`` (awaits for ever). With ``STUCKAPP_HANG=0`` it does not
hang: the worker that processes the message afterwards.
"""

from __future__ import annotations

import asyncio
import os
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

if os.environ.get("STUCKAPP_KIND", "sync") == "sync":

    @app.handler(stream=STREAM, subject=SUBJECT, name="stuck")
    def hang_in_thread(msg: eop.Message, session: Session) -> None:
        """Write the effect, then sleep (a thread cannot be cancelled)."""
        session.execute(_INSERT, {"k": msg.idempotency_key, "b": msg.data.decode()})
        if _HANG and msg.data == b"stuck":
            time.sleep(10_000)

else:

    @app.handler(stream=STREAM, subject=SUBJECT, name="stuck")
    async def hang_in_loop(msg: eop.Message, session: AsyncSession) -> None:
        """Write the effect, then await for ever."""
        await record_effect(session, "stuck", msg)
        if _HANG and msg.data == b"stuck":
            await asyncio.Event().wait()
