"""An unordered handler in one worker process: its durable consumer, fetched in a loop.

Every process that runs the handler pulls from the same durable consumer.
Each pull asks for as many messages as there are free slots (up to
``batch``); what it gets runs as one batch in one transaction, or one
transaction per message without ``batch_transactions``
(:meth:`eop.runtime.inflight.InFlight.process`). A failed fetch is retried
after a growing wait, and when the consumer or its stream is gone they are
provisioned again. As soon as a fetch returns, the epochs its newest message
needs are read ahead (:meth:`eop.broker.jetstream.StreamEpochs.read_ahead`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from eop import backoff, errors, log
from eop.app import App
from eop.broker import consumers, fetcher, jetstream
from eop.handler import HandlerSpec
from eop.protocol import processor
from eop.runtime.inflight import InFlight
from eop.runtime.slots import Taken

# The waits after failed fetches (counted from 1): 0.2 s, doubling up to 5 s.
_FETCH_RETRY_FIRST_S = 0.2
_FETCH_RETRY_MAX_S = 5.0


class Unordered:
    """The fetch loop of an unordered handler's consumer in one process.

    ``transforms`` are the partition transforms of the app's streams
    (:func:`eop.ordering.partitions.stream_transforms`), for a stream made again.
    """

    def __init__(
        self,
        flight: InFlight,
        app: App,
        transforms: Mapping[str, tuple[str, str]],
        js: JetStreamContext,
        spec: HandlerSpec,
        sub: fetcher.Fetcher,
        proc: processor.Processor,
        epochs: jetstream.StreamEpochs,
    ) -> None:
        self._flight = flight
        self._app = app
        self._transforms = transforms
        self._js = js
        self._spec = spec
        self._sub = sub
        self._proc = proc
        self._epochs = epochs

    async def run(self) -> None:
        """Fetch and process until the worker stops."""
        flight, proc = self._flight, self._proc
        settings = flight.settings
        failures = 0
        while not flight.stopping.is_set():
            taken = Taken(flight.slots.give, await flight.take_slots())
            if taken.count == 0:
                break
            try:
                msgs = await self._sub.fetch(
                    taken.count, settings.fetch_timeout_s, lingering=taken.all_but_one
                )
                failures = 0
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                msgs = []
            except (nats.errors.Error, OSError) as exc:
                msgs = []
                failures += 1
                # Free while it waits (a stop may cancel the wait).
                flight.slots.give(taken.count)
                taken.count = 0
                await self._recover(exc, failures)
            received_at = time.monotonic()
            if msgs:
                newest = msgs[-1].metadata
                self._epochs.read_ahead(newest.stream, newest.timestamp)
            flight.leases.hold(msgs, proc.ack_wait_s, at=received_at)
            flight.slots.give(taken.count - len(msgs))
            groups = [msgs] if settings.batch_transactions else [[m] for m in msgs]
            for group in groups:
                if group:
                    flight.spawn(flight.process(proc, group, received_at))

    async def _recover(self, exc: BaseException, failures: int) -> None:
        """A fetch failed: wait, and when the consumer or stream is gone, provision again."""
        spec, settings = self._spec, self._flight.settings
        self._flight.logger.warning(
            log.Event.FETCH_FAILED, handler=spec.name, error=type(exc).__name__, failures=failures
        )
        await asyncio.sleep(backoff.backoff_s(failures, _FETCH_RETRY_FIRST_S, _FETCH_RETRY_MAX_S))
        if (
            isinstance(exc, (nats.js.errors.APIError, nats.errors.NoRespondersError))
            or failures > 3
        ):
            with contextlib.suppress(
                errors.EopError, nats.errors.Error, OSError, asyncio.TimeoutError
            ):
                await jetstream.ensure_stream(
                    self._js,
                    self._app.stream_spec(spec.stream),
                    create=settings.create,
                    transform=self._transforms.get(spec.stream),
                )
                await consumers.ensure_consumer(self._js, spec, settings, create=settings.create)
                await self._proc.epochs.refresh(spec.stream)
                self._flight.logger.info(
                    log.Event.SUBSCRIPTION_BOUND, handler=spec.name, rebound=True
                )
