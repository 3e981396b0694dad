"""The inbox transactions on PostgreSQL: async (asyncpg), a sync handler's on the async
session (its handler in a thread) and sync (a given sync session, each step in a thread).

All implement :class:`eop.pg.contract.Transaction` on a SQLAlchemy session:
eop's statements (:class:`eop.pg.statements.Statements`: the claim, the dead
letters, the retries' bookkeeping), the handler's run, and COMMIT. What they share
is :mod:`eop.pg.sql_transaction`; each is a module of its own,
:mod:`eop.pg.async_transaction`, :mod:`eop.pg.threaded_transaction` and
:mod:`eop.pg.sync_transaction`, named here too.
"""

from __future__ import annotations

from eop.pg.async_transaction import AsyncTransaction as AsyncTransaction
from eop.pg.sql_transaction import SqlTransaction as SqlTransaction
from eop.pg.sql_transaction import driver_in_transaction as driver_in_transaction
from eop.pg.sql_transaction import log_ended as log_ended
from eop.pg.sql_transaction import translate_commit as translate_commit
from eop.pg.sync_transaction import SyncTransaction as SyncTransaction
from eop.pg.threaded_transaction import ThreadedTransaction as ThreadedTransaction
