"""An ordered handler's workers and a Spark job of it: the job refuses to start beside them.

The workers keep a key's messages in order across processes by owning each
partition of the handler's keys through a lease (:mod:`eop.pg.ownership`,
docs/ordering.md). A Spark job knows nothing of those leases: it runs a
key's messages in stream order within its own partition, while a worker may
run the same key's next message at the same time. So a job of an ordered
handler starts only when no worker process is a live member of the handler
and no partition has an unexpired owner; the check runs on the driver (the
process that starts the job), on the app's database.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eop import errors
from eop.pg import models
from eop.pg.sql import ownership as sql

if TYPE_CHECKING:
    from eop.app import App
    from eop.handler import HandlerSpec

#: How many of the hosts holding a handler the refusal names.
_HOSTS_NAMED = 3


def check_idle(app: App, spec: HandlerSpec) -> None:
    """ConfigurationError, in one line, while worker processes hold ``spec``'s keys.

    Nothing to check for a handler without ``order_by``: workers and Spark
    may process its messages at once (the inbox settles who applies each).
    """
    if spec.order_by is None:
        return
    holders = _holders(app, spec.name)
    if not holders:
        return
    hosts = sorted({host for host, _ in holders})
    named = ", ".join(hosts[:_HOSTS_NAMED]) + (", ..." if len(hosts) > _HOSTS_NAMED else "")
    processes = f"{len(holders)} worker process{'es' if len(holders) != 1 else ''}"
    raise errors.ConfigurationError(
        f"handler {spec.name!r} keeps its keys in order and {processes} on "
        f"{len(hosts)} host{'s' if len(hosts) != 1 else ''} ({named}) run it: a Spark job "
        "beside them would run a key's messages out of order. Stop its workers (scale them "
        "to 0; a killed one's lease lapses after partition_lease_s), then run the Spark job, "
        "then start the workers again"
    )


def _holders(app: App, subscription: str) -> set[tuple[str, int | None]]:
    """(host, pid) of every live member of the handler and every unexpired partition owner."""
    tables = models.tables(app.settings.schema)
    with app.sync_sessionmaker() as session:
        members = list(session.execute(sql.member_status(tables)).all())
        partitions = list(session.execute(sql.status(tables)).all())
    found: set[tuple[str, int | None]] = set()
    for name, host, pid, _ in members:
        if name == subscription:
            found.add((str(host), pid))
    for name, _, _, host, pid, _, _, _, expires_in_s in partitions:
        if name == subscription and host is not None and (expires_in_s or 0) > 0:
            found.add((str(host), pid))
    return found
