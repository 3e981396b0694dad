"""Settling a delivery with the server: the confirmed ack, nak and term (leases are
renewed in :mod:`eop.broker.leases`).

The confirmed ack only cuts redeliveries; the inbox row committed before it is
the guarantee. So an ack that keeps failing is given up after a bound, with a
warning: the redelivery it causes will find the inbox row and be skipped.
"""

from __future__ import annotations

import asyncio
import bisect
import operator
from collections.abc import Sequence

import nats.errors
import tenacity
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api

from eop import backoff, faults, log
from eop.broker import client
from eop.broker.fence import Fence
from eop.types import Delivery

_ACK = b"+ACK"
_STATUS_HEADER = api.Header.STATUS.value
_NO_RESPONDERS = api.StatusCode.SERVICE_UNAVAILABLE.value
_NO_RESPONDERS_RAW = _NO_RESPONDERS.encode()

# Errors after which the same ack may be sent again: the reply was lost, or the
# client is reconnecting and will resend from its pending buffer.
_RETRYABLE_ACK_ERRORS: tuple[type[BaseException], ...] = (
    asyncio.TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.FlushTimeoutError,
)


# The waits between resent acks: 50 ms, doubling up to 1 s, until give_up_s.
_ACK_RETRY_FIRST_S = 0.05
_ACK_RETRY_MAX_S = 1.0

#: How long acks answered "no responders" are resent, at most (``give_up_s`` when
#: shorter). Nobody serves the consumer's ack subject: its leader is being elected
#: (seconds, in a cluster), or the consumer is gone (an ordered handler's partition
#: handed over under a new epoch), when no resend can land. Giving up costs a
#: redelivery that the inbox skips; waiting held a stopping worker up to give_up_s.
NO_RESPONDERS_GIVE_UP_S = 2.0

# Sending a batch of acks stops at any client error: those not confirmed then
# take the per-message path, which knows which errors are worth a retry.
_BATCH_SEND_ERRORS: tuple[type[BaseException], ...] = (*_RETRYABLE_ACK_ERRORS, nats.errors.Error)


def _consumer_of(delivery: Delivery) -> tuple[str, str]:
    meta = delivery.metadata
    return meta.stream, meta.consumer


async def confirm(
    delivery: Delivery,
    *,
    timeout_s: float,
    give_up_s: float,
    logger: log.Logger,
    stopping: asyncio.Event | None = None,
    gone: set[tuple[str, str]] | None = None,
    fence: Fence | None = None,
) -> bool:
    """Send a confirmed ack, retried on timeouts and reconnects; True once the server has it.

    ``MsgAlreadyAckdError`` means an earlier attempt got through: done. After
    ``give_up_s`` the ack is abandoned with a warning and False is returned; once
    ``stopping`` is set, after :data:`NO_RESPONDERS_GIVE_UP_S` already.

    ``gone`` holds the (stream, consumer) pairs whose last ack was given up on "no
    responders" (:attr:`Acker.gone`): an ack to one of them is given up at its first
    "no responders", and a confirmed one takes its consumer off.

    With a ``fence``, each try is sent only if the delivery is of its stream's
    current incarnation by a fresh reading (:class:`eop.broker.fence.Fence`): it
    is given up (``ack.fenced``) as soon as a reading shows it is not, and a try
    whose reading cannot be made waits for the next one.
    """
    verdict = True if fence is None else await fence.verdict(delivery)
    if verdict is False:
        fenced(logger, log.Action.ACK)
        return False
    if verdict:
        done = await _first_try(delivery, timeout_s, logger, gone)
        if done is not None:
            return done

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        logger.debug(log.Event.ACK_RETRY, attempt=state.attempt_number, error=type(exc).__name__)

    retrying = backoff.retrying(
        stop=(tenacity.stop_after_delay(give_up_s) | _NoRespondersForLong() | _Stopped(stopping)),
        retry=tenacity.retry_if_exception_type(_RETRYABLE_ACK_ERRORS),
        base_s=_ACK_RETRY_FIRST_S,
        max_s=_ACK_RETRY_MAX_S,
        before_sleep=before_sleep,
    )
    try:
        async for attempt in retrying:
            with attempt:
                await _fenced_try(delivery, fence)
                await delivery.ack_sync(timeout=timeout_s)
    except _Stale:
        fenced(logger, log.Action.ACK)
        return False
    except nats.errors.MsgAlreadyAckdError:
        return True
    except _RETRYABLE_ACK_ERRORS as exc:
        if gone is not None and isinstance(exc, nats.errors.NoRespondersError):
            gone.add(_consumer_of(delivery))
        _gave_up(logger, exc)
        return False
    if gone:
        gone.discard(_consumer_of(delivery))
    return True


async def _first_try(
    delivery: Delivery, timeout_s: float, logger: log.Logger, gone: set[tuple[str, str]] | None
) -> bool | None:
    """The first try, outside tenacity: almost every ack succeeds at once, and a retrying
    loop costs more CPU than the ack itself. True: confirmed; False: given up (its
    consumer was found gone); None: to be resent."""
    try:
        await delivery.ack_sync(timeout=timeout_s)
        if gone:
            gone.discard(_consumer_of(delivery))
        return True
    except nats.errors.MsgAlreadyAckdError:
        return True
    except _RETRYABLE_ACK_ERRORS as exc:
        if (
            gone
            and isinstance(exc, nats.errors.NoRespondersError)
            and _consumer_of(delivery) in gone
        ):
            _gave_up(logger, exc)
            return False
        logger.debug(log.Event.ACK_RETRY, attempt=1, error=type(exc).__name__)
    return None


class _Stale(Exception):
    """A reading shows the delivery is of an earlier incarnation of its stream."""


async def _fenced_try(delivery: Delivery, fence: Fence | None) -> None:
    """Let a resent ack go only if the fence allows it now: :class:`_Stale` if a reading
    shows it must never go, a retried error if no reading can be made now."""
    if fence is None:
        return
    verdict = await fence.verdict(delivery)
    if verdict is False:
        raise _Stale()
    if verdict is None:
        raise asyncio.TimeoutError("the stream cannot be read: the ack waits for a reading")


def fenced(logger: log.Logger, action: log.Action) -> None:
    """Log a settlement not sent: its delivery is of an earlier incarnation of its stream."""
    logger.warning(
        log.Event.ACK_FENCED,
        action=action,
        note="the stream was recreated since this delivery: sent, it would settle the new "
        "incarnation's message at the same sequence",
    )


def _gave_up(logger: log.Logger, exc: BaseException) -> None:
    logger.warning(
        log.Event.ACK_GAVE_UP,
        error=type(exc).__name__,
        note="the outcome is committed; a redelivery will be skipped by the inbox",
    )


class _NoRespondersForLong(tenacity.stop.stop_base):
    """Stop resending an ack once "no responders" answered it :data:`NO_RESPONDERS_GIVE_UP_S`
    after the first resend."""

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        outcome, elapsed = retry_state.outcome, retry_state.seconds_since_start
        return (
            outcome is not None
            and elapsed is not None
            and isinstance(outcome.exception(), nats.errors.NoRespondersError)
            and elapsed >= NO_RESPONDERS_GIVE_UP_S
        )


class _Stopped(tenacity.stop.stop_base):
    """Stop resending an ack once the worker stops and :data:`NO_RESPONDERS_GIVE_UP_S` have
    passed since the first resend: an ack NATS does not answer (the server down) held a
    stopping worker for ``give_up_s``, when giving up costs a redelivery the inbox skips."""

    def __init__(self, stopping: asyncio.Event | None) -> None:
        self.stopping = stopping

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        elapsed = retry_state.seconds_since_start
        return (
            self.stopping is not None
            and self.stopping.is_set()
            and elapsed is not None
            and elapsed >= NO_RESPONDERS_GIVE_UP_S
        )


class _Waiting:
    """The replies a batch of acks still waits for: its tokens are ``first`` onwards."""

    __slots__ = ("confirmed", "done", "first", "left")

    def __init__(self, first: int, count: int, done: asyncio.Future[None]) -> None:
        self.first = first
        self.confirmed = [False] * count
        self.left = count
        self.done = done

    def reply(self, index: int, confirmed: bool) -> None:
        if self.confirmed[index] or self.done.done():
            return
        self.confirmed[index] = confirmed
        if confirmed:
            self.left -= 1
            if self.left == 0:
                self.done.set_result(None)


_FIRST = operator.attrgetter("first")


class Acker:
    """Confirmed acks for a batch: sent together, their replies awaited together.

    ``ack_sync`` per message costs a request each (a reply token, a future, a
    ``wait_for`` timer, a task to gather). Here the acks of a batch go out
    back to back with reply subjects under one wildcard subscription of this
    connection, and one timer waits for all the replies. On eop's connections
    the batch is one command in nats-py's buffer
    (:meth:`eop.broker.client.Client.publish_many`) and a reply is taken inside
    the read loop as bytes (:meth:`eop.broker.client.Client.subscribe_replies`):
    no message object, queue or task hop per reply. An ack whose reply does
    not come in time (or says no responders) goes the per-message way of
    :func:`confirm`: retried with tenacity, then given up with a warning.
    """

    def __init__(self, nc: NATS, stopping: asyncio.Event | None = None) -> None:
        self._nc = nc
        self.stopping = stopping
        """Set when the worker stops: acks not confirmed are then given up sooner."""
        self.gone: set[tuple[str, str]] = set()
        """The (stream, consumer) pairs whose last ack was given up on "no responders",
        since :data:`NO_RESPONDERS_GIVE_UP_S` of resending found nobody serving their ack
        subject: the consumer was deleted (an ordered handler's partition handed over
        under a new epoch) or its leader is still being elected. The next ack to one of
        them is given up at its first "no responders": a lane settling its messages one
        after another waited the whole resending for each. A confirmed ack takes its
        consumer off."""
        self._prefix: str | None = None
        self._skip = 0
        self._lock = asyncio.Lock()
        # The batches waiting for replies, in the order of their tokens: a
        # batch's tokens are consecutive, so a reply finds its batch by bisection,
        # with no entry per message to add and remove.
        self._batches: list[_Waiting] = []
        self._next = 0

    async def _reply_prefix(self) -> str:
        if self._prefix is None:
            async with self._lock:
                if self._prefix is None:
                    inbox = self._nc.new_inbox()
                    if isinstance(self._nc, client.Client):
                        await self._nc.subscribe_replies(f"{inbox}.*", self._on_raw_reply)
                    else:
                        await self._nc.subscribe(f"{inbox}.*", cb=self._on_reply)
                    self._skip = len(inbox) + 1
                    self._prefix = f"{inbox}."
        return self._prefix

    def _on_raw_reply(self, subject: bytes, headers: bytes | None) -> None:
        # As in nats-py's request(): any reply confirms, except "no responders".
        self._settle(subject[self._skip :], client.status_of(headers) != _NO_RESPONDERS_RAW)

    async def _on_reply(self, msg: Msg) -> None:
        status = msg.headers.get(_STATUS_HEADER) if msg.headers else None
        self._settle(msg.subject[self._skip :].encode(), status != _NO_RESPONDERS)

    def _settle(self, token: bytes, confirmed: bool) -> None:
        if not token.isdigit():
            return  # not one of ours: nothing waits for it
        number = int(token)
        at = bisect.bisect_right(self._batches, number, key=_FIRST) - 1
        if at >= 0:
            waiting = self._batches[at]
            index = number - waiting.first
            if index < len(waiting.confirmed):
                waiting.reply(index, confirmed)

    async def _send(self, deliveries: Sequence[Delivery], prefix: str, first: int) -> None:
        nc = self._nc
        if isinstance(nc, client.Client) and not faults.ruled("during_ack"):
            await nc.publish_many(
                [d.reply for d in deliveries],
                _ACK,
                [f"{prefix}{token}" for token in range(first, first + len(deliveries))],
            )
            return
        # With a rule at "during_ack", the point is passed before each ack, so that
        # a chaos run can kill the worker with part of a batch's acks sent.
        for token, delivery in enumerate(deliveries, first):
            await faults.point("during_ack")
            await nc.publish(delivery.reply, _ACK, reply=f"{prefix}{token}")

    async def confirm_many(
        self,
        deliveries: Sequence[Delivery],
        loggers: Sequence[log.Logger],
        *,
        timeout_s: float,
        give_up_s: float,
        fence: Fence | None = None,
    ) -> list[bool]:
        """Ack every delivery and wait for the server's confirmations.

        Returns, per delivery, whether the server has the ack (False: given up
        after ``give_up_s``, with a warning, as :func:`confirm` does). With a
        ``fence``, only the deliveries of their stream's current incarnation are
        acked together; one of an earlier incarnation is not acked
        (``ack.fenced``), one whose stream cannot be read now takes
        :func:`confirm`'s way.
        """
        if not deliveries:
            return []
        verdicts = None if fence is None else await fence.verdicts(deliveries)
        if verdicts is None or all(verdicts):
            return await self._confirm_many(deliveries, loggers, timeout_s, give_up_s, fence)
        confirmed = [False] * len(deliveries)
        now = [i for i, v in enumerate(verdicts) if v]
        done = await self._confirm_many(
            [deliveries[i] for i in now], [loggers[i] for i in now], timeout_s, give_up_s, fence
        )
        for i, ok in zip(now, done, strict=True):
            confirmed[i] = ok
        later = [i for i, v in enumerate(verdicts) if v is None]
        again = await self._one_by_one(deliveries, loggers, later, timeout_s, give_up_s, fence)
        for i, ok in zip(later, again, strict=True):
            confirmed[i] = ok
        for i, v in enumerate(verdicts):
            if v is False:
                fenced(loggers[i], log.Action.ACK)
        return confirmed

    async def _confirm_many(
        self,
        deliveries: Sequence[Delivery],
        loggers: Sequence[log.Logger],
        timeout_s: float,
        give_up_s: float,
        fence: Fence | None,
    ) -> list[bool]:
        if not deliveries:
            return []
        first = self._next + 1
        self._next += len(deliveries)
        waiting = _Waiting(first, len(deliveries), asyncio.get_running_loop().create_future())
        self._batches.append(waiting)
        try:
            await self._send(deliveries, await self._reply_prefix(), first)
            await asyncio.wait({waiting.done}, timeout=timeout_s)
        except _BATCH_SEND_ERRORS:
            pass  # the ones not confirmed are retried one by one below
        finally:
            self._batches.remove(waiting)
            waiting.done.cancel()
        confirmed = waiting.confirmed
        retries = [i for i, ok in enumerate(confirmed) if not ok]
        if retries:
            again = await self._one_by_one(
                deliveries, loggers, retries, timeout_s, give_up_s, fence
            )
            for i, ok in zip(retries, again, strict=True):
                confirmed[i] = ok
        if self.gone:
            self.gone.difference_update(
                _consumer_of(d) for d, ok in zip(deliveries, confirmed, strict=True) if ok
            )
        return confirmed

    async def _one_by_one(
        self,
        deliveries: Sequence[Delivery],
        loggers: Sequence[log.Logger],
        indices: Sequence[int],
        timeout_s: float,
        give_up_s: float,
        fence: Fence | None,
    ) -> list[bool]:
        """:func:`confirm` of the deliveries at ``indices``, concurrently."""
        return list(
            await asyncio.gather(
                *(
                    confirm(
                        deliveries[i],
                        timeout_s=timeout_s,
                        give_up_s=give_up_s,
                        logger=loggers[i],
                        stopping=self.stopping,
                        gone=self.gone,
                        fence=fence,
                    )
                    for i in indices
                )
            )
        )


async def nak(
    delivery: Delivery, delay_s: float, logger: log.Logger, fence: Fence | None = None
) -> None:
    """Nak with a delay; a failure only means the redelivery comes after AckWait instead.
    With a ``fence``, not sent unless a fresh reading shows the delivery is of its stream's
    current incarnation (a nak of the new incarnation's message would hand back one that
    runs)."""
    if not await _allowed(delivery, fence, log.Action.NAK, logger):
        return
    try:
        await delivery.nak(delay=delay_s)
    except (nats.errors.Error, asyncio.TimeoutError) as exc:
        logger.debug(log.Event.ACK_GAVE_UP, action=log.Action.NAK, error=type(exc).__name__)


async def term(delivery: Delivery, logger: log.Logger, fence: Fence | None = None) -> None:
    """Term the delivery; if that is lost, the redelivery finds the inbox row and is acked.
    With a ``fence``, not sent unless a fresh reading shows the delivery is of its stream's
    current incarnation (a term of the new incarnation's message would lose it)."""
    if not await _allowed(delivery, fence, log.Action.TERM, logger):
        return
    try:
        await delivery.term()
    except (nats.errors.Error, asyncio.TimeoutError) as exc:
        logger.debug(log.Event.ACK_GAVE_UP, action=log.Action.TERM, error=type(exc).__name__)


async def _allowed(
    delivery: Delivery, fence: Fence | None, action: log.Action, logger: log.Logger
) -> bool:
    """Whether a nak or term may be sent now; one that may not is left to the delivery's
    AckWait (the redelivery, if its stream still has it, settles it)."""
    if fence is None:
        return True
    verdict = await fence.verdict(delivery)
    if verdict is False:
        fenced(logger, action)
    elif verdict is None:
        logger.debug(log.Event.ACK_GAVE_UP, action=action, error="stream not readable")
    return bool(verdict)
