"""A throwaway NATS cluster: three nats-servers with JetStream, routed on 127.0.0.1.

For the tests of replicated streams and the chaos harness's cluster mode.
Each server has its own name (``n1``, ``n2``, ...), client port, route port,
monitoring port and store directory; :meth:`NatsCluster.kill` and
:meth:`NatsCluster.start_server` crash one and bring it back on the same
store, as a machine that reboots would. Whether JetStream is healthy again is
read from each server's ``/healthz`` (which answers 200 only once the server's
JetStream, its meta group and its streams and consumers are current).
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING

from eop import errors
from eop.tools import _child, embedded

if TYPE_CHECKING:
    from typing_extensions import Self

CLUSTER_NAME = "eop"
"""The name every server of the cluster gives it (routes between clusters of other
names are refused)."""


class NatsCluster(_child.Managed):
    """``size`` clustered nats-servers on 127.0.0.1, by server name.

    ``args`` go to every server (``["--user", "u", "--pass", "p"]``: clients
    only; the routes need none on loopback). Use as a context manager, or call
    :meth:`start` and :meth:`close`.
    """

    def __init__(
        self, size: int = 3, *, args: Sequence[str] = (), start_timeout_s: float = 20.0
    ) -> None:
        if size < 1:
            raise errors.ConfigurationError(f"a cluster needs at least one server, not {size}")
        self.names = [f"n{i}" for i in range(1, size + 1)]
        routes = {name: embedded.free_port() for name in self.names}
        self._http = {name: embedded.free_port() for name in self.names}
        self.servers: dict[str, embedded.NatsServer] = {}
        for name in self.names:
            others = ", ".join(
                f"nats-route://{embedded.HOST}:{port}" for n, port in routes.items() if n != name
            )
            config = (
                f"server_name: {name}\n"
                f"http: {embedded.HOST}:{self._http[name]}\n"
                f"cluster {{\n  name: {CLUSTER_NAME}\n"
                f"  listen: {embedded.HOST}:{routes[name]}\n  routes: [{others}]\n}}\n"
            )
            self.servers[name] = embedded.NatsServer(
                args=args, config=config, start_timeout_s=start_timeout_s
            )
        self._start_timeout_s = start_timeout_s

    @property
    def url(self) -> str:
        """Every server's client URL, comma separated (as ``nats_url`` takes them)."""
        return ",".join(server.url for server in self.servers.values())

    @property
    def ports(self) -> list[int]:
        """The servers' client ports, in name order."""
        return [server.port for server in self.servers.values()]

    def start(self) -> None:
        """Start every server, then wait until JetStream is healthy on all of them."""
        for server in self.servers.values():
            server.start()
        self.wait_healthy()

    def kill(self, name: str) -> None:
        """SIGKILL the server ``name``, as a crash would; its store stays."""
        self._server(name).kill()

    def start_server(self, name: str) -> None:
        """Start the server ``name`` again (on its port and store) and wait for its port."""
        self._server(name).start()

    def running(self, name: str) -> bool:
        """Whether the server ``name`` runs."""
        return self._server(name).pid is not None

    def healthy(self, name: str) -> bool:
        """Whether ``name`` answers its ``/healthz`` with 200: JetStream current there."""
        url = f"http://{embedded.HOST}:{self._http[name]}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                return int(reply.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def meta_leader(self) -> str | None:
        """The server leading the JetStream meta group now (None if no running server
        knows one)."""
        for name in self.names:
            if not self.running(name):
                continue
            url = f"http://{embedded.HOST}:{self._http[name]}/jsz"
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    leader = json.loads(reply.read()).get("meta_cluster", {}).get("leader")
            except (urllib.error.URLError, OSError, ValueError):
                continue
            if leader:
                return str(leader)
        return None

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Wait until every running server is healthy; fail with their logs after the timeout."""
        deadline = time.monotonic() + (timeout_s or 3 * self._start_timeout_s)
        while True:
            sick = [n for n in self.names if self.running(n) and not self.healthy(n)]
            if not sick:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}:\n{self.servers[n].log()[-2000:]}" for n in sick)
                raise errors.EmbeddedServerError(
                    f"NATS cluster not healthy in time ({', '.join(sick)}):\n{tails}"
                )
            time.sleep(0.1)

    def log(self, name: str) -> str:
        """The output of server ``name`` so far."""
        return self._server(name).log()

    def close(self) -> None:
        """Stop every server and remove their directories."""
        for server in self.servers.values():
            with contextlib.suppress(Exception):  # close the others whatever one does
                server.close()

    def _server(self, name: str) -> embedded.NatsServer:
        try:
            return self.servers[name]
        except KeyError:
            raise errors.ConfigurationError(
                f"no server {name!r} in the cluster ({', '.join(self.names)})"
            ) from None

    def __enter__(self) -> Self:
        # A failed start leaves the servers started before it running: stop them now,
        # not when their objects are collected.
        try:
            return super().__enter__()
        except BaseException:
            self.close()
            raise
