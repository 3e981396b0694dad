"""The outbox: messages published once, exactly when the transaction that added them commits.

::

    async with app.sessionmaker() as session, session.begin():
        session.add(Order(id=order_id, total=total))
        eop.outbox.add(session, "ORDERS.created", json.dumps({"id": order_id}))

The message is stored in eop's ``outbox`` table in the caller's transaction;
the relay that ``eop worker`` runs (or ``eop relay``) publishes it after the
COMMIT, with a ``Nats-Msg-Id`` fixed when it was added. In a handler, pass
its session or its :class:`eop.Writes`. See docs/outbox.md.
"""

from __future__ import annotations

# The whole outbox lives in this package, each module in its own layer (CONTRIBUTING.md,
# 'Feature packages'): this one is its public face, so it imports only what it exports.
from eop.outbox.table import add

__all__ = ["add"]
