"""A Spark job's lease in PostgreSQL: renewed by the process that started the job, checked
by every task in the transaction it commits.

The process that starts a job (the driver, or the client of a Spark Connect
server) joins the handler's members (``members``) as ``<host>:<pid>:spark-...``
and renews that row every third of ``partition_lease_s``. For a handler with
``order_by`` it also takes every partition's lease (``partitions``), so a
worker started while the job runs finds no partition to own and waits
(docs/ordering.md): per-key order holds on the fleet. Each task, in its
partition's transaction, checks the lease (:func:`check`) and fails with
:class:`~eop.contrib.spark.errors.JobLeaseLost` when it ran out; the partitions' rows
stay share-locked until the task commits, so no worker can take one over
between the check and the commit.

So a job whose starting process died (a SIGKILLed client of a Connect server,
whose query would otherwise run on, unread) stops committing within
``partition_lease_s`` of its last renewal. The lease is given up when the
job ends: a waiting worker takes the partitions at its next tick.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

from eop import errors as eop_errors
from eop import log
from eop.contrib.spark import errors
from eop.ordering import sql
from eop.pg import models, statements
from eop.pg.sql import inbox as inbox_sql

if TYPE_CHECKING:
    from sqlalchemy import orm

    from eop.app import App
    from eop.handler import HandlerSpec

#: The member-name part that tells a Spark job's lease from a worker process's.
SPARK_MARK = ":spark-"


def is_spark(member: str) -> bool:
    """Whether ``member`` is a Spark job's lease rather than a worker process."""
    return SPARK_MARK in member


class JobLease:
    """The lease of one Spark job on one handler: taken, renewed in a thread, given up."""

    def __init__(self, app: App, spec: HandlerSpec) -> None:
        self.app = app
        self.spec = spec
        self.tables = models.tables(app.settings.schema)
        self.lease_s = app.settings.partition_lease_s
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.member = f"{self.host}:{self.pid}{SPARK_MARK}{uuid.uuid4().hex[:8]}"
        self.lost = threading.Event()
        """Set once a renewal found the lease gone: the job's tasks fail from then on."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ordered(self) -> bool:
        """Whether the lease holds the handler's partitions too."""
        return self.spec.order_by is not None

    def take(self) -> None:
        """Join the members (and, ordered, take every partition), or refuse in one line."""
        t, s, m = self.tables, self.spec.name, self.member
        with self._session() as session, session.begin():
            if self.ordered:
                counts = [int(r[0]) for r in session.execute(sql.partition_counts(t, s)).all()]
                if counts and counts != [self.spec.partitions]:
                    raise eop_errors.ConfigurationError(
                        f"handler {s!r} has {', '.join(map(str, counts))} partitions in the "
                        f"database but declares partitions={self.spec.partitions}: see "
                        "docs/ordering.md for changing the count"
                    )
                session.execute(sql.create_partitions(t, s, self.spec.partitions))
            # Members whose lease ran out died (a killed job): a worker of an ordered
            # handler forgets them at its ticks, but nothing else would an unordered one's.
            session.execute(sql.prune(t, s))
            session.execute(sql.join(t, s, m, self.host, self.pid, self.lease_s))
            if not self.ordered:
                return
            count = self.spec.partitions
            taken = session.execute(
                sql.acquire(t, s, m, self.host, self.pid, self.lease_s, count)
            ).all()
            if len(taken) < count:
                # A worker started between the fleet check and here: it keeps them (the
                # transaction rolls back, this member and its partitions with it).
                raise eop_errors.ConfigurationError(
                    f"handler {s!r} keeps its keys in order and a worker process took "
                    f"{count - len(taken)} of its {count} partitions as the Spark job "
                    "started: stop its workers (scale them to 0), then run the job again"
                )

    def prepare_lane(self, epoch: str) -> None:
        """Make, and commit, the handler's watermark row of the stream's ``epoch`` before
        any task runs (a worker's compactor makes it as its subscription binds).

        Without it the tasks of a first job each found the row missing and made it in
        their own transaction; the first to make it held it while it retried its failing
        messages in place, the others' claims waited on it past their lock timeout, and
        the job failed, every time.
        """
        stmt, params = inbox_sql.create_lanes(
            self.tables, self.spec.name, self.spec.stream, [epoch]
        )
        with self._session() as session, session.begin():
            session.execute(stmt, params)

    def renew(self) -> bool:
        """Extend the lease; False when it was found gone (ran out, or taken over)."""
        t, s, m = self.tables, self.spec.name, self.member
        with self._session() as session, session.begin():
            if session.execute(sql.fence_member(t, s, m)).first() is None:
                return False  # ran out: tasks may have failed on it already; not revived
            session.execute(sql.join(t, s, m, self.host, self.pid, self.lease_s))
            if self.ordered:
                renewed = session.execute(sql.renew(t, s, m, self.lease_s)).all()
                return len(renewed) == self.spec.partitions
        return True

    def give_up(self) -> None:
        """Release the partitions and leave the members: the workers take over."""
        t, s, m = self.tables, self.spec.name, self.member
        with self._session() as session, session.begin():
            if self.ordered:
                session.execute(sql.release(t, s, m, list(range(self.spec.partitions))))
            session.execute(sql.leave(t, s, m))

    def start(self) -> JobLease:
        """Renew in a daemon thread until :meth:`finish`."""
        self._thread = threading.Thread(target=self._run, name="eop-spark-lease", daemon=True)
        self._thread.start()
        return self

    def finish(self) -> None:
        """Stop renewing and give the lease up (best effort: else it runs out)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.lease_s)
        try:
            self.give_up()
        except Exception as exc:
            log.get_logger().warning(
                log.Event.SPARK_LEASE_FAILED,
                handler=self.spec.name,
                error=log.brief_error(exc),
            )

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                if not self.renew():
                    self.lost.set()
                    log.get_logger().error(log.Event.SPARK_LEASE_LOST, handler=self.spec.name)
                    return
            except Exception as exc:
                # Tried again at the next tick; the tasks stop if the lease runs out meanwhile.
                log.get_logger().warning(
                    log.Event.SPARK_LEASE_FAILED,
                    handler=self.spec.name,
                    error=log.brief_error(exc),
                )

    def _session(self) -> orm.Session:
        return self.app.sync_sessionmaker()


@contextlib.contextmanager
def held(app: App, spec: HandlerSpec) -> Iterator[JobLease]:
    """The job's lease for the block; given up at its end."""
    lease = JobLease(app, spec)
    lease.take()
    lease.start()
    try:
        yield lease
    finally:
        lease.finish()


async def check(tx: statements.Statements, spec: HandlerSpec, schema: str, member: str) -> None:
    """In a task's transaction: JobLeaseLost unless ``member``'s lease holds (and, for an
    ordered handler, every partition's, share-locked until the transaction ends)."""
    t = models.tables(schema)
    if spec.order_by is not None:
        held_now = len(await tx.select(sql.fence_partitions(t, spec.name, member)))
        want = spec.partitions
    else:
        held_now, want = len(await tx.select(sql.fence_member(t, spec.name, member))), 1
    if held_now < want:
        raise errors.JobLeaseLost(
            f"the lease of this Spark job on handler {spec.name!r} ran out: the process "
            "that started it stopped renewing it (it died, or lost the database), or a "
            "worker took the handler's partitions over; nothing more commits. Run the job "
            "again: a stream continues from its checkpoint"
        )
