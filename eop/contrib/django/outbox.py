"""The outbox on Django's connection: a message published once the view's transaction commits.

::

    with transaction.atomic():
        order = Order.objects.create(total=total)
        eop.contrib.django.add("ORDERS.created", json.dumps({"id": order.id}))

``eop.outbox.add(connection, ...)`` does the same with a connection you name.
"""

from __future__ import annotations

from collections.abc import Mapping

from asgiref.sync import sync_to_async

from eop import outbox


def add(
    subject: str,
    data: bytes | str,
    *,
    headers: Mapping[str, str] | None = None,
    msg_id: str | None = None,
    using: str | None = None,
) -> str:
    """Add a message to the outbox in the current transaction of connection ``using``
    (default: ``settings.EOP["DATABASE"]``); returns its ``Nats-Msg-Id``.

    Call it inside ``transaction.atomic()``: the row commits with your writes
    or not at all. Outside one, Django's autocommit commits it at once.
    """
    from django.db import connections

    from eop.contrib.django import conf

    return outbox.add(
        connections[using or conf.alias()], subject, data, headers=headers, msg_id=msg_id
    )


async def aadd(
    subject: str,
    data: bytes | str,
    *,
    headers: Mapping[str, str] | None = None,
    msg_id: str | None = None,
    using: str | None = None,
) -> str:
    """:func:`add` from async code (an async handler, an async view), on the thread
    that holds the transaction's connection, as Django's async ORM methods run."""
    return await sync_to_async(add)(subject, data, headers=headers, msg_id=msg_id, using=using)
