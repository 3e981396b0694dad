"""All of eop's SQL but that of the feature packages, a module per concern.

The outbox's is :mod:`eop.outbox.sql`, the ordered handlers' :mod:`eop.ordering.sql`.

Statements are built with SQLAlchemy Core from :mod:`eop.pg.models`, so they
follow the configured schema and run unchanged on async and sync sessions;
:func:`eop.pg.sql.base.for_psycopg` turns one into text and values for a
psycopg cursor that no SQLAlchemy session owns (Django's, in
:mod:`eop.contrib.django`).

- :mod:`~eop.pg.sql.base`: what they share (a message's key, timeouts, the msg-id digest);
- :mod:`~eop.pg.sql.claim`: the claim (the hot path);
- :mod:`~eop.pg.sql.inbox`: the watermark and compaction, look-ups, the dead letter;
- :mod:`~eop.pg.sql.retries`: handler failures and the retries held in the database;
- :mod:`~eop.pg.sql.floors`: the consumers' ack floors (the stuck-delivery clock);
- :mod:`~eop.pg.sql.dead_letters`: ``eop dlq`` and ``eop status``;
- :mod:`~eop.pg.sql.audit`: ``eop audit``;
- :mod:`~eop.pg.sql.testkit`: :mod:`eop.testing`;
- :mod:`~eop.pg.sql.spark`: the Spark jobs' reports.
"""
