"""The worker's HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz``.

A minimal HTTP/1.1 server on asyncio (one request per connection, GET and
HEAD only), so that it costs nothing when it is off.

- ``/healthz`` (liveness): answers 200 whenever the event loop runs (for a
  worker of several processes, when each of them does: :mod:`eop.observe.reports`).
- ``/readyz`` (readiness): 200 when every subscription is bound, the worker
  is not draining, NATS is connected and PostgreSQL answered recently; else
  503. The body lists each check.
- ``/metrics``: :mod:`eop.observe.metrics` in the Prometheus text format.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from eop import errors
from eop.observe import metrics
from eop.observe import observer as observe

DB_FRESH_S = 10.0
"""A committed outcome or a ping younger than this shows PostgreSQL is reachable."""
DB_PING_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 5.0
_MAX_REQUEST = 8192
_TEXT = "text/plain; charset=utf-8"

# Outcomes whose settling went through a committed (or read) transaction.
_DB_OUTCOMES = frozenset({"processed", "duplicate", "dead_lettered", "quarantined"})


class Checks(Protocol):
    """What ``/readyz`` asks: each condition and whether it holds."""

    async def check(self) -> dict[str, bool]:
        """Each readiness condition and whether it holds."""


class Readiness(observe.Observer):
    """Whether the worker should receive traffic; notes every committed outcome.

    PostgreSQL counts as reachable when a transaction of the protocol ended
    within :data:`DB_FRESH_S`; an idle worker pings it instead (one ping at a
    time, however many probes ask).
    """

    def __init__(
        self,
        *,
        bound: Callable[[], bool],
        draining: Callable[[], bool],
        nats_connected: Callable[[], bool],
        ping: Callable[[], Awaitable[object]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bound = bound
        self._draining = draining
        self._nats_connected = nats_connected
        self._ping = ping
        self._clock = clock
        self._db_ok_at = -float("inf")
        self._pinging: asyncio.Task[bool] | None = None

    def outcome(self, event: observe.Settled) -> None:
        """A settled outcome that touched the database proves it reachable."""
        if event.outcome.value in _DB_OUTCOMES:
            self._db_ok_at = self._clock()

    async def check(self) -> dict[str, bool]:
        """Each readiness condition and whether it holds."""
        return {
            "subscriptions_bound": self._bound(),
            "not_draining": not self._draining(),
            "nats_connected": self._nats_connected(),
            "database_reachable": await self._database(),
        }

    async def _database(self) -> bool:
        if self._clock() - self._db_ok_at <= DB_FRESH_S:
            return True
        if self._pinging is None or self._pinging.done():
            self._pinging = asyncio.create_task(self._ping_once())
        return await asyncio.shield(self._pinging)

    async def _ping_once(self) -> bool:
        try:
            await asyncio.wait_for(self._ping(), DB_PING_TIMEOUT_S)
        except Exception:
            # Any failure to answer means "not reachable"; the reason is the
            # database's to log, not the probe's.
            return False
        self._db_ok_at = self._clock()
        return True


class Endpoints:
    """The HTTP server of ``/metrics``, ``/healthz`` and ``/readyz``."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        metrics: Callable[[], bytes] | None,
        readiness: Checks,
        live: Callable[[], bool] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        """The port asked for; the bound one once :meth:`start` returned."""
        self.metrics = metrics
        """Renders ``/metrics`` (None: no ``/metrics``)."""
        self.readiness = readiness
        self.live = live
        """Whether ``/healthz`` answers 200 (None: whenever the loop answers)."""
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self, sock: socket.socket | None = None) -> None:
        """Listen (on ``sock`` if given, bound already by :func:`bind`).

        :class:`eop.ConfigurationError` if the address cannot be bound.
        """
        if sock is not None:
            self._server = await asyncio.start_server(self._serve, sock=sock)
        else:
            _check_port(self.port)
            try:
                self._server = await asyncio.start_server(self._serve, self.host, self.port)
            except OSError as exc:
                raise _unbindable(
                    self.host, self.port, exc
                ) from None  # one line: the reason is in it
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and end open requests."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            status, content_type, body = await self._respond(head)
            method = head.split(b" ", 1)[0]
            writer.write(_response(status, content_type, body, send_body=method != b"HEAD"))
            await writer.drain()
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            asyncio.TimeoutError,
            ConnectionError,
        ):
            pass
        finally:
            if task is not None:
                self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _respond(self, head: bytes) -> tuple[int, str, bytes]:
        if len(head) > _MAX_REQUEST:
            return 431, _TEXT, b"request header too large\n"
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, _TEXT, b"bad request\n"
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return 405, _TEXT, b"only GET and HEAD\n"
        if target == b"/healthz":
            if self.live is None or self.live():
                return 200, _TEXT, b"ok\n"
            return 503, _TEXT, b"not live\n"
        if target == b"/readyz":
            checks = await self.readiness.check()
            text = "".join(f"{name} {'ok' if ok else 'fail'}\n" for name, ok in checks.items())
            return (200 if all(checks.values()) else 503), _TEXT, text.encode()
        if target == b"/metrics" and self.metrics is not None:
            return 200, metrics.CONTENT_TYPE, self.metrics()
        return 404, _TEXT, b"not found: try /metrics, /healthz, /readyz\n"


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; :class:`eop.ConfigurationError` if it cannot be.

    For a server whose address must be taken before it runs (the supervisor's,
    before it starts its processes).
    """
    _check_port(port)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family)
    except OSError as exc:
        raise _unbindable(host, port, exc) from exc
    sock.setblocking(False)
    return sock


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise errors.ConfigurationError(f"metrics_port must be 0..65535, not {port}")


def _unbindable(host: str, port: int, exc: OSError) -> errors.ConfigurationError:
    return errors.ConfigurationError(
        f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
    )


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def _response(status: int, content_type: str, body: bytes, *, send_body: bool = True) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + (body if send_body else b"")
