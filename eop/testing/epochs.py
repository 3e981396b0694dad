"""Fake stream epochs."""

from __future__ import annotations

import datetime
from collections.abc import Mapping


class FakeEpochs:
    """Stream epochs from a dict, implementing :class:`eop.protocol.processor.Epochs`.

    :attr:`current` is what the server says; :meth:`get` answers from a cache
    filled on first use, like the real :class:`eop.broker.jetstream.StreamEpochs`, so
    changing :attr:`current` (:meth:`set`, a recreated stream) is only seen
    after :meth:`refresh`. Streams missing from :attr:`current` have
    :attr:`default`.
    """

    def __init__(
        self, epochs: Mapping[str, str] | None = None, *, default: str = "epoch-1"
    ) -> None:
        self.current: dict[str, str] = dict(epochs or {})
        """The epoch of each stream on the (fake) server."""
        self.default = default
        self.refreshes = 0
        """How many times :meth:`refresh` was called."""
        self._cache: dict[str, str] = {}

    def set(self, stream: str, epoch: str) -> None:
        """The stream was recreated: the server now reports ``epoch``."""
        self.current[stream] = epoch

    async def get(self, stream: str) -> str:
        """The cached epoch of ``stream``."""
        if stream not in self._cache:
            self._cache[stream] = self.current.get(stream, self.default)
        return self._cache[stream]

    async def epoch_of(self, stream: str, stored_at: datetime.datetime | None) -> str | None:
        """The cached epoch of ``stream``, whenever the message was stored."""
        return await self.get(stream)

    async def refresh(self, stream: str) -> str:
        """Re-read the epoch of ``stream`` from :attr:`current`."""
        self.refreshes += 1
        self._cache[stream] = self.current.get(stream, self.default)
        return self._cache[stream]

    async def read_within(self, stream: str, within_s: float, timeout_s: float) -> bool:
        """Always read: the fake server answers at once."""
        return True

    def of_current(self, stream: str, stored_at: datetime.datetime | None) -> bool:
        """Every message is of the current incarnation: settling it reaches it alone."""
        return True
