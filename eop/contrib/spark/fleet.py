"""An ordered handler's workers and a Spark job of it: the job refuses to start beside them.

The workers keep a key's messages in order across processes by owning each
partition of the handler's keys through a lease (:mod:`eop.ordering.ownership`,
docs/ordering.md). A Spark job runs a
key's messages in stream order within its own partition, while a worker may
run the same key's next message at the same time. So a job of an ordered
handler starts only when no worker process is a live member of the handler
and no partition has an unexpired owner; the check runs on the driver (the
process that starts the job), on the app's database. The job then holds every
partition's lease until it ends (:mod:`eop.contrib.spark.lease`), so a worker started
meanwhile owns nothing until the job gives them up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eop import errors
from eop.contrib.spark import lease
from eop.ordering import sql
from eop.pg import models

if TYPE_CHECKING:
    from eop.app import App
    from eop.handler import HandlerSpec

#: How many of the hosts holding a handler the refusal names.
_HOSTS_NAMED = 3


def check_idle(app: App, spec: HandlerSpec) -> None:
    """ConfigurationError, in one line, while worker processes (or another Spark job) hold
    ``spec``'s keys.

    Nothing to check for a handler without ``order_by``: workers and Spark
    may process its messages at once (the inbox settles who applies each).
    A job that passes takes every partition's lease for its run
    (:mod:`eop.contrib.spark.lease`): workers started meanwhile wait for it.
    """
    if spec.order_by is None:
        return
    holders = _holders(app, spec.name)
    jobs = sorted({host for name, host, _ in holders if lease.is_spark(name)})
    if jobs:
        raise errors.ConfigurationError(
            f"handler {spec.name!r} keeps its keys in order and a Spark job started on "
            f"{', '.join(jobs[:_HOSTS_NAMED])} runs it: wait for it to end (or stop it), "
            "then run this one (a job that was killed holds it until its lease lapses, "
            f"partition_lease_s: {app.settings.partition_lease_s:g} s)"
        )
    if not holders:
        return
    hosts = sorted({host for _, host, _ in holders})
    named = ", ".join(hosts[:_HOSTS_NAMED]) + (", ..." if len(hosts) > _HOSTS_NAMED else "")
    count = len({(host, pid) for _, host, pid in holders})
    processes = f"{count} worker process{'es' if count != 1 else ''}"
    raise errors.ConfigurationError(
        f"handler {spec.name!r} keeps its keys in order and {processes} on "
        f"{len(hosts)} host{'s' if len(hosts) != 1 else ''} ({named}) run it: a Spark job "
        "beside them would run a key's messages out of order. Stop its workers (scale them "
        "to 0; a killed one's lease lapses after partition_lease_s), then run the Spark job, "
        "then start the workers again"
    )


def _holders(app: App, subscription: str) -> set[tuple[str, str, int | None]]:
    """(member, host, pid) of every live member of the handler and unexpired partition owner."""
    tables = models.tables(app.settings.schema)
    with app.sync_sessionmaker() as session:
        rows = session.execute(sql.holders(tables, subscription)).all()
    return {(str(name), str(host), pid) for name, host, pid in rows}
