"""The fleet's turns: a handler's contended transactions, one at a time across processes.

After a deadlock or a lock timeout a worker process runs that handler's
transactions one at a time (:mod:`eop.protocol.contention`). That ends the
crossings inside the process, not between processes: two workers, each one
transaction at a time, still lock hot rows in opposite orders, and PostgreSQL
breaks each such cycle only after ``deadlock_timeout`` (a second by default).
A contended transaction therefore first waits for its handler's turn: a
transaction-level advisory lock, keyed by the schema and the handler's
subscription, which COMMIT or ROLLBACK releases (so it works behind a pooler in
transaction mode). The wait is bounded by the transaction's ``lock_timeout``,
and PostgreSQL's deadlock detection sees it as it sees row locks.
"""

from __future__ import annotations

import sqlalchemy as sa

from eop.pg import models
from eop.pg.sql.base import Bound

_TURN = sa.text("SELECT pg_advisory_xact_lock(hashtext('eop.turn'), hashtext(:p_key))")
"""The two-key form: a key space of its own, apart from the one-key locks an app takes."""


def turn(t: models.Tables, subscription: str) -> Bound:
    """Wait, in the current transaction, for ``subscription``'s turn; held until it ends."""
    return _TURN, {"p_key": f"{t.schema}.{subscription}"}
