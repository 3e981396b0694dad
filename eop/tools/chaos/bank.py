"""The built-in chaos target: money transfers between a few accounts.

Each transfer debits one account and credits another in the handler's
transaction, and records one effect row. Few accounts and opposite directions
make transactions wait on each other's row locks and deadlock now and then
(40P01, retried whole). The checker then demands one effect per transfer and
balances equal to the sum of the distinct transfers: a lost, doubled or
half-applied transfer shows in both.

This module is also the app the worker processes run (``eop.tools.chaos.bank:app``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
from collections.abc import Mapping, Sequence

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

import eop
from eop.tools.chaos.target import GoodFactory, Payload, Target

STREAM = "CHAOS"
SUBJECT = "chaos.transfers.new"
"""Where the harness publishes; the handler takes ``chaos.transfers.>``, so that a
raw publish to a subject that is not UTF-8 (``BAD_SUBJECT``) reaches it too."""
BAD_SUBJECT = b"chaos.transfers.\xff\xfe"
HANDLER = "chaos-bank"
ACCOUNTS = tuple(f"acct{i:02d}" for i in range(64))
FEW_ACCOUNTS = ACCOUNTS[:4]
"""The ``transfers`` scenario's accounts: almost every pair of transfers conflicts."""
DUPLICATE_WINDOW_S = 2.0
"""Short, so that republishes after the server's window happen within a run."""

CANARY_PAYLOAD = "eop-canary-payload-5d1e8a"
"""Planted in every payload: it must never appear in a log line."""
POISON_KINDS = ("undecodable", "poison", "failing")
"""The kinds of :func:`poison`, which :func:`mixed_payload` takes in turn."""

app = eop.App()
app.stream(STREAM, subjects=["chaos.transfers.>"], duplicate_window_s=DUPLICATE_WINDOW_S)

_ACCOUNTS_DDL = "CREATE TABLE chaos_accounts (name text PRIMARY KEY, balance bigint NOT NULL)"
# Deliberately without a unique key: a second effect must show, not be refused.
_EFFECTS_DDL = (
    "CREATE TABLE chaos_effects (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " transfer_id text NOT NULL, pid integer NOT NULL, delivered integer NOT NULL)"
)
_DEBIT = sa.text("UPDATE chaos_accounts SET balance = balance - :amount WHERE name = :name")
_CREDIT = sa.text("UPDATE chaos_accounts SET balance = balance + :amount WHERE name = :name")
_EFFECT = sa.text(
    "INSERT INTO chaos_effects (transfer_id, pid, delivered) VALUES (:id, :pid, :delivered)"
)
EFFECTS_SQL = "SELECT transfer_id, count(*) FROM chaos_effects GROUP BY transfer_id"
# Every transfer updates two of these rows: holding them all stops every handler.
LOCK_SQL = "SELECT name FROM chaos_accounts ORDER BY name FOR UPDATE"


@app.handler(stream=STREAM, subject="chaos.transfers.>", name=HANDLER)
async def book(msg: eop.Message, session: AsyncSession) -> None:
    """Book one transfer: debit, credit, one effect row."""
    transfer = msg.json()
    if not isinstance(transfer, dict) or transfer.get("kind") == "poison":
        raise eop.Reject("not a transfer")
    if transfer.get("kind") == "failing":
        # Fails on every delivery: dead-lettered once its attempts run out.
        raise RuntimeError("this transfer always fails")
    amount = int(transfer["amount"])
    await session.execute(_DEBIT, {"amount": amount, "name": transfer["from"]})
    # Long enough for crashes and concurrent deliveries to land between the writes.
    await asyncio.sleep(random.random() * 0.004)
    await session.execute(_CREDIT, {"amount": amount, "name": transfer["to"]})
    await session.execute(
        _EFFECT, {"id": transfer["id"], "pid": os.getpid(), "delivered": msg.num_delivered}
    )


def make_payload(index: int, rng: random.Random) -> Payload:
    """The ``index``-th transfer; about one in 150 is poison of one of three kinds."""
    return mixed_payload(index, rng, make_transfer)


def mixed_payload(index: int, rng: random.Random, make_good: GoodFactory) -> Payload:
    """The ``index``-th message of a target: one in 150 poison, of :data:`POISON_KINDS` in
    turn (key ``p000149``...), the others good ones ``make_good`` makes (key ``t000000``...)."""
    if index % 150 == 149:
        return poison(f"p{index:06d}", POISON_KINDS[(index // 150) % len(POISON_KINDS)])
    return make_good(f"t{index:06d}", rng)


def poison(key: str, kind: str = "poison", *, subject: str | None = None) -> Payload:
    """A message the built-in targets' handlers must not take effect for, the canary in it.

    ``undecodable``: not JSON (dead-lettered undecoded); ``poison``: rejected
    (``eop.Reject``); ``failing``: raises on every delivery, dead-lettered once its
    attempts run out.
    """
    if kind == "undecodable":
        data = b"\xff\xfe not json " + CANARY_PAYLOAD.encode()
    else:
        data = json.dumps({"id": key, "kind": kind, "memo": CANARY_PAYLOAD}).encode()
    return Payload(key=key, data=data, poison=True, subject=subject)


def make_transfer(key: str, rng: random.Random, accounts: Sequence[str] = ACCOUNTS) -> Payload:
    """A good transfer with ``key``, between two of ``accounts``."""
    source, dest = rng.sample(accounts, 2)
    body = {
        "id": key,
        "from": source,
        "to": dest,
        "amount": rng.randint(1, 1000),
        "memo": CANARY_PAYLOAD,
    }
    return Payload(key=key, data=json.dumps(body).encode())


def make_failing(key: str) -> Payload:
    """A message that fails on every delivery: dead-lettered when its attempts run out."""
    return poison(key, "failing")


def make_few_payload(index: int, rng: random.Random) -> Payload:
    """The ``index``-th transfer between the 4 accounts of ``FEW_ACCOUNTS``; no poison."""
    return make_transfer(f"t{index:06d}", rng, FEW_ACCOUNTS)


def setup(sync_url: str) -> None:
    """Create the accounts (all at 0) and the effects table."""
    create_tables(
        sync_url,
        (_ACCOUNTS_DDL, _EFFECTS_DDL),
        "INSERT INTO chaos_accounts (name, balance) VALUES (:name, 0)",
        [{"name": name} for name in ACCOUNTS],
    )


def create_tables(
    sync_url: str,
    ddl: Sequence[str],
    insert: str | None = None,
    rows: Sequence[Mapping[str, object]] = (),
) -> None:
    """A target's :data:`~eop.tools.chaos.target.Setup`: run ``ddl``, then ``insert`` once
    per row of ``rows``, in one transaction."""
    engine = sa.create_engine(sync_url)
    try:
        with engine.begin() as conn:
            for statement in ddl:
                conn.execute(sa.text(statement))
            if insert is not None:
                conn.execute(sa.text(insert), list(rows))
    finally:
        engine.dispose()


def check_balances(conn: sa.Connection, payloads: Sequence[Payload]) -> list[str]:
    """Every balance equals the sum of the distinct transfers that touched it."""
    expected = dict.fromkeys(ACCOUNTS, 0)
    for payload in payloads:
        if payload.poison:
            continue
        transfer = json.loads(payload.data)
        expected[transfer["from"]] -= transfer["amount"]
        expected[transfer["to"]] += transfer["amount"]
    rows = conn.execute(sa.text("SELECT name, balance FROM chaos_accounts")).all()
    actual = {str(name): int(balance) for name, balance in rows}
    total = sum(actual.values())
    if total != 0:
        # Each transfer moves money: any half-applied one shows in the sum.
        problems = [f"the sum of all balances is {total}, not 0 (money made or destroyed)"]
    else:
        problems = []
    return problems + [
        f"account {name}: balance {actual.get(name)} != {want} (sum of distinct transfers)"
        for name, want in sorted(expected.items())
        if actual.get(name) != want
    ]


def target() -> Target:
    """The bank as a :class:`Target`."""
    return Target(
        app="eop.tools.chaos.bank:app",
        handler=HANDLER,
        effects_sql=EFFECTS_SQL,
        payloads=make_payload,
        setup=setup,
        invariant=check_balances,
        subject=SUBJECT,
        bad_subject=BAD_SUBJECT,
        make_good=make_transfer,
        make_failing=make_failing,
        lock_sql=LOCK_SQL,
    )


def few_accounts_target() -> Target:
    """The bank on 4 accounts: transfers in random directions deadlock all the time."""
    return dataclasses.replace(target(), payloads=make_few_payload)
