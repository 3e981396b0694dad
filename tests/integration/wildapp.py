"""An app whose handler takes every subject of its stream (``ORDERS.>``), for raw-frame tests."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

import eop

from .bed import STREAM, record_effect

app = eop.App()
app.stream(STREAM, subjects=["ORDERS.>"])


@app.handler(stream=STREAM, subject="ORDERS.>", name="wild")
async def handle(msg: eop.Message, session: AsyncSession) -> None:
    """Record one effect per message."""
    await record_effect(session, "wild", msg)
