"""``eop bench``: eop's throughput and latency beside the loops it replaces.

One run starts its own nats-server and PostgreSQL (eop.embedded, free ports)
and measures on them, one after another and each in its own process: (a) a
raw at-least-once loop (fetch + plain ack, no database); (b) the naive
exactly-once loop (per message a transaction with an inbox claim and one
INSERT, then one sequential ack_sync); (c) an `eop worker` with the default
settings, whose handler queues its write (eop.Writes); (d) an `eop worker`
with the --tuned flags and a batch handler; (e) eop default again, its handler
executing the INSERT through the session (a round trip per message); (f) eop
default in one process (``--processes 1``), where (c) runs one per CPU. (b)
to (f) do the same handler work: one INSERT per message. (r) the outbox
relay: --relay-messages rows committed first, then published by one ``eop
relay``, beside (rw) one default ``eop worker`` consuming the same messages
and (rp) a raw ``publish_async`` loop; (rl) and (rn): commit-to-PubAck latency
of rows committed one per transaction at --relay-rate, the relay woken by
NOTIFY (rl) or polling (rn). ``--runs`` picks runs by letter (r: all five).

Throughput: a backlog is published, then drained; the rate runs from the
first completion to the last, so start-up is excluded. Latency: then messages
are published at a steady share (--latency-load) of that rate for
--latency-s; publish-to-commit is the commit time of the effect row
(track_commit_timestamp) minus the stream timestamp ((a): publish-to-ack).
--big measures eop default at 10,000 and at 1,000,000 processed messages,
with the inbox row count at both points.

This package is also the app of the bench's workers (``eop.bench:app``) and
the program of its other child processes (``python -m eop.bench``).

Its modules: :mod:`~eop.bench.runs` (what is measured: the runs, their app,
the options), :mod:`~eop.bench.loops` (the raw and naive loops of (a) and (b)),
:mod:`~eop.bench.harness` (the servers' clients, the child processes, the
progress line, CPU time), :mod:`~eop.bench.measurement` (one run measured,
and the arithmetic), :mod:`~eop.bench.relay` (the relay's runs),
:mod:`~eop.bench.runner` (every run on fresh servers),
:mod:`~eop.bench.report` (the table); ``eop bench`` itself is :mod:`eop.cli.bench`.
"""

from __future__ import annotations

from eop.bench.harness import Bench, Child, Progress
from eop.bench.measurement import BigResult, Result, measure, measure_big, percentile, throughput
from eop.bench.report import format_report
from eop.bench.runner import run
from eop.bench.runs import BIG, RUNS, Options, Run, app, record, record_batch, record_direct

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
