"""An app whose ``kill`` message kills the process that runs it (a segfault, an OOM kill),
for the crash-loop tests, run in `eop worker` subprocesses."""

from __future__ import annotations

import asyncio
import os
import signal

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

import eop

app = eop.App()
app.stream("KILL", subjects=["kill.>"])


@app.handler(stream="KILL", subject="kill.*", name="killer")
async def handler(msg: eop.Message, session: AsyncSession) -> None:
    """Record the message; a ``kill`` message kills the worker instead."""
    if msg.data == b"kill":
        os.kill(os.getpid(), signal.SIGKILL)
    await asyncio.sleep(0.003)
    await session.execute(sa.text("INSERT INTO done VALUES (:b)"), {"b": msg.data.decode()})
