"""The app the `eop audit` subprocesses of the audit tests load (settings from EOP_* variables)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

import eop

from .bed import STREAM, SUBJECT

app = eop.App()
app.stream(STREAM, subjects=["ORDERS.>"], storage="file")


@app.handler(stream=STREAM, subject=SUBJECT, name="billing")
async def bill(msg: eop.Message, session: AsyncSession) -> None:
    """Reject the message `poison` (a dead letter by rule); do nothing with the others."""
    if msg.data == b"poison":
        raise eop.Reject("poison")
