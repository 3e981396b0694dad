"""An ordered per-account ledger the fleet tests run in `eop worker` subprocesses.

Settings come from EOP_* variables; LEDGER_PARTITIONS sets the partition count.
"""

from __future__ import annotations

import asyncio
import os
import signal

from sqlalchemy.ext.asyncio import AsyncSession

import eop

from .test_ordered_fleet import STREAM, apply_step

app = eop.App()
app.stream(STREAM, subjects=["ledger.>"])


@app.handler(
    stream=STREAM,
    subject="ledger.*.step",
    name="ledger",
    order_by="subject:1",
    partitions=int(os.environ.get("LEDGER_PARTITIONS", "4")),
)
async def ledger(msg: eop.Message, session: AsyncSession) -> None:
    """Apply the step to its account, slowly enough that a SIGKILL lands mid-work; a
    ``kill`` message kills the process that runs it (a segfault, an OOM kill)."""
    if msg.data == b"kill":
        os.kill(os.getpid(), signal.SIGKILL)
    await asyncio.sleep(0.003)
    await apply_step(session, msg.subject.split(".")[1], int(msg.data))
