"""The test kit: run your handlers through eop's protocol in your tests.

One line, with the inbox in memory or in your test database (see
:mod:`eop.testing.app` and docs/testing.md)::

    async with eop.testing.TestApp(app) as t:  # or TestApp(app, database=engine)
        delivered = await t.deliver("ORDERS.created", {"id": 1}, msg_id="order-1")
        assert delivered.processed
        assert (await t.redeliver(delivered)).duplicate

With pytest, the ``eop`` plugin (installed with eop) adds fixtures: throwaway
servers, a migrated database per test, ``eop_test_app``.

Below it, the fakes for testing handlers, and eop itself, without NATS or PostgreSQL.
Like procrastinate's ``testing`` module or dramatiq's stub broker, these run
the real protocol (:class:`eop.protocol.processor.Processor`) against in-memory stand-ins
that keep the semantics that matter and can be told to fail::

    from eop import Settings, testing
    from eop.protocol.processor import Processor
    from eop.types import Outcome

    store = testing.MemoryStore()
    processor = Processor(spec=app.handlers["orders"], settings=Settings(),
                          store=store, epochs=testing.FakeEpochs())
    delivery = testing.FakeDelivery.make(data=b'{"id": 1}', subject="orders.new")
    assert await processor.handle(delivery, processor.clock()) is Outcome.PROCESSED
    assert delivery.acked and store.effects == [...]  # what the handler session.add()-ed

- :class:`FakeDelivery`: one JetStream delivery; records ack/nak/term and
  heartbeats, and can lose ack replies.
- :class:`MemoryStore`: the inbox with PostgreSQL's semantics (claims wait on
  each other, rows are visible after COMMIT only, a rollback discards); handlers
  get a :class:`FakeSession` whose ``add()`` calls become ``store.effects`` at
  COMMIT.
- :class:`FakeEpochs`: stream epochs from a dict.

Its modules: :mod:`~eop.testing.deliveries`, :mod:`~eop.testing.epochs`,
:mod:`~eop.testing.store` (the store, its state in :mod:`~eop.testing.inbox`
and its transactions in :mod:`~eop.testing.transaction`, with the rows of
:mod:`~eop.testing.rows`) and :mod:`~eop.testing.failures` (the errors the
fakes can be told to raise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eop.errors import DeliveryStalled, HandlerFailed
from eop.pg.contract import DeadLetter as DeadLetter
from eop.pg.contract import Existing as Existing
from eop.testing.app import TestApp
from eop.testing.deliveries import DEFAULT_TIMESTAMP as DEFAULT_TIMESTAMP
from eop.testing.deliveries import FakeDelivery, FakeMetadata, SequencePair
from eop.testing.deliveries import Operation as Operation
from eop.testing.epochs import FakeEpochs
from eop.testing.failures import ErrorSpec as ErrorSpec
from eop.testing.failures import LockNotAvailable
from eop.testing.results import Delivered, Result
from eop.testing.rows import DeadLetterRow, InboxKey, InboxRow
from eop.testing.rows import inbox_key as inbox_key
from eop.testing.session import FakeSession, FakeWrites
from eop.testing.store import MemoryStore, MemoryTransaction

# `X as X`: names importable since eop.testing was one module, outside `__all__`.
from eop.types import Delivery, Outcome

if TYPE_CHECKING:
    from eop.pg import contract
    from eop.protocol import processor

__all__ = [
    # the test kit
    "TestApp",
    "Delivered",
    "Result",
    "Outcome",
    "HandlerFailed",
    "DeliveryStalled",
    # the fakes
    "DeadLetterRow",
    "FakeDelivery",
    "FakeEpochs",
    "FakeMetadata",
    "FakeSession",
    "FakeWrites",
    "InboxKey",
    "InboxRow",
    "LockNotAvailable",
    "MemoryStore",
    "MemoryTransaction",
    "SequencePair",
]

if TYPE_CHECKING:

    def _conforms(
        store: MemoryStore, delivery: FakeDelivery, epochs: FakeEpochs
    ) -> tuple[contract.Store, Delivery, processor.Epochs]:
        """Let mypy check that the fakes implement eop's protocols."""
        return store, delivery, epochs
