"""``eop demo``'s wait for the workers to drain the stream, without servers."""

from __future__ import annotations

import types
from typing import Any

import nats.js.errors
import pytest

from eop import errors
from eop.tools import demo


class FakeJetStream:
    """consumer_info answers: "not found" ``missing`` times, then ``pending`` messages left."""

    def __init__(self, missing: int, pending: list[int]) -> None:
        self.missing, self.pending = missing, pending
        self.calls = 0

    async def consumer_info(self, stream: str, consumer: str) -> Any:
        self.calls += 1
        if self.missing:
            self.missing -= 1
            raise nats.js.errors.NotFoundError(code=404, err_code=10014)
        left = self.pending.pop(0) if len(self.pending) > 1 else self.pending[0]
        return types.SimpleNamespace(num_pending=left, num_ack_pending=0)


async def test_the_drain_waits_for_a_consumer_no_worker_has_created_yet() -> None:
    """On a busy machine every worker may still be starting when publishing ends:
    the consumer's absence means "not yet", not a failed demo."""
    js = FakeJetStream(missing=2, pending=[3, 0])
    await demo._wait_drained(js, deadline_s=30)  # type: ignore[arg-type]
    assert js.calls == 4


async def test_the_drain_fails_clearly_when_no_worker_ever_creates_the_consumer() -> None:
    js = FakeJetStream(missing=1_000, pending=[0])
    with pytest.raises(errors.EopError, match="no worker created the demo's consumer"):
        await demo._wait_drained(js, deadline_s=0.3)  # type: ignore[arg-type]


async def test_the_drain_fails_when_messages_stay_pending() -> None:
    js = FakeJetStream(missing=0, pending=[5])
    with pytest.raises(errors.EopError, match="did not drain within"):
        await demo._wait_drained(js, deadline_s=0.3)  # type: ignore[arg-type]
