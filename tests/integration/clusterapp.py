"""The app of the NATS cluster tests: an R3 stream declared with ``app.stream(replicas=3)``."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

import eop

from .bed import STREAM, SUBJECT, record_effect

app = eop.App()
app.stream(STREAM, subjects=["ORDERS.>"], replicas=3)


@app.handler(stream=STREAM, subject=SUBJECT, name="billing")
async def bill(msg: eop.Message, session: AsyncSession) -> None:
    """Record one effect."""
    await record_effect(session, "billing", msg)
