"""``eop bench``: eop's throughput and latency beside the loops it replaces.

One run starts its own nats-server and PostgreSQL (eop.tools.embedded, free
ports) and measures on them, one after another and each in its own process(es),
eop beside what a user could write instead: (a) the leanest at-least-once loop
nats-py allows (no database: the client's ceiling), and (an) the same in as many
processes as an ``eop worker`` runs by default; (h) a competent hand-written
exactly-once consumer (batched transactions on asyncpg, a multi-row claim,
concurrent ack_sync), and (hn) in eop's process count, and (hb) that one keeping
its inbox bounded as eop does (a delete below the ack floor every 1,000
messages); (b) exactly-once written plainly. Then eop at default settings with
each handler style of the README, in its default process count and in one
process (``1``): (c, c1) eop.Writes, (o, o1) an async handler's ORM
``session.add``, (s, s1) a sync handler's, (k, k1) a batch handler; (d) the
--tuned flags with the batch handler; (e) the INSERT through ``session.execute``
(a round trip per message). Every database run does the same handler work: one
INSERT per message. Each eop run is printed beside the baselines with as many
processes. (r) the outbox relay: --relay-messages rows committed first, then
published by one ``eop relay``, beside (rw) one default ``eop worker`` consuming
the same messages and (rp) a raw ``publish_async`` loop; (rl) and (rn):
commit-to-PubAck latency of rows committed one per transaction at --relay-rate,
the relay woken by NOTIFY (rl) or polling (rn). (f) a poison flood:
--flood-messages / 2 messages whose handler raises, then as many good ones,
through an ``eop worker`` at default settings but a 1 s backoff cap, beside (fh)
the hand-written consumer extended to dead-letter after as many attempts with
the same backoff (nak with a delay, JetStream's delivery count), in as many
processes: the time until every good message took effect and until every failing
one is dead-lettered, and CPU per handler run. ``--runs`` picks runs by key (r:
all five, f: both).

Throughput: a backlog is published, then drained; the rate runs from the
first completion to the last, so start-up is excluded. Latency: then messages
are published at a steady share (--latency-load) of that rate for
--latency-s; publish-to-commit is the commit time of the effect row
(track_commit_timestamp) minus the stream timestamp ((a), (an): publish-to-ack).
CPU time per message of the consumer process(es) and of each server is
measured beside msg/s: it is steadier on a shared machine.
--big measures eop default at 10,000 and at 1,000,000 processed messages:
the rate, the worker's CPU per message and memory, the inbox rows (against
max_ack_pending + compaction_after_messages) and the inbox table's size
(``--runs none --big``: the long run alone). --pg-profile, instead of timing,
counts PostgreSQL's work per message of the chosen runs (statements,
transactions, WAL, rows, buffer accesses; by default h, hn, c1, c).

This package is also the app of the bench's workers (``eop.tools.bench:app``) and
the program of its other child processes (``python -m eop.tools.bench``).

Its modules: :mod:`~eop.tools.bench.runs` (what is measured: the runs, their app,
the options), :mod:`~eop.tools.bench.baselines` (the consumers of (a), (h), (b) and (fh)),
:mod:`~eop.tools.bench.loops` (the relay runs' publisher and polling relay),
:mod:`~eop.tools.bench.harness` (the servers' clients, the child processes, the
progress line, CPU time), :mod:`~eop.tools.bench.measurement` (one run measured,
and the arithmetic), :mod:`~eop.tools.bench.relay` (the relay's runs),
:mod:`~eop.tools.bench.flood` (the poison flood's runs),
:mod:`~eop.tools.bench.runner` (every run on fresh servers),
:mod:`~eop.tools.bench.report` (the table), :mod:`~eop.tools.bench.pgprofile` (``--pg-profile``:
PostgreSQL's work per message, counted by :mod:`~eop.tools.bench.pgcount`, not timed);
``eop bench`` itself is :mod:`eop.cli.bench`.
"""

from __future__ import annotations

from eop.tools.bench.harness import Bench, Child, Progress
from eop.tools.bench.measurement import (
    BigResult,
    Result,
    measure,
    measure_big,
    percentile,
    throughput,
)
from eop.tools.bench.report import format_report
from eop.tools.bench.runner import run
from eop.tools.bench.runs import (
    BIG,
    RUNS,
    Options,
    Run,
    app,
    record,
    record_batch,
    record_direct,
    record_or_fail,
    record_orm,
    record_sync,
)

__all__ = [
    # running it
    "run",
    "format_report",
    # what is measured
    "Options",
    "Run",
    "RUNS",
    "BIG",
    "app",
    "record",
    "record_batch",
    "record_direct",
    "record_or_fail",
    "record_orm",
    "record_sync",
    # measuring
    "Bench",
    "Child",
    "Progress",
    "Result",
    "BigResult",
    "measure",
    "measure_big",
    "throughput",
    "percentile",
]
