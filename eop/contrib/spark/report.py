"""A Spark write's outcome counts, from its commit (in a process of Spark's) to the caller.

Spark calls a Python data source's ``commit`` with the tasks' commit messages
in a Python process it starts on the driver's side (the cluster's driver, or
the Spark Connect server), never in the process that called ``save()`` or
``start()``. The commit leaves the summed :class:`~eop.contrib.spark.apply.Counts`
in ``spark_reports`` under the report id the caller chose; the caller takes
(reads and deletes) them: once after a batch write, as the micro-batches
commit for a stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from eop import log
from eop.app import App
from eop.contrib.spark.apply import Counts
from eop.pg import models
from eop.pg.sql import spark as spark_sql

#: The batch id of a batch write's report.
BATCH_JOB = models.BATCH_JOB
POLL_S = 0.5
#: A report not taken after this long was left by a caller that died: removed.
ABANDONED_AFTER_S = 7 * 24 * 3600.0


def leave(app: App, report_id: str, batch_id: int, counts: Counts) -> None:
    """Store ``counts`` under ``(report_id, batch_id)``; a commit run again keeps the first."""
    row = {"report_id": report_id, "batch_id": batch_id, **counts.as_dict()}
    tables = models.tables(app.settings.schema)
    with app.sync_sessionmaker() as session, session.begin():
        session.execute(spark_sql.add_spark_report(tables, row))
        session.execute(spark_sql.purge_spark_reports(tables, ABANDONED_AFTER_S))


def take(app: App, report_id: str) -> dict[int, Counts]:
    """The counts left under ``report_id`` by batch id, deleted as they are read."""
    stmt = spark_sql.take_spark_reports(models.tables(app.settings.schema), report_id)
    with app.sync_sessionmaker() as session, session.begin():
        rows = session.execute(stmt).all()
    return {int(batch_id): Counts(*(int(n) for n in counted)) for batch_id, *counted in rows}


class Poller:
    """Hands a stream's micro-batch counts to ``on_batch`` as they commit, in a thread.

    It stops once ``active()`` says the query ended, after a last look, or
    at :meth:`finish`; ``active()`` failing is not its end.
    """

    def __init__(
        self,
        app: App,
        report_id: str,
        on_batch: Callable[[int, Counts], None],
        active: Callable[[], bool],
        poll_s: float = POLL_S,
    ) -> None:
        self.app = app
        self.report_id = report_id
        self.on_batch = on_batch
        self.active = active
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eop-spark-report", daemon=True)

    def start(self) -> Poller:
        """Start polling."""
        self._thread.start()
        return self

    def finish(self, timeout_s: float = 30.0) -> None:
        """Wait for the last look after the query ended (or end it now)."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def _active(self) -> bool:
        try:
            return self.active()
        except Exception:
            # The query's state is unknown (a Spark Connect server lost): the caller's
            # wait for the query fails with the reason and ends this thread (finish).
            return True

    def _run(self) -> None:
        while True:
            ending = self._stop.is_set() or not self._active()
            try:
                taken = take(self.app, self.report_id)
            except Exception as exc:
                # The rows stay until the next look; the query itself is not disturbed.
                log.get_logger().warning(log.Event.SPARK_REPORT_UNREAD, error=log.brief_error(exc))
                taken = {}
            for batch_id, counts in sorted(taken.items()):
                self.on_batch(batch_id, counts)
            if ending:
                return
            self._stop.wait(self.poll_s)
