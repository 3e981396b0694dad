"""The counts a Spark write's commit leaves for its caller (eop.contrib.spark.report), on
PostgreSQL."""

from __future__ import annotations

import sqlalchemy as sa

import eop
from eop.contrib.spark import report
from eop.contrib.spark.apply import Counts
from eop.pg import models

from .bed import bed_settings


def test_a_report_is_taken_once_and_abandoned_ones_are_purged(
    database_url: str, nats_url: str
) -> None:
    """take() returns a write's counts and deletes them; a commit run again keeps the first;
    a report left by a caller that died is removed by a later write, a fresh one is not."""
    app = eop.App(settings=bed_settings(database_url, nats_url))
    t = models.tables(app.settings.schema).spark_reports
    report.leave(app, "abandoned", report.BATCH_JOB, Counts(processed=1))
    report.leave(app, "pending", report.BATCH_JOB, Counts(processed=2))
    with app.sync_sessionmaker() as session, session.begin():
        session.execute(
            sa.update(t)
            .where(t.c.report_id == "abandoned")
            .values(created_at=sa.func.now() - sa.text("interval '8 days'"))
        )

    report.leave(app, "job", report.BATCH_JOB, Counts(processed=5, dead_lettered=1))
    report.leave(app, "job", report.BATCH_JOB, Counts(processed=9))  # the commit run again

    assert report.take(app, "job") == {report.BATCH_JOB: Counts(processed=5, dead_lettered=1)}
    assert report.take(app, "job") == {}
    with app.sync_sessionmaker() as session:
        left = set(session.execute(sa.select(t.c.report_id)).scalars())
    assert left == {"pending"}
    bind = app.sync_sessionmaker.kw["bind"]
    bind.dispose()
