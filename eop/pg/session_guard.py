"""The session a handler gets cannot end eop's transaction.

eop's transaction holds a message's claim and its handler's writes together; eop
commits it after the handler, then acks the message. A handler that committed it
itself would commit the claim with only the writes made so far, and a failure after
that would never be retried; one that rolled it back would drop the claim, and its
later writes would commit without it, to be applied again on redelivery. So on the
session eop hands out, ``commit``, ``rollback``, ``close``, ``reset`` and
``invalidate`` raise :class:`eop.errors.TransactionEndedByHandler` before doing
anything, and eop ends its transaction through the session class's own methods
(:func:`end`, :func:`end_async`). An ``AsyncSession`` calls its sync session's
methods, so guarding that one covers both faces. A savepoint
(``begin_nested()``) and ``flush()`` stay the handler's to use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

from eop import errors

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

ENDS = ("commit", "rollback", "close", "reset", "invalidate")
"""The ``Session`` methods that end its transaction."""


class Refusal:
    """What a guarded session has in place of one of :data:`ENDS` (and the test kit's
    fake session, so that a handler's tests meet the same error)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        raise errors.TransactionEndedByHandler(
            f"the handler called {self.name}() on the session eop gave it: eop commits or "
            "rolls back the transaction itself, after the handler, with the message's claim "
            "in it; remove the call (flush() sends pending writes, begin_nested() makes a "
            "savepoint)"
        )


def guard(session: Session) -> None:
    """Make the session's own :data:`ENDS` raise, on this instance only."""
    for name in ENDS:
        setattr(session, name, Refusal(name))


def unguard(session: Session) -> None:
    """Give the session its own :data:`ENDS` back, once no handler can run on it: before
    a context manager closes it (``async with sessionmaker() as session``)."""
    for name in ENDS:
        session.__dict__.pop(name, None)


def end(session: Session, name: str) -> None:
    """Call the session class's ``name`` (one of :data:`ENDS`) past the guard."""
    getattr(type(session), name)(session)


async def end_async(session: AsyncSession, name: str) -> None:
    """Await the ``AsyncSession`` equivalent of :func:`end` on its sync session."""
    await session.run_sync(getattr(type(session.sync_session), name))
