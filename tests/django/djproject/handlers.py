"""The project's eop handlers: the Django ORM inside the transaction that claims the message."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.db import transaction
from django.db.models import F
from djproject.shop.models import Account, Effect, Step

import eop
import eop.contrib.django

app = eop.App()
app.stream("DJ", subjects=["dj.>"])
# The ordered ledger's stream: its own, since it carries the transform of the ledger's partitions.
app.stream("DJLEDGER", subjects=["djledger.>"])


def saw_claim(connection: Any, message: eop.Message) -> bool:
    """Whether this transaction sees the message's inbox row, not committed yet."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM eop.inbox AS i JOIN eop.watermarks AS w USING (lane)"
            " WHERE w.subscription = %s AND w.stream = %s AND w.stream_epoch = %s"
            " AND i.stream_seq = %s",
            [message.subscription, message.stream, message.stream_epoch, message.seq],
        )
        return bool(cursor.fetchone()[0] == 1)


def _key(message: eop.Message) -> str:
    return str(json.loads(message.data)["key"])


@app.handler(stream="DJ", subject="dj.sync", name="sync_effects")
def sync_effects(message: eop.Message, connection: Any) -> None:
    """One Effect, and the shared counter up by one."""
    Effect.objects.create(
        key=_key(message), handler="sync", saw_claim=saw_claim(connection, message)
    )
    Account.objects.filter(name="hot").update(balance=F("balance") + 1)
    if json.loads(message.data).get("poison"):
        raise ValueError("poison: this message always fails")


@app.handler(stream="DJ", subject="dj.async", name="async_effects")
async def async_effects(message: eop.Message, connection: Any) -> None:
    """The same through Django's async ORM; and a message on through the outbox."""
    seen = await sync_to_async(saw_claim)(connection, message)
    await Effect.objects.acreate(key=_key(message), handler="async", saw_claim=seen)
    await Account.objects.filter(name="hot").aupdate(balance=F("balance") + 1)
    await eop.contrib.django.aadd("dj.forwarded", json.dumps({"key": _key(message)}))


@app.handler(stream="DJ", subject="dj.crossing", name="crossing")
def crossing(message: eop.Message, connection: Any) -> None:
    """Two hot rows, locked in an order that depends on the message: deadlocks."""
    first, second = ("a", "b") if int(_key(message)) % 2 else ("b", "a")
    Account.objects.filter(name=first).update(balance=F("balance") + 1)
    Account.objects.filter(name=second).update(balance=F("balance") + 1)
    Effect.objects.create(key=_key(message), handler="crossing", saw_claim=True)


@app.handler(stream="DJ", subject="dj.orders", name="orders")
def orders(message: eop.Message, connection: Any) -> None:
    """The view's outbox messages, consumed once."""
    Effect.objects.create(
        key=_key(message), handler="orders", saw_claim=saw_claim(connection, message)
    )


@app.handler(stream="DJ", subject="dj.slow", name="slow")
def slow(message: eop.Message, connection: Any) -> None:
    """An Effect and the counter, slowly enough that a SIGKILL lands mid-batch."""
    Effect.objects.create(key=_key(message), handler="slow", saw_claim=True)
    Account.objects.filter(name="hot").update(balance=F("balance") + 1)
    time.sleep(float(os.environ.get("DJPROJECT_DELAY_S", "0")))


@app.handler(
    stream="DJLEDGER",
    subject="djledger.*.step",
    name="ledger",
    order_by="subject:1",  # the account
    partitions=2,
)
def ledger(message: eop.Message, connection: Any) -> None:
    """A per-account state machine: lock the account, record whether this step is its next
    one, make it the account's last; slowly enough that a stop lands mid-burst."""
    account = message.subject.split(".")[1]
    step = int(message.data)
    last = Account.objects.select_for_update().get(name=account).balance
    Step.objects.create(account=account, step=step, in_order=step == last + 1)
    Account.objects.filter(name=account).update(balance=step)
    time.sleep(0.003)


def _failing_callback() -> None:
    raise RuntimeError("the on_commit callback failed")


@app.handler(stream="DJ", subject="dj.oncommit", name="on_commit_fails")
def on_commit_fails(message: eop.Message, connection: Any) -> None:
    """One Effect, then a ``transaction.on_commit`` callback that raises after COMMIT."""
    Effect.objects.create(key=_key(message), handler="oncommit", saw_claim=True)
    transaction.on_commit(_failing_callback)


@app.handler(stream="DJ", subject="dj.rawend", name="raw_end")
def raw_end(message: eop.Message, connection: Any) -> None:
    """One Effect, then, when its payload names one, a ``COMMIT`` or ``ROLLBACK`` statement
    on the connection's cursor: eop's transaction ended past Django's ``atomic()``."""
    Effect.objects.create(key=_key(message), handler="rawend", saw_claim=True)
    end = json.loads(message.data).get("end")
    if end:
        with connection.cursor() as cursor:
            cursor.execute(end)
