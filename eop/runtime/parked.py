"""A handler's parked messages in one worker process: polled, and run when their retry is due.

A handler that parks its failed messages (:attr:`eop.protocol.processor.Processor.parks`)
has them in PostgreSQL until their retry is due (:mod:`eop.pg.retries`).
:func:`retry_loop` takes the due ones every ``retry_poll_s`` and runs them
as fetched messages run: holding slots and leases, a poll's in one
transaction (:mod:`eop.protocol.retry_batch`), or one each without
``batch_transactions``.
"""

from __future__ import annotations

import time

from eop import backoff, log
from eop.pg import retries
from eop.pg.store import PostgresStore
from eop.protocol import processor
from eop.runtime.inflight import InFlight


async def retry_loop(flight: InFlight, store: PostgresStore, proc: processor.Processor) -> None:
    """Run the parked messages of ``proc``'s handler whose retry is due.

    Retries share the worker's slots with fetched messages: it waits for
    one (the fetch loop gives back what a pull did not fill), takes the
    others that are free, and looks again at once while it finds as many
    due messages as it could take.
    """
    settings, logger = flight.settings, flight.logger
    wait_s = settings.retry_poll_s
    failures = 0
    while not await backoff.stopped_within(flight.stopping, wait_s):
        wait_s = settings.retry_poll_s
        free = await flight.take_slots()
        parked: list[retries.ParkedDelivery] = []
        try:
            if free:
                parked = await retries.take_due(store, proc.spec, free, proc.ack_wait_s)
            failures = 0
        except Exception as exc:
            # The database is away: the parked messages wait there; try later.
            # One warning per outage, not one per poll.
            failures += 1
            proc.misconfigured.note(exc, f"handler {proc.spec.name!r}", settings)
            (logger.warning if failures == 1 else logger.debug)(
                log.Event.RETRY_LOOP_FAILED,
                handler=proc.spec.name,
                failures=failures,
                error=log.round_error(exc),
            )
        flight.slots.give(free - len(parked))
        # A poll's due retries run in one transaction (eop.protocol.retry_batch), as a
        # fetched batch does; one transaction each without batch transactions.
        polls = [parked] if settings.batch_transactions else [[p] for p in parked]
        taken_at = time.monotonic()
        flight.leases.hold(parked, proc.ack_wait_s, at=taken_at)
        for poll in polls:
            if poll:
                flight.spawn(flight.process(proc, poll, taken_at))
        if parked and len(parked) == free:
            wait_s = 0.0
