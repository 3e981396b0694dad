"""The app of the `eop dlq` / `eop status` CLI tests: rejects "poison" until DLQAPP_HEAL=1."""

from __future__ import annotations

import os

from sqlalchemy.ext.asyncio import AsyncSession

import eop

from .bed import STREAM, SUBJECT, record_effect

app = eop.App()
app.stream(STREAM, subjects=["ORDERS.>"])


@app.handler(stream=STREAM, subject=SUBJECT, name="billing")
async def bill(msg: eop.Message, session: AsyncSession) -> None:
    """Record one effect; reject poison unless healed."""
    if msg.data.startswith(b"poison") and os.environ.get("DLQAPP_HEAL") != "1":
        raise eop.Reject("poison is not billable")
    await record_effect(session, "billing", msg)
