"""PostgreSQL's CPU time split by its processes, for ``eop bench``'s report.

A run's PostgreSQL CPU a message tells how much; this tells whose: the
client connections' backends (the statements' own work), or the WAL writer,
autovacuum and the rest, whose share grows with the WAL and the dead rows a
message leaves behind rather than with its statements.
"""

from __future__ import annotations

from pathlib import Path

from eop.tools.bench import procstat

PARTS = ("backends", "WAL writer", "autovacuum", "others")
"""PostgreSQL's processes as :func:`cpu_s` groups them: the client connections'
backends, the WAL writer, the autovacuum workers (live, and the postmaster's reaped
time: a worker exits after its tables, and so would a connection closed meanwhile)
and the rest (postmaster, checkpointer, background writer, launchers)."""


def cpu_s(pid: int | None, stats: dict[int, procstat.ProcStat]) -> dict[str, float]:
    """CPU seconds of the PostgreSQL postmaster ``pid``'s tree, by :data:`PARTS`.

    A child's part comes from its process title (``postgres: walwriter``, or a
    connection's ``postgres: user database host ...``); empty if unknown.
    """
    if pid is None or pid not in stats:
        return {}
    parts = dict.fromkeys(PARTS, 0.0)
    parts["autovacuum"] = stats[pid].reaped_s
    parts["others"] = stats[pid].own_s
    for child, (ppid, own, _) in stats.items():
        if ppid != pid:
            continue
        try:
            title = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            title = ""
        role = title.removeprefix("postgres: ").split(" ", 1)[0].rstrip("\0")
        if role == "walwriter":
            parts["WAL writer"] += own
        elif title.startswith("postgres: autovacuum worker"):
            parts["autovacuum"] += own
        elif role in _PG_AUXILIARY or not title.startswith("postgres: "):
            parts["others"] += own
        else:
            parts["backends"] += own  # a connection's title starts with its user
    return parts


_PG_AUXILIARY = frozenset(
    {"checkpointer", "background", "autovacuum", "logical", "archiver", "stats", "walsender"}
)
