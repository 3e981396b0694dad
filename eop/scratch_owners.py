"""Which process owns a scratch directory, and whether it has died.

A process that makes a directory others may outlive it with (an embedded
server's scratch directory, a worker's metrics directory) names itself in
it; whoever comes next removes the directories of owners that are gone, as
a process killed with SIGKILL cannot clean up after itself.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

#: The file in an owned directory naming its owner: pid, then pid namespace.
OWNER_FILE = "owner.pid"


def mark_owner(directory: Path) -> None:
    """Name this process as the owner of ``directory`` (see :func:`owner_gone`)."""
    (directory / OWNER_FILE).write_text(f"{os.getpid()} {_pid_namespace()}")


def owner_gone(directory: Path) -> bool:
    """Whether the process :func:`mark_owner` named in ``directory`` is known to have died.

    Not for a directory without an owner file (not ours, or still being made),
    nor for an owner of another pid namespace (a container sharing ``/tmp``),
    where its pid means nothing.
    """
    owner = read_pid(directory / OWNER_FILE)
    return owner is not None and not alive(owner) and _same_namespace(directory / OWNER_FILE)


def read_pid(path: Path) -> int | None:
    """The pid at the start of ``path``, or None when unreadable."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def _same_namespace(owner_file: Path) -> bool:
    try:
        return owner_file.read_text().split()[1:] == [_pid_namespace()]
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaps does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie nobody reaps is dead for our purposes.
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True
