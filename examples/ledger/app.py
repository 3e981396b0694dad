"""Ledger: each account's entries are posted in the order they were published.

``order_by="subject:1"`` keys the handler on the account (``LEDGER.<account>``):
an account's entries run one after another, in stream order, and while one
waits for its retry, the account's later entries wait behind it. Other
accounts go on. ``examples/ledger/test_handlers.py`` tests that, in memory.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import eop


class Base(DeclarativeBase):
    """The ledger's own models."""


class Posting(Base):
    """One posted entry, in US cents."""

    __tablename__ = "postings"
    id: Mapped[int] = mapped_column(primary_key=True)
    account: Mapped[str]
    entry_id: Mapped[str]
    usd_cents: Mapped[int]


RATES: dict[str, float] = {"USD": 1.0}
"""US dollars per unit of each currency: a stand-in for a rates service."""

app = eop.App()
app.stream("LEDGER", subjects=["LEDGER.*"])


@app.handler(stream="LEDGER", subject="LEDGER.*", name="postings", order_by="subject:1")
async def post(msg: eop.Message, session: AsyncSession) -> None:
    """Post an entry; one in a currency without a rate yet is retried, holding back its
    account's later entries (a balance depends on them all, in order)."""
    entry = msg.json()
    rate = RATES.get(entry["currency"])
    if rate is None:
        raise eop.Retry(f"no {entry['currency']} rate yet", delay_s=30)
    account = msg.subject.split(".")[1]
    cents = round(entry["amount_cents"] * rate)
    session.add(Posting(account=account, entry_id=entry["id"], usd_cents=cents))
