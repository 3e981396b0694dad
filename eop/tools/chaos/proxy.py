"""A TCP fault proxy: put it between the workers and NATS, or the workers and PostgreSQL.

It forwards bytes both ways and, on command at run time, makes the network
misbehave the ways that matter to the protocol:

- :meth:`FaultProxy.set_latency`: every chunk arrives that much later, in order;
- :meth:`FaultProxy.blackhole`: nothing moves (bytes are held, not lost, so a
  healed connection carries on, like a network partition that heals before
  TCP gives up);
- :meth:`FaultProxy.reset`: every open connection is cut with a TCP RST;
- :meth:`FaultProxy.drop_next_reply`: the reply to the next JetStream ack
  (``nats``: the reply frame vanishes, the ack times out) or to the next COMMIT
  (``postgres``: the reply vanishes and the connection is cut, so the client
  cannot know whether it committed).

The proxy runs in the caller's event loop; its methods are called from there.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import struct
from typing import Literal

from eop.tools.chaos import wire

Protocol = Literal["nats", "postgres", "raw"]

_CHUNK = 65536


class FaultProxy:
    """Listens on 127.0.0.1 and forwards every connection to ``upstream``."""

    def __init__(
        self, upstream_host: str, upstream_port: int, *, protocol: Protocol = "raw"
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.protocol = protocol
        self.latency_s = 0.0
        self.drop_armed = 0
        """Replies still to drop (each :meth:`drop_next_reply` adds one)."""
        self.stats: collections.Counter[str] = collections.Counter()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._conns: set[_Connection] = set()

    @property
    def port(self) -> int:
        """The port clients connect to."""
        assert self._server is not None, "start() the proxy first"
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, port: int = 0) -> None:
        """Listen on 127.0.0.1:``port`` (0: a free port)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)

    async def close(self) -> None:
        """Stop listening and cut every connection."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.reset()

    def set_latency(self, seconds: float) -> None:
        """Delay every chunk, in both directions, by ``seconds``."""
        self.latency_s = seconds

    def blackhole(self, on: bool = True) -> None:
        """Hold every byte in both directions (``on``), or let them through again."""
        if on:
            self._flowing.clear()
        else:
            self._flowing.set()

    def reset(self, every: int = 1) -> int:
        """Cut every ``every``-th open connection (1: all) with a RST; returns how many."""
        conns = list(self._conns)[:: max(every, 1)]
        for conn in conns:
            conn.abort()
        self.stats["resets"] += len(conns)
        return len(conns)

    def drop_next_reply(self) -> None:
        """Lose the reply to the next ack (nats) or the next COMMIT (postgres)."""
        self.drop_armed += 1

    def heal(self) -> None:
        """No latency, no black hole, no reply left to drop."""
        self.latency_s = 0.0
        self.drop_armed = 0
        self._flowing.set()

    @property
    def connections(self) -> int:
        """Open client connections."""
        return len(self._conns)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            # Upstream down: the client sees its connection refused-then-closed.
            _abort(writer)
            return
        conn = _Connection(self, writer, up_writer)
        self._conns.add(conn)
        self.stats["connections"] += 1
        try:
            await conn.run(reader, up_reader)
        finally:
            self._conns.discard(conn)
            conn.abort()


class _Connection:
    """One proxied connection: two pipes and the protocol state of reply dropping."""

    def __init__(
        self, proxy: FaultProxy, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter
    ) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.dropping: set[bytes] = set()
        self.cut_on_reply = False
        self._done = asyncio.Event()
        self._nats: tuple[wire.NatsFramer, wire.NatsFramer] | None = None
        self._pg: tuple[wire.PgFramer, wire.PgFramer] | None = None
        if proxy.protocol == "nats":
            self._nats = (wire.NatsFramer(), wire.NatsFramer())
        elif proxy.protocol == "postgres":
            to_server, to_client = wire.PgFramer(client=True), wire.PgFramer(client=False)
            to_server.peer = to_client
            self._pg = (to_server, to_client)

    async def run(self, client: asyncio.StreamReader, upstream: asyncio.StreamReader) -> None:
        pipes = [
            asyncio.create_task(self._pipe(client, self.upstream, to_server=True)),
            asyncio.create_task(self._pipe(upstream, self.client, to_server=False)),
        ]
        await self._done.wait()
        for task in pipes:
            task.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)

    def abort(self) -> None:
        _abort(self.client)
        _abort(self.upstream)
        self._done.set()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, to_server: bool
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes, bool]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(queue, writer))
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                kept, cut = self._filter(data, to_server)
                queue.put_nowait((loop.time() + self.proxy.latency_s, kept, cut))
                if cut:
                    break
            await queue.join()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
            self.abort()

    async def _send(
        self, queue: asyncio.Queue[tuple[float, bytes, bool]], writer: asyncio.StreamWriter
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data, cut = await queue.get()
            try:
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self.proxy._flowing.wait()
                if data:
                    writer.write(data)
                    await writer.drain()
                if cut:
                    self.proxy.stats["cut_after_dropped_reply"] += 1
                    self.abort()
            except OSError:
                self.abort()
            finally:
                queue.task_done()

    def _filter(self, data: bytes, to_server: bool) -> tuple[bytes, bool]:
        """The bytes to forward, and whether to cut the connection after them."""
        if self._nats is not None:
            return self._filter_nats(data, to_server), False
        if self._pg is not None:
            return self._filter_pg(data, to_server)
        return data, False

    def _filter_nats(self, data: bytes, to_server: bool) -> bytes:
        framer = self._nats[0] if to_server else self._nats[1]  # type: ignore[index]  # set
        kept = bytearray()
        for frame in framer.feed(data):
            if to_server:
                reply = wire.nats_ack_reply_subject(frame)
                if reply is not None and self.proxy.drop_armed > 0:
                    self.proxy.drop_armed -= 1
                    self.dropping.add(reply)
            elif self.dropping and wire.nats_delivery_subject(frame) in self.dropping:
                self.dropping.discard(wire.nats_delivery_subject(frame) or b"")
                self.proxy.stats["dropped_ack_replies"] += 1
                continue
            kept += frame.raw
        return bytes(kept)

    def _filter_pg(self, data: bytes, to_server: bool) -> tuple[bytes, bool]:
        framer = self._pg[0] if to_server else self._pg[1]  # type: ignore[index]  # set
        kept = bytearray()
        for frame in framer.feed(data):
            if to_server:
                if self.proxy.drop_armed > 0 and wire.pg_is_commit(frame):
                    self.proxy.drop_armed -= 1
                    self.cut_on_reply = True
            elif self.cut_on_reply and wire.pg_ends_command(frame):
                # The server has decided; the client will never hear what.
                self.proxy.stats["dropped_commit_replies"] += 1
                return bytes(kept), True
            kept += frame.raw
        return bytes(kept), False


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a RST rather than a FIN, as a crashed peer or a middlebox would."""
    sock = writer.get_extra_info("socket")
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
