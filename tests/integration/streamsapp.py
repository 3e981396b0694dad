"""An app for `eop streams create`: a declared stream only the outbox publishes to, an
undeclared stream a handler reads, and an ordered handler of several partitions."""

from __future__ import annotations

from typing import Any

import eop

app = eop.App()
app.stream("SHIPMENTS", subjects=["SHIPMENTS.>"])


@app.handler(stream="ORDERS", subject="ORDERS.created", name="orders")
async def orders(msg: eop.Message, session: Any) -> None:
    """Nothing: only the stream matters here."""


@app.handler(
    stream="LEDGER", subject="ledger.*.entry", name="ledger", order_by="subject:1", partitions=4
)
async def ledger(msg: eop.Message, session: Any) -> None:
    """Nothing: only the stream's partition transform matters here."""
