"""The ``ordered`` target: a per-account ledger applied step by step, in stream order.

The handler is declared with ``order_by="subject:1"`` and takes
``chaosord.<account>.step``: each of 40 accounts gets its steps 1, 2, 3...
published in that order, each as a message of its own. Applying a step reads
the account's last applied step ``FOR UPDATE``, records an effect row (the
account, the step, its stream sequence, the step it expected: last + 1) and
moves the account on. The row lock makes the effects' identity order each
account's commit order, which the checker reads
(:func:`eop.tools.chaos.checker.check_order`): every account's steps must have
committed as 1, 2, 3... with no step ahead of an earlier one and none after a
later one.

Retries must hold their key back: a step in every :data:`RETRY_EVERY` (per
account, staggered) raises :class:`eop.Retry` on its first delivery. Garbage
must settle in its place too: every :data:`GARBAGE_EVERY`-th message of an
account is undecodable or rejected (dead-lettered, no step of its own), and
the step published after it checks that its dead letter had committed
(``prior_settled``).

This module is also the app the worker processes run (``eop.tools.chaos.ordered:app``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

import eop
from eop.tools.chaos.bank import CANARY_PAYLOAD, DUPLICATE_WINDOW_S, create_tables, poison
from eop.tools.chaos.target import Payload, Target

STREAM = "CHAOSORD"
PREFIX = "chaosord"
HANDLER = "chaos-ordered"
ACCOUNTS = tuple(f"acct{i:02d}" for i in range(40))
GARBAGE_EVERY = 15
"""The 15th, 30th... message of each account is garbage (no step)."""
RETRY_EVERY = 10
"""One step in ten (per account, staggered) fails on its first delivery."""
BURST = 4
"""Messages of one account published back to back: a key's later messages are there
while an earlier one is retried or held by a dead or frozen worker."""

app = eop.App()
app.stream(STREAM, subjects=[f"{PREFIX}.>"], duplicate_window_s=DUPLICATE_WINDOW_S)

_ACCOUNTS_DDL = (
    "CREATE TABLE chaos_ordered_accounts (account text PRIMARY KEY, last_step integer NOT NULL)"
)
# Deliberately without a unique key: a second effect must show, not be refused.
_EFFECTS_DDL = (
    "CREATE TABLE chaos_ordered_effects (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " msg_key text NOT NULL, account text NOT NULL, step integer NOT NULL,"
    " expected integer NOT NULL, seq bigint NOT NULL, prior_settled boolean NOT NULL,"
    " pid integer NOT NULL, delivered integer NOT NULL)"
)
_LAST = sa.text("SELECT last_step FROM chaos_ordered_accounts WHERE account = :account FOR UPDATE")
_DEAD = sa.text(
    "SELECT EXISTS (SELECT 1 FROM eop.dead_letters WHERE subscription = :handler"
    " AND msg_id = :msg_id)"
)
_EFFECT = sa.text(
    "INSERT INTO chaos_ordered_effects"
    " (msg_key, account, step, expected, seq, prior_settled, pid, delivered)"
    " VALUES (:key, :account, :step, :expected, :seq, :settled, :pid, :delivered)"
)
# GREATEST: one step out of order is one violation, not a cascade of them after it.
_MOVE = sa.text(
    "UPDATE chaos_ordered_accounts SET last_step = GREATEST(last_step, :step)"
    " WHERE account = :account"
)
EFFECTS_SQL = "SELECT msg_key, count(*) FROM chaos_ordered_effects GROUP BY msg_key"
ORDER_SQL = "SELECT account, step, prior_settled FROM chaos_ordered_effects ORDER BY id"
"""Each effect in commit order per account (the account row's lock orders the ids)."""


@app.handler(stream=STREAM, subject=f"{PREFIX}.*.step", name=HANDLER, order_by="subject:1")
async def apply_step(msg: eop.Message, session: AsyncSession) -> None:
    """Apply one step of an account: check it follows the last one, record it, move on."""
    body = msg.json()
    if not isinstance(body, dict) or body.get("kind") == "poison":
        raise eop.Reject("not a step")
    if body.get("fail_first") and msg.num_delivered == 1:
        # Its key must wait: the next step may not run before this one's retry.
        raise eop.Retry("the first delivery of this step fails", delay_s=0.5)
    account, step = str(body["account"]), int(body["step"])
    last = int((await session.execute(_LAST, {"account": account})).scalar_one())
    settled = True
    if body.get("after"):
        found = await session.execute(_DEAD, {"handler": HANDLER, "msg_id": body["after"]})
        settled = bool(found.scalar_one())
    # Long enough for crashes and concurrent deliveries to land between the writes.
    await asyncio.sleep(random.random() * 0.004)
    params = {
        "key": body["id"],
        "account": account,
        "step": step,
        "expected": last + 1,
        "seq": msg.seq,
        "settled": settled,
        "pid": os.getpid(),
        "delivered": msg.num_delivered,
    }
    await session.execute(_EFFECT, params)
    await session.execute(_MOVE, {"account": account, "step": step})


def subject_of(account: str) -> str:
    """The subject of ``account``'s messages (its key is token 1)."""
    return f"{PREFIX}.{account}.step"


def _garbage_key(account: str, item: int) -> str:
    return f"g-{account}-{item:05d}"


def make_payload(index: int, rng: random.Random) -> Payload:
    """The ``index``-th message: accounts in turn, :data:`BURST` items of each at a time.

    An account's items are its steps, with every :data:`GARBAGE_EVERY`-th item
    garbage instead (undecodable or rejected, alternately), which takes no step number.
    """
    block, offset = divmod(index, BURST)
    rounds, number = divmod(block, len(ACCOUNTS))
    account, item = ACCOUNTS[number], rounds * BURST + offset
    if item % GARBAGE_EVERY == GARBAGE_EVERY - 1:
        kind = "undecodable" if (item // GARBAGE_EVERY + number) % 2 == 0 else "poison"
        return poison(_garbage_key(account, item), kind, subject=subject_of(account))
    step = item + 1 - (item + 1) // GARBAGE_EVERY
    after = item >= 1 and (item - 1) % GARBAGE_EVERY == GARBAGE_EVERY - 1
    key = f"s-{account}-{step:05d}"
    body = {
        "id": key,
        "account": account,
        "step": step,
        "fail_first": (step + number) % RETRY_EVERY == 0,
        "after": _garbage_key(account, item - 1) if after else None,
        "amount": rng.randint(1, 1000),
        "memo": CANARY_PAYLOAD,
    }
    return Payload(key=key, data=json.dumps(body).encode(), subject=subject_of(account))


def setup(sync_url: str) -> None:
    """Create the accounts (all at step 0) and the effects table."""
    create_tables(
        sync_url,
        (_ACCOUNTS_DDL, _EFFECTS_DDL),
        "INSERT INTO chaos_ordered_accounts VALUES (:account, 0)",
        [{"account": account} for account in ACCOUNTS],
    )


def target() -> Target:
    """The ordered ledger as a :class:`Target`."""
    return Target(
        app="eop.tools.chaos.ordered:app",
        handler=HANDLER,
        effects_sql=EFFECTS_SQL,
        payloads=make_payload,
        setup=setup,
        subject=subject_of(ACCOUNTS[0]),
        order_sql=ORDER_SQL,
    )
