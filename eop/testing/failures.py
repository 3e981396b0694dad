"""The errors the fakes can be told to raise, and the queues that hold them."""

from __future__ import annotations

import dataclasses
from typing import Union

ErrorSpec = Union[BaseException, "type[BaseException]"]  # a runtime alias: no `X | Y` on 3.10
"""An exception to raise: an instance, or a class called without arguments."""


class LockNotAvailable(Exception):
    """PostgreSQL's ``lock_not_available``: ``lock_timeout`` expired (sqlstate 55P03).

    :func:`eop.pg.failures.classify` reads its :attr:`sqlstate` as LOCK_TIMEOUT.
    """

    sqlstate = "55P03"

    def __init__(self, message: str = "canceling statement due to lock timeout") -> None:
        super().__init__(message)


@dataclasses.dataclass(frozen=True)
class Ambiguous:
    """A queued COMMIT failure: :class:`eop.AmbiguousCommit`, having ``committed`` or not."""

    committed: bool


def instantiate(error: ErrorSpec) -> BaseException:
    """The exception to raise for ``error``."""
    return error() if isinstance(error, type) else error


class Failures:
    """Errors queued per operation: the next calls of an operation raise them in turn."""

    def __init__(self, *operations: str) -> None:
        self._queued: dict[str, list[ErrorSpec]] = {operation: [] for operation in operations}

    def add(self, operation: str, times: int, error: ErrorSpec) -> None:
        """Make the next ``times`` calls of ``operation`` raise ``error``."""
        self._queued[operation].extend([error] * times)

    def raise_next(self, operation: str) -> None:
        """Raise the next error queued for ``operation``, if any."""
        queued = self._queued[operation]
        if queued:
            raise instantiate(queued.pop(0))
