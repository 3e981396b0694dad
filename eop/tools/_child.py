"""Server child processes of :mod:`eop.tools.embedded`: spawn, signal, wait, clean up.

Each server gets a scratch directory ``eop-<kind>-*`` in the temp folder,
holding its log and two pid files: ours (the owner) and the server's. A test
run killed outright (SIGKILL, or SIGTERM, which skips Python's exit handlers)
cannot stop its servers; the next run finds their scratch directories, sees
that the owner is gone, and stops them (:func:`reap_orphans`).

What the servers share besides: :class:`Server` (pid, output, restart, ``with``),
:class:`Managed` (``with`` alone) and :func:`unprivileged_account` (whom to run as
under root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from eop import errors, scratch_owners

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import TracebackType

    from typing_extensions import Self

PREFIX = "eop-"
OWNER_FILE = scratch_owners.OWNER_FILE
Account = tuple[int, int]
"""A uid and gid to run a server as."""
SERVER_FILE = "server.pid"


class Child:
    """One server process, its log and its scratch directory.

    The state lives here rather than in the server object so that a
    ``weakref.finalize`` can stop the process without keeping the server alive.
    """

    def __init__(self, kind: str, stop_signal: signal.Signals) -> None:
        reap_orphans(kind, stop_signal)
        self.scratch = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-"))
        scratch_owners.mark_owner(self.scratch)
        self.log = self.scratch / f"{kind}.log"
        self.stop_signal = stop_signal
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        proc = self.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def spawn(
        self, argv: Sequence[str], *, cwd: Path | None = None, account: Account | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` (as ``account``'s uid and gid if given) in a process group of its own."""
        with self.log.open("ab") as out:
            # A session of its own: a terminal's Ctrl-C does not reach the
            # server directly, and signalling the group reaches its children.
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                start_new_session=True,
                user=None if account is None else account[0],
                group=None if account is None else account[1],
                extra_groups=None if account is None else [],
            )

    def start(
        self, argv: Sequence[str], *, cwd: Path | None = None, account: Account | None = None
    ) -> subprocess.Popen[bytes]:
        """Spawn the server itself, and record its pid for :func:`reap_orphans`."""
        self.proc = self.spawn(argv, cwd=cwd, account=account)
        (self.scratch / SERVER_FILE).write_text(str(self.proc.pid))
        return self.proc

    def stop(self, sig: signal.Signals, timeout_s: float) -> None:
        """Send ``sig`` to the server; SIGKILL its group if still there after ``timeout_s``."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server's whole process group and reap the server."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def tail(self, limit: int = 4000) -> str:
        """The end of the server's output."""
        try:
            return self.log.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def failed(self, what: str) -> errors.EmbeddedServerError:
        """An error saying ``what`` went wrong, with the end of the server's output."""
        return errors.EmbeddedServerError(f"{what}; its output ends with:\n{self.tail()}")

    def cleanup(self) -> None:
        """Stop the server if it still runs and remove the scratch directory (idempotent)."""
        self.stop(self.stop_signal, 10.0)
        shutil.rmtree(self.scratch, ignore_errors=True)


class Managed:
    """Started on entering a ``with`` block, closed on leaving it."""

    def start(self) -> None:
        """Start what this manages."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop what this manages and release what it holds."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Server(Managed):
    """A server run as one :class:`Child`: its pid and output while it runs, a restart."""

    _child: Child

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._child.pid

    def log(self) -> str:
        """The server's output so far (its last 100 kB)."""
        return self._child.tail(100_000)

    def stop(self) -> None:
        """Stop the server cleanly."""
        raise NotImplementedError

    def restart(self) -> None:
        """Stop (if running) and start again on the same port and files (store, data)."""
        self.stop()
        self.start()


def unprivileged_account(names: Sequence[str], server: str) -> Account | None:
    """As root, the uid and gid of the first of the accounts ``names`` that exists, to run
    ``server`` as (PostgreSQL and PgBouncer refuse to run as root); None when not root."""
    if os.name != "posix" or os.geteuid() != 0:
        return None
    import pwd

    for name in names:
        with contextlib.suppress(KeyError):
            entry = pwd.getpwnam(name)
            return entry.pw_uid, entry.pw_gid
    raise errors.EmbeddedServerError(
        f"running as root, {server} needs an unprivileged account: {names[0]!r} does not exist"
    )


def wait_for_port(host: str, port: int, child: Child, timeout_s: float) -> None:
    """Wait until ``port`` accepts connections; fail if the server exits or time runs out."""
    proc = child.proc
    assert proc is not None
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise child.failed(f"server exited with status {proc.returncode} while starting")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        if time.monotonic() > deadline:
            raise child.failed(f"server did not accept connections on {port} in {timeout_s}s")
        time.sleep(0.005)


def reap_orphans(kind: str, stop_signal: signal.Signals) -> None:
    """Stop the servers, and remove the scratch directories, of owners that died."""
    for scratch in Path(tempfile.gettempdir()).glob(f"{PREFIX}{kind}-*"):
        if not scratch_owners.owner_gone(scratch):
            continue
        server = scratch_owners.read_pid(scratch / SERVER_FILE)
        if server is not None and scratch_owners.alive(server):
            # Only a process whose command line names this directory is ours:
            # a pid may have been reused since.
            if not _names(server, scratch):
                continue
            _stop_orphan(server, stop_signal)
        shutil.rmtree(scratch, ignore_errors=True)


def _stop_orphan(pid: int, stop_signal: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, stop_signal)
        deadline = time.monotonic() + 5.0
        while scratch_owners.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(pid, signal.SIGKILL)


def _names(pid: int, scratch: Path) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return os.fsencode(scratch) in cmdline
