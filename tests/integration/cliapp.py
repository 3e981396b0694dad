"""The app the CLI tests run in `eop worker` subprocesses (settings from EOP_* variables)."""

from __future__ import annotations

import asyncio
import gc
import os
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession

import eop

from .bed import STREAM, SUBJECT, record_effect

app = eop.App()
app.stream(STREAM, subjects=["ORDERS.>"])

_DELAY_S = float(os.environ.get("CLIAPP_HANDLER_DELAY_S", "0.005"))
_GC_REPORT = os.environ.get("CLIAPP_GC_REPORT")
"""A file the handler writes the collector's frozen object count to."""


@app.handler(stream=STREAM, subject=SUBJECT, name="cli")
async def handle(msg: eop.Message, session: AsyncSession) -> None:
    """Record one effect, slowly enough that a SIGKILL lands mid-work."""
    await asyncio.sleep(_DELAY_S)
    if _GC_REPORT:
        await asyncio.to_thread(Path(_GC_REPORT).write_text, str(gc.get_freeze_count()))
    await record_effect(session, "cli", msg)
