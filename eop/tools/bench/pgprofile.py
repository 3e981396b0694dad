"""``eop bench --pg-profile``: where PostgreSQL's work goes per message, counted.

Each chosen consumer (by default (h) and (hn), the hand-written one in one
and in eop's process count, and (c1) and (c), eop's default ``eop.Writes``
worker in the same two counts) drains a backlog of ``--messages`` on a
PostgreSQL of the bench's own that logs every statement
(:mod:`eop.tools.bench.pgcount`). Start-up is excluded as in the timed runs: the
consumer starts, its consumer is paused, the backlog published; then every
table is vacuumed and a CHECKPOINT taken (so each run starts with no dead
rows and its first change of each page writes a full-page image, as the
others'), the counters read, and the consumer resumed. After the drain the
consumer runs on for a compaction interval and a second, so that eop's
inbox is emptied by the rounds the run caused (a bounded inbox is part of
the work per message), and is stopped (its backends' statistics are
written as they exit). Then the counters again, ``pg_waldump`` over the
stretch, and a VACUUM of what the run left dead, its WAL counted apart.

Per consumer: statements, transactions, WAL bytes (and the full-page images
among them), rows written and row versions made dead, per message; then the
statements by concern, each table's rows and indexes, and the WAL by
relation and by record type. Nothing here is timed: on a busy machine the
counts stay what they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from eop import errors
from eop.tools.bench import harness, measurement, pgcount, report, runs

DEFAULT_RUNS = ("h", "hn", "c1", "c")
"""What ``--pg-profile`` profiles unless ``--runs`` chooses: the hand-written consumer and
eop's default ``eop.Writes`` worker, each in one process and in eop's default count."""


@dataclasses.dataclass
class Profile:
    """One consumer's PostgreSQL work over a drained backlog."""

    key: str
    label: str
    command: str
    processes: int
    messages: int
    statements: dict[str, int]
    """Calls by concern (:func:`eop.tools.bench.pgcount.label`)."""
    transactions: int
    wal_bytes: int
    wal_records: int
    fpi_bytes: int
    fpis: int
    commits: int
    """COMMIT records: transactions that wrote WAL (each a flush)."""
    index_entries: int
    """B-tree entries added (:attr:`eop.tools.bench.pgcount.Wal.index_entries`)."""
    wal_by_relation: dict[str, list[int]]
    wal_by_type: dict[str, list[int]]
    tables: dict[str, dict[str, int]]
    """Per table: inserted, updated, hot_updated, deleted, dead_left, autovacuums, indexes."""
    vacuum_wal_bytes: int
    """WAL of the VACUUM after the run, of the row versions it left dead."""
    inbox_left: int | None
    """An eop run's inbox rows when it stopped (None for a baseline)."""

    @property
    def statements_total(self) -> int:
        """Every statement."""
        return sum(self.statements.values())

    def per_message(self, value: float) -> float:
        """``value`` per message."""
        return value / max(1, self.messages)

    def works(self) -> dict[str, pgcount.TableWork]:
        """:attr:`tables` as :class:`~eop.tools.bench.pgcount.TableWork`."""
        return {name: pgcount.TableWork(**row) for name, row in self.tables.items()}


def chosen(options: runs.Options) -> list[runs.Run]:
    """The runs ``--runs`` names (any of the timed runs but the relay's and the flood's)."""
    keys = list(DEFAULT_RUNS) if options.runs.strip() == "all" else runs.chosen(options.runs)
    by_key = {run.key: run for run in runs.RUNS}
    unknown = [key for key in keys if key not in by_key]
    if unknown or not keys:
        raise errors.ConfigurationError(
            f"--pg-profile profiles keys of {','.join(by_key)}, not {options.runs!r}"
        )
    return [by_key[key] for key in keys]


def run(options: runs.Options) -> dict[str, Any]:
    """Start the servers (PostgreSQL logging every statement), profile each chosen run,
    return the report."""
    started, machine = time.monotonic(), report.machine()
    chosen_runs = chosen(options)
    with harness.servers(
        fsync=options.fsync, prefix="eop-pgprofile-", pg_settings=pgcount.SERVER_SETTINGS
    ) as srv:
        profiles = asyncio.run(_profile_all(options, srv, chosen_runs))
    machine["load_average_end"] = round(os.getloadavg()[0], 2)
    return {
        "options": dataclasses.asdict(options),
        "machine": machine,
        "profiles": [{**dataclasses.asdict(p), **_summary(p)} for p in profiles],
        "seconds": round(time.monotonic() - started, 1),
    }


async def _profile_all(
    options: runs.Options, srv: harness.Servers, chosen_runs: list[runs.Run]
) -> list[Profile]:
    import nats

    from eop.tools import embedded

    if srv.pg_data is None:
        raise errors.EopError("the profile needs PostgreSQL's data directory")
    bench = harness.Bench(options, srv.nats_url, srv.pg_url, srv.tmp, srv.pids)
    own = create_async_engine(
        srv.pg_url,
        connect_args={"server_settings": {"application_name": pgcount.OWN_APPLICATION}},
        isolation_level="AUTOCOMMIT",
    )
    counter = _Counter(own, srv.pg_data, embedded.postgres_bin_dir())
    nc = await nats.connect(srv.nats_url)
    try:
        await bench.start(nc)
        return [await _profile(bench, counter, run_, options.messages) for run_ in chosen_runs]
    finally:
        await nc.close()
        await bench.engine.dispose()
        await own.dispose()


class _Counter:
    """The profile's own connection to PostgreSQL, its log and its WAL."""

    def __init__(self, engine: AsyncEngine, data_dir: Path, bin_dir: Path) -> None:
        self.engine = engine
        self.data_dir = data_dir
        self.bin_dir = bin_dir
        self.log = pgcount.StatementLog(data_dir)

    async def clean_slate(self) -> None:
        """VACUUM every table (no dead rows left from before), then CHECKPOINT."""
        async with self.engine.connect() as conn:
            await conn.execute(sa.text("VACUUM"))
            await conn.execute(sa.text("CHECKPOINT"))

    async def snapshot(self) -> pgcount.Snapshot:
        """The counters now."""
        async with self.engine.connect() as conn:
            return await pgcount.snapshot(conn)

    async def wal(self, start: str, end: str) -> pgcount.Wal:
        """The WAL from ``start`` to ``end``, its relations named."""
        wal = await asyncio.to_thread(pgcount.waldump, self.bin_dir, self.data_dir, start, end)
        async with self.engine.connect() as conn:
            wal.name_relations(await pgcount.relation_names(conn, wal))
        return wal

    async def vacuum_wal(self) -> int:
        """WAL bytes of a VACUUM of every table now."""
        async with self.engine.connect() as conn:
            lsn = sa.text("SELECT pg_current_wal_insert_lsn()::text")
            start = (await conn.execute(lsn)).scalar_one()
            await conn.execute(sa.text("VACUUM"))
            end = (await conn.execute(lsn)).scalar_one()
        dump = pgcount.waldump
        return (await asyncio.to_thread(dump, self.bin_dir, self.data_dir, start, end)).bytes

    async def inbox_rows(self, handler: str) -> int:
        """An eop run's inbox rows now."""
        schema = runs.app.settings.schema
        query = sa.text(f'SELECT count(*) FROM "{schema}".inbox WHERE subscription = :s')
        async with self.engine.connect() as conn:
            return int((await conn.execute(query, {"s": handler})).scalar_one())


async def _profile(
    bench: harness.Bench, counter: _Counter, run_: runs.Run, messages: int
) -> Profile:
    """One consumer's counts over a backlog of ``messages`` (see the module's docstring)."""
    argv = bench.command(run_)
    processes = measurement.run_processes(run_)
    child = harness.Child(argv, bench.tmp / f"{run_.key}.pgprofile.log")
    inbox_left: int | None = None
    try:
        await bench.warm(run_, child, processes * run_.pulls_waiting)
        await bench.pause(run_, True)
        await bench.publish(run_, messages)
        await counter.clean_slate()
        before = await counter.snapshot()
        offset = counter.log.offset()
        await bench.pause(run_, False)
        await bench.drain(run_, child, messages, f"({run_.key}) {run_.label}")
        # eop's compaction rounds of these messages: an interval's round empties the inbox.
        await asyncio.sleep(runs.app.settings.compaction_interval_s + 1.0)
        if run_.handler:
            inbox_left = await counter.inbox_rows(run_.handler)
    finally:
        await child.stop()
    await asyncio.sleep(1.0)  # the exited backends' statistics reach the views
    after = await counter.snapshot()
    statements = counter.log.since(offset)
    wal = await counter.wal(before.lsn, after.lsn)
    work = pgcount.table_work(before, after)
    return Profile(
        key=run_.key,
        label=run_.label,
        command=bench.shown(argv),
        processes=processes,
        messages=messages,
        statements=statements.calls,
        transactions=statements.transactions,
        wal_bytes=wal.bytes,
        wal_records=wal.records,
        fpi_bytes=wal.fpi_bytes,
        fpis=wal.fpis,
        commits=wal.commits,
        index_entries=wal.index_entries,
        wal_by_relation=wal.by_relation,
        wal_by_type=wal.by_type,
        tables={name: dataclasses.asdict(w) for name, w in work.items()},
        vacuum_wal_bytes=await counter.vacuum_wal(),
        inbox_left=inbox_left,
    )


def _summary(p: Profile) -> dict[str, float]:
    """The per-message figures of one profile (the JSON report's and the table's)."""
    works = p.works().values()
    return {
        "statements_per_message": p.per_message(p.statements_total),
        "per_message_statements_per_message": p.per_message(
            sum(n for name, n in p.statements.items() if name in pgcount.PER_MESSAGE)
        ),
        "transactions_per_message": p.per_message(p.transactions),
        "commits_per_message": p.per_message(p.commits),
        "wal_bytes_per_message": p.per_message(p.wal_bytes),
        "wal_bytes_without_fpi_per_message": p.per_message(p.wal_bytes - p.fpi_bytes),
        "rows_written_per_message": p.per_message(sum(w.written for w in works)),
        "index_entries_per_message": p.per_message(p.index_entries),
        "dead_rows_per_message": p.per_message(sum(w.dead_made for w in works)),
        "buffer_accesses_per_message": p.per_message(
            sum(w.heap_blocks + w.index_blocks for w in works)
        ),
        "vacuum_wal_bytes_per_message": p.per_message(p.vacuum_wal_bytes),
    }


def format_profile(result: dict[str, Any]) -> str:
    """The profile as tables for people."""
    o, m = result["options"], result["machine"]
    lines = [
        f"eop bench --pg-profile: {o['messages']:,} messages of {o['payload_bytes']} bytes per "
        f"consumer; PostgreSQL logging every statement; fsync {'on' if o['fsync'] else 'off'}",
        f"machine: {m['cores']} cores; {'; '.join(m['servers'])}; load average "
        f"{m['load_average_start']} -> {m['load_average_end']} (counts, not times: the load "
        "does not move them)",
        "",
        f"{'per message':<34}{'procs':>6}{'stmts':>7}{'(msg)':>7}{'xacts':>7}{'commits':>8}"
        f"{'WAL B':>7}{'no FPI':>7}{'rows':>6}{'index':>7}{'dead':>6}{'bufs':>6}{'vac B':>7}",
    ]
    for p in result["profiles"]:
        key = p["key"]
        lines.append(
            f"({key}) {p['label']:<{31 - len(key)}}{p['processes']:>6}"
            f"{p['statements_per_message']:>7.3f}{p['per_message_statements_per_message']:>7.3f}"
            f"{p['transactions_per_message']:>7.3f}{p['commits_per_message']:>8.3f}"
            f"{p['wal_bytes_per_message']:>7.0f}{p['wal_bytes_without_fpi_per_message']:>7.0f}"
            f"{p['rows_written_per_message']:>6.2f}{p['index_entries_per_message']:>7.2f}"
            f"{p['dead_rows_per_message']:>6.2f}{p['buffer_accesses_per_message']:>6.1f}"
            f"{p['vacuum_wal_bytes_per_message']:>7.0f}"
        )
    lines += [
        "",
        "stmts: every statement the consumer sent (an executemany's rows one each); (msg): "
        "those whose number follows the messages, not the clock; xacts: transactions; "
        "commits: those that wrote WAL; WAL B: WAL bytes, no FPI: without full-page images; "
        "rows: rows inserted, updated and deleted; index: index entries added; dead: row "
        "versions made dead; bufs: buffer accesses of the tables and their indexes (found "
        "in memory or read: the work of finding rows); vac B: WAL bytes of the VACUUM after "
        "the run",
    ]
    for p in result["profiles"]:
        lines += ["", *_details(p)]
    lines += ["", "commands:", *(f"  ({p['key']}) {p['command']}" for p in result["profiles"])]
    return "\n".join([*lines, f"took {result['seconds']:.0f} s"])


def _details(p: dict[str, Any]) -> list[str]:
    n = max(1, p["messages"])
    left = "" if p["inbox_left"] is None else f"; inbox rows left: {p['inbox_left']:,}"
    lines = [f"({p['key']}) {p['label']}: {p['messages']:,} messages{left}", "  statements:"]
    for name, calls in sorted(p["statements"].items(), key=lambda item: -item[1]):
        kind = "" if name in pgcount.PER_MESSAGE else "  (clock)"
        lines.append(f"    {calls / n:>9.4f}/msg {calls:>8,}  {name}{kind}")
    lines.append(
        "  tables (per message: rows inserted, updated, HOT-updated, deleted; buffer accesses "
        "of the heap and of the indexes; then its indexes, dead rows left, autovacuums):"
    )
    for name, t in sorted(p["tables"].items()):
        touched = t["inserted"] + t["updated"] + t["deleted"] + t["autovacuums"]
        if not touched and (t["heap_blocks"] + t["index_blocks"]) / n < 0.005:
            continue  # read a few times by the clock's polls: nothing per message
        lines.append(
            f"    {name:<24} ins {t['inserted'] / n:.3f} upd {t['updated'] / n:.3f} "
            f"hot {t['hot_updated'] / n:.3f} del {t['deleted'] / n:.3f} "
            f"buf {t['heap_blocks'] / n:.2f}+{t['index_blocks'] / n:.2f}; "
            f"{t['indexes']} idx, {t['dead_left']:,} dead, {t['autovacuums']} av"
        )
    lines.append(
        f"  WAL: {p['wal_records'] / n:.2f} records/msg, {p['wal_bytes'] / n:.0f} B/msg, of "
        f"which full-page images {p['fpi_bytes'] / n:.0f} ({p['fpis']:,} of them); by relation:"
    )
    for name, (records, size) in _top(p["wal_by_relation"], 10):
        lines.append(f"    {records / n:>7.3f} rec {size / n:>7.1f} B/msg  {name}")
    lines.append("  by record type:")
    for name, (records, size) in _top(p["wal_by_type"], 12):
        lines.append(f"    {records / n:>7.3f} rec {size / n:>7.1f} B/msg  {name}")
    return lines


def _top(counts: dict[str, list[int]], limit: int) -> list[tuple[str, list[int]]]:
    return sorted(counts.items(), key=lambda item: -item[1][1])[:limit]
