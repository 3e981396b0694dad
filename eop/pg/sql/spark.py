"""The Spark jobs' reports (:mod:`eop.contrib.spark.report`)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from eop.pg import models


def add_spark_report(t: models.Tables, row: dict[str, Any]) -> sa.Executable:
    """A Spark write's counts under its report id; a commit run again keeps the first."""
    return postgresql.insert(t.spark_reports).values(row).on_conflict_do_nothing()


def purge_spark_reports(t: models.Tables, older_than_s: float) -> sa.Executable:
    """Reports nobody took (their caller died) once older than ``older_than_s``."""
    r = t.spark_reports
    age = sa.func.make_interval(0, 0, 0, 0, 0, 0, older_than_s)
    return sa.delete(r).where(r.c.created_at < sa.func.now() - age)


def take_spark_reports(t: models.Tables, report_id: str) -> sa.Executable:
    """The counts left under ``report_id``, deleted as they are read, by batch id."""
    r = t.spark_reports
    counted = [r.c.processed, r.c.duplicates, r.c.dead_lettered, r.c.quarantined, r.c.skipped]
    return sa.delete(r).where(r.c.report_id == report_id).returning(r.c.batch_id, *counted)
