"""A partition's transaction: eop's inbox statements, run inline for sync handlers.

:class:`eop.pg.transactions.SqlTransaction` subclasses for Spark tasks: the sync one
never hops to a thread (a task has no event loop to keep free), so its
coroutines never suspend and :func:`drive` runs them without a loop.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from eop import errors
from eop.pg import failures, transactions

T = TypeVar("T")


class SyncPartitionTx(transactions.SyncTransaction):
    """A partition's transaction on a sync ``Session``, every step inline.

    Unlike :class:`eop.pg.transactions.SyncTransaction` no step hops to a thread: its
    coroutines never suspend, so :func:`drive` runs them without an event
    loop, and the handler runs as plain code in the Spark task's thread.
    """

    async def _step(self, func: Callable[..., T], *args: Any) -> T:
        """Run the step here, in the Spark task's thread."""
        return func(*args)


class AsyncPartitionTx(transactions.AsyncTransaction):
    """A partition's transaction on an ``AsyncSession``, for ``async def`` handlers."""


PartitionTx = SyncPartitionTx | AsyncPartitionTx


# The failures a partition retries in place. BUSY (a statement timeout, a
# full pool) is not one: it fails the task, and Spark's task retry runs it again.
_RETRIED_IN_PLACE = frozenset(
    {
        failures.DbFailure.CONFLICT,
        failures.DbFailure.CONNECTION,
        # Another transaction (a live worker, a speculative task) holds a claim.
        failures.DbFailure.LOCK_TIMEOUT,
    }
)


def transient(exc: BaseException) -> bool:
    """Errors after which the partition's whole transaction is retried in place."""
    # Transaction.claim raises its lock timeout as ClaimTimeout: a held claim all the same.
    return isinstance(exc, errors.ClaimTimeout) or failures.transient(exc, _RETRIED_IN_PLACE)


def drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (the sync path) to its end, without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a step of a sync partition waited on an event loop")
