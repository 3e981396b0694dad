"""Fetching from a durable pull consumer, with one subscription and no per-message timer.

nats-py's ``PullSubscription.fetch`` waits for every message of a batch with
its own task, timer and UUID (``next_msg``); at thousands of messages a
second that bookkeeping costs more than the message does. A
:class:`Fetcher` sends the same pull requests (``$JS.API.CONSUMER.MSG.NEXT``)
on one subscription of its own, counts the messages as they arrive and wakes
the waiting fetch once, when its request is complete. Each request has its own
reply subject under that subscription's wildcard, so a status that ends an
earlier, abandoned request is not taken for the end of the current one.

A fetch first asks with ``no_wait`` for as many messages as it wants: the
server sends what it has and, when that is fewer, ends the request with a
404 or 408 status. When there was nothing, it asks for one message with
``expires`` (a lingering request) and returns as soon as that message comes,
so a message on a quiet stream waits for no batch to fill. Before that
request it tells its caller (``lingering``), who gives back the room it kept
for a batch: an idle handler holding a batch's worth of the worker's slots
through each lingering request starved the busy handlers beside it. Messages that
arrive for a request nobody waits for any more (its fetch timed out) are
kept and returned by the next fetch, first; their lease runs meanwhile, as
it would in nats-py's internal queue.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Callable
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api

from eop.broker import client

_STATUS = api.Header.STATUS.value
_HEARTBEAT = api.StatusCode.CONTROL_MESSAGE.value
# The server's ways to end a pull request early: nothing there (404), expired
# (408), or a conflict such as a deleted consumer or too many waiting pulls (409).
_REQUEST_ENDED = frozenset(
    code.value
    for code in (
        api.StatusCode.NO_MESSAGES,
        api.StatusCode.REQUEST_TIMEOUT,
        api.StatusCode.CONFLICT,
    )
)
_EXPIRES_MARGIN_NS = 100_000  # the server ends the request before our deadline


class Fetcher:
    """Fetches batches from one durable pull consumer; see :mod:`eop.broker.fetcher`."""

    def __init__(self, nc: NATS, stream: str, durable: str) -> None:
        self._nc = nc
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._prefix = nc.new_inbox() + "."
        self._sub: Any = None
        self._requests = 0
        self._current = ""
        self._wanted = 0
        self._got: list[Msg] = []
        self._ended: Any = None  # the status message that ended the current request
        self._leftover: collections.deque[Any] = collections.deque()
        self._wake: asyncio.Future[None] | None = None

    async def start(self) -> Fetcher:
        """Subscribe to the reply subjects; returns self.

        On eop's connections the deliveries are taken inside the read loop
        (:meth:`eop.broker.client.Client.subscribe_direct`): no queue and no task hop
        per message.
        """
        if isinstance(self._nc, client.Client):
            self._sub = await self._nc.subscribe_direct(self._prefix + "*", self._on_message)
        else:
            self._sub = await self._nc.subscribe(self._prefix + "*", cb=self._on_message_cb)
        return self

    async def stop(self) -> None:
        """Unsubscribe (messages still unacked come back after their AckWait)."""
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def fetch(
        self, batch: int, timeout_s: float, *, lingering: Callable[[], None] | None = None
    ) -> list[Msg]:
        """Up to ``batch`` messages; waits at most ``timeout_s`` when there are none.

        ``lingering`` is called once when there were none and the fetch goes on to
        wait for one message: from then on it returns at most one.

        Raises ``nats.js.errors.APIError`` for a status that is not a normal end
        of a request (503: the consumer does not exist), ``nats.errors.Error``
        when the connection cannot publish, ``nats.errors.TimeoutError`` when
        no message came in time.
        """
        if self._leftover:
            return [self._leftover.popleft() for _ in range(min(batch, len(self._leftover)))]
        deadline = time.monotonic() + timeout_s
        msgs = await self._request({"batch": batch, "no_wait": True}, batch, deadline)
        if msgs:
            return msgs
        if lingering is not None:
            lingering()
        expires_ns = int(timeout_s * 1e9) - _EXPIRES_MARGIN_NS
        msgs = await self._request({"batch": 1, "expires": expires_ns}, 1, deadline)
        if not msgs:
            raise nats.errors.TimeoutError
        return msgs

    async def _request(self, body: dict[str, Any], wanted: int, deadline: float) -> list[Msg]:
        self._requests += 1
        self._current = f"{self._prefix}{self._requests}"
        self._wanted, self._got, self._ended = wanted, [], None
        loop = asyncio.get_running_loop()
        self._wake = loop.create_future()
        try:
            await self._nc.publish(self._next_subject, json.dumps(body).encode(), self._current)
            remaining = deadline - time.monotonic()
            if remaining > 0:
                timer = loop.call_later(remaining, _settle, self._wake)
                try:
                    await self._wake
                finally:
                    timer.cancel()
        finally:
            got, ended = self._got, self._ended
            self._current, self._got, self._wake = "", [], None
        if ended is not None and not got and ended.headers.get(_STATUS) not in _REQUEST_ENDED:
            nats.js.errors.APIError.from_msg(ended)
        return got

    async def _on_message_cb(self, msg: Msg) -> None:
        self._on_message(msg)

    def _on_message(self, msg: Msg) -> None:
        headers = msg.headers
        status = headers.get(_STATUS) if headers else None
        if status == _HEARTBEAT:
            return
        if status is None:
            # A message is delivered under its own subject, whichever request
            # asked for it: while a fetch waits, it is that fetch's.
            # Beyond what it asked for (an abandoned request's late message), or
            # with nobody waiting, it is kept for the next fetch: a fetch never
            # returns more than its batch, the worker's slots count on that.
            if self._wake is None or len(self._got) >= self._wanted:
                self._leftover.append(msg)
                return
            self._got.append(msg)
            if len(self._got) < self._wanted:
                return
        elif msg.subject == self._current:
            self._ended = msg
        else:
            return  # the end of a request nobody waits for any more
        if self._wake is not None:
            _settle(self._wake)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
