"""The fleet's turn: contended transactions, one at a time across processes.

After a deadlock or a lock timeout a worker process runs that handler's
transactions one at a time (:mod:`eop.protocol.contention`). That ends the
crossings inside the process, not between processes: two workers, each one
transaction at a time, still lock hot rows in opposite orders, and PostgreSQL
breaks each such cycle only after ``deadlock_timeout`` (a second by default).
A contended transaction therefore first waits for the fleet's turn: a
transaction-level advisory lock, keyed by eop's schema, which COMMIT or
ROLLBACK releases (so it works behind a pooler in transaction mode). One key
for every handler: two handlers that lock the same rows in opposite orders
cross each other as two processes of one handler do. The wait is bounded by
the transaction's ``lock_timeout``, and PostgreSQL's deadlock detection sees
it as it sees row locks.
"""

from __future__ import annotations

import sqlalchemy as sa

from eop.pg import models
from eop.pg.sql.base import Bound

_TURN = sa.text("SELECT pg_advisory_xact_lock(hashtext('eop.turn'), hashtext(:p_key))")
"""The two-key form: a key space of its own, apart from the one-key locks an app takes."""


def turn(t: models.Tables) -> Bound:
    """Wait, in the current transaction, for the turn of the contended transactions on
    ``t``'s schema; held until the transaction ends."""
    return _TURN, {"p_key": t.schema}
