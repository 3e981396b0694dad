"""The ``sync-hot-rows`` target: a sync handler adding to one of 10 hot rows.

What a new user writes first: a plain ``def`` handler given a SQLAlchemy
``Session``, one ``UPDATE`` of a counter row that every tenth message shares,
and one ``INSERT`` of the effect. Run with eop's default throughput settings
(128 in flight, batches of 64, batch transactions), many handler runs queue on
the same few row locks at once. The checker demands one effect per message and
each row's total equal to the sum of its messages' amounts.

This module is also the app the worker processes run (``eop.tools.chaos.hot:app``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

import eop
from eop.tools.chaos.bank import (
    CANARY_PAYLOAD,
    DUPLICATE_WINDOW_S,
    create_tables,
    make_failing,
    poison,
)
from eop.tools.chaos.target import Payload, Target

STREAM = "CHAOSHOT"
SUBJECT = "chaos.hot.new"
HANDLER = "chaos-hot"
ROWS = 10

app = eop.App()
app.stream(STREAM, subjects=["chaos.hot.>"], duplicate_window_s=DUPLICATE_WINDOW_S)

_ROWS_DDL = "CREATE TABLE chaos_hot (id integer PRIMARY KEY, total bigint NOT NULL)"
_EFFECTS_DDL = (
    "CREATE TABLE chaos_hot_effects (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " item_id text NOT NULL, amount integer NOT NULL)"
)
_ADD = sa.text("UPDATE chaos_hot SET total = total + :amount WHERE id = :row")
_EFFECT = sa.text("INSERT INTO chaos_hot_effects (item_id, amount) VALUES (:id, :amount)")
EFFECTS_SQL = "SELECT item_id, count(*) FROM chaos_hot_effects GROUP BY item_id"
LOCK_SQL = "SELECT id FROM chaos_hot ORDER BY id FOR UPDATE"


@app.handler(stream=STREAM, subject="chaos.hot.>", name=HANDLER)
def add(msg: eop.Message, session: Session) -> None:
    """Add the amount to its hot row and record one effect row."""
    item = msg.json()
    if not isinstance(item, dict) or item.get("kind") == "poison":
        raise eop.Reject("not an item")
    if item.get("kind") == "failing":
        raise RuntimeError("this item always fails")
    session.execute(_ADD, {"amount": int(item["amount"]), "row": int(item["row"])})
    session.execute(_EFFECT, {"id": item["id"], "amount": int(item["amount"])})


def make_item(key: str, rng: random.Random) -> Payload:
    """A good item with ``key`` for one of the hot rows."""
    body = {"id": key, "row": rng.randrange(ROWS), "amount": rng.randint(1, 100)}
    body["memo"] = CANARY_PAYLOAD
    return Payload(key=key, data=json.dumps(body).encode())


def make_payload(index: int, rng: random.Random) -> Payload:
    """The ``index``-th item; about one in 200 is rejected as poison."""
    if index % 200 == 199:
        return poison(f"p{index:06d}")
    return make_item(f"h{index:06d}", rng)


def setup(sync_url: str) -> None:
    """Create the hot rows (all at 0) and the effects table."""
    create_tables(
        sync_url,
        (_ROWS_DDL, _EFFECTS_DDL),
        "INSERT INTO chaos_hot (id, total) VALUES (:id, 0)",
        [{"id": row} for row in range(ROWS)],
    )


def check_totals(conn: sa.Connection, payloads: Sequence[Payload]) -> list[str]:
    """Each row's total equals the sum of the amounts of its distinct good items."""
    expected = dict.fromkeys(range(ROWS), 0)
    for payload in payloads:
        if not payload.poison:
            item = json.loads(payload.data)
            expected[item["row"]] += item["amount"]
    rows = conn.execute(sa.text("SELECT id, total FROM chaos_hot")).all()
    actual = {int(row): int(total) for row, total in rows}
    return [
        f"hot row {row}: total {actual.get(row)} != {want} (sum of distinct items)"
        for row, want in sorted(expected.items())
        if actual.get(row) != want
    ]


def target() -> Target:
    """The hot rows as a :class:`Target`."""
    return Target(
        app="eop.tools.chaos.hot:app",
        handler=HANDLER,
        effects_sql=EFFECTS_SQL,
        payloads=make_payload,
        setup=setup,
        invariant=check_totals,
        subject=SUBJECT,
        bad_subject=b"chaos.hot.\xff\xfe",
        make_good=make_item,
        make_failing=make_failing,
        lock_sql=LOCK_SQL,
    )
