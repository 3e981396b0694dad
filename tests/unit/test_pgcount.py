"""The counting of PostgreSQL's work (`eop bench --pg-profile`, the regression guard): the
statement labels, the log's statements and transactions, pg_waldump's records, the tables'
counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy.dialects import postgresql

from eop import errors
from eop.pg import models
from eop.pg.sql import base
from eop.pg.sql import claim as claim_sql
from eop.pg.sql import inbox as inbox_sql
from eop.tools.bench import pgcount, pgprofile, runs

T, EPOCH = models.tables("eop"), ("s", "S", "e")


def _sent(bound: base.Bound) -> str:
    """A statement's text as asyncpg sends it (and the server's log shows it)."""
    return str(bound[0].compile(dialect=postgresql.asyncpg.dialect()))  # type: ignore[no-untyped-call]


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("BEGIN;", "BEGIN"),
        ("COMMIT;", "COMMIT"),
        ("ROLLBACK", "ROLLBACK"),
        ("ROLLBACK TO SAVEPOINT sa_1", "savepoint"),
        ("SELECT set_config('lock_timeout', '5000ms', true)", "SET LOCAL timeouts"),
        (claim_sql.claim_driver_text("eop"), "claim (eop inbox)"),
        (claim_sql.claim_driver_text("eop", timeouts=True), "claim (eop inbox)"),
        (
            "INSERT INTO bench_effects (variant, seq, stored_at) VALUES ($1, $2, $3)",
            "handler INSERT",
        ),
        (_sent(inbox_sql.delete_below_watermark(T, *EPOCH, 9, 10, 1.0, 2)), "compaction: delete"),
        (_sent(inbox_sql.first_to_delete(T, *EPOCH, 9, 1.0, 2)), "compaction: first row"),
        (
            "UPDATE eop.watermarks SET watermark=greatest(eop.watermarks.watermark, $1)",
            "compaction: raise watermark",
        ),
        (
            "SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL;",
            "asyncpg pool reset",
        ),
        ("SELECT   something\n  else entirely", "SELECT something else entirely"),
    ],
)
def test_each_statement_is_labelled_by_the_concern_it_serves(sql: str, expected: str) -> None:
    """eop's statements and the hand-written consumer's get the label of their concern,
    quotes and line breaks aside; an unknown one its first words."""
    assert pgcount.label(sql) == expected


def test_an_unclaim_is_not_counted_as_compaction() -> None:
    """A batch's unclaim deletes from the inbox too, by its whole key: it is not labelled
    as compaction's delete (whose count follows the rounds, not the failures)."""
    assert not pgcount.label(_sent(inbox_sql.unclaim(T, *EPOCH, 2))).startswith("compaction")


def _line(pid: int, message: str, app: str = "eop", backend: str = "client backend") -> str:
    entry = {
        "pid": pid,
        "application_name": app,
        "backend_type": backend,
        "error_severity": "LOG",
        "message": message,
    }
    return json.dumps(entry) + "\n"


def test_the_log_counts_statements_and_transactions_of_other_clients_after_an_offset(
    tmp_path: Path,
) -> None:
    """Statements logged after the offset count, by label; the counter's own connection and
    non-client processes do not. A BEGIN opens a transaction, a statement outside one is an
    implicit transaction of its own, per backend."""
    log = pgcount.StatementLog(tmp_path)
    log.path.parent.mkdir()
    log.path.write_text(_line(1, "statement: BEGIN;"))
    offset = log.offset()
    with log.path.open("a") as file:
        file.write(_line(1, "statement: COMMIT;"))  # the end of a transaction begun before
        file.write(_line(2, "statement: BEGIN;"))
        file.write(_line(3, "statement: SELECT 1"))  # implicit, while 2 is in a transaction
        file.write(_line(2, "execute __asyncpg_stmt_1__: INSERT INTO bench_effects VALUES (1)"))
        file.write(_line(2, "execute __asyncpg_stmt_1__: INSERT INTO bench_effects VALUES (1)"))
        file.write(_line(2, "statement: COMMIT;"))
        file.write(_line(4, "statement: SELECT 1", app=pgcount.OWN_APPLICATION))
        file.write(_line(5, "statement: VACUUM", backend="autovacuum worker"))
        file.write(_line(2, "duration: 1 ms"))
        file.write("not json\n")
    counted = log.since(offset)
    assert counted.calls == {
        "COMMIT": 2,
        "BEGIN": 1,
        "connection checks": 1,
        "handler INSERT": 2,
    }
    assert counted.transactions == 2
    assert counted.total == 6
    assert log.since(offset, application="nobody").total == 0


def _record(rmgr: str, rec: int, tot: int, desc: str) -> str:
    """One record line as pg_waldump prints it."""
    return (
        f"rmgr: {rmgr:<11} len (rec/tot): {rec:>6}/{tot:>6}, tx:        732, "
        f"lsn: 0/014F5E38, prev 0/014F5DF0, desc: {desc}"
    )


_WALDUMP = [
    _record(
        "Heap",
        54,
        54,
        "LOCK xmax: 732, off: 1, infobits: [LOCK_ONLY, SHR_LOCK], flags: 0x00, "
        "blkref #0: rel 1663/5/16412 blk 0",
    ),
    _record("Heap", 143, 143, "INSERT+INIT off: 1, flags: 0x04, blkref #0: rel 1663/5/16390 blk 0"),
    _record("Btree", 72, 8264, "INSERT_LEAF off: 59, blkref #0: rel 1663/5/16397 blk 1 FPW"),
    _record(
        "Heap2",
        59,
        59,
        "VISIBLE snapshotConflictHorizon: 0, flags: 0x01, "
        "blkref #0: rel 1663/5/16390 fork vm blk 0, blkref #1: rel 1663/5/16390 blk 0",
    ),
    _record("Transaction", 34, 34, "COMMIT 2026-11-29 00:39:09.191723 UTC"),
    "pg_waldump: error: error in WAL record at 0/14FA140: invalid record length",
]


def test_waldump_records_are_counted_by_type_and_relation_with_their_full_page_images() -> None:
    """Each record line counts its total length under its record type (an INIT flag aside)
    and the relation of its first block (a fork other than main named); the full-page
    image's bytes and count, the COMMIT records and the B-tree entries are kept apart;
    relations get their names."""
    wal = pgcount.parse_waldump(_WALDUMP)
    assert (wal.records, wal.bytes) == (5, 54 + 143 + 8264 + 59 + 34)
    assert (wal.fpi_bytes, wal.fpis) == (8264 - 72, 1)
    assert wal.commits == 1
    assert wal.index_entries == 1
    assert wal.by_type["Heap INSERT"] == [1, 143]
    assert wal.by_type["Heap LOCK"] == [1, 54]
    wal.name_relations({"5/16390": "eop.inbox", "5/16397": "eop.inbox_pkey"})
    assert wal.by_relation == {
        "5/16412": [1, 54],  # a node without a name keeps its number
        "eop.inbox": [1, 143],
        "eop.inbox_pkey": [1, 8264],
        "eop.inbox (vm)": [1, 59],
        "(no relation)": [1, 34],
    }


def test_table_work_is_the_difference_of_two_snapshots_and_skips_idle_tables() -> None:
    """Rows inserted, updated and deleted between the snapshots, the dead rows left at the
    end, the buffer accesses; a table nothing touched is left out."""
    row = pgcount.TableRow
    before = pgcount.Snapshot(
        "0/1",
        {"eop.inbox": row(10, 0, 0, 5, 5, 1, 2, 100, 200), "idle": row(1, 0, 0, 0, 0, 0, 1, 0, 0)},
    )
    after = pgcount.Snapshot(
        "0/2",
        {
            "eop.inbox": row(30, 4, 3, 25, 7, 2, 2, 190, 380),
            "idle": row(1, 0, 0, 0, 0, 0, 1, 0, 0),
            "new": row(2, 0, 0, 0, 0, 0, 0, 2, 0),
        },
    )
    work = pgcount.table_work(before, after)
    assert set(work) == {"eop.inbox", "new"}
    inbox = work["eop.inbox"]
    assert (inbox.inserted, inbox.updated, inbox.hot_updated, inbox.deleted) == (20, 4, 3, 20)
    assert (inbox.written, inbox.dead_made, inbox.dead_left) == (44, 24, 7)
    assert (inbox.heap_blocks, inbox.index_blocks, inbox.autovacuums) == (90, 180, 1)


def test_the_profile_takes_the_timed_runs_keys_and_defaults_to_the_comparison() -> None:
    """--runs all profiles the hand-written consumer and eop.Writes in one process and in
    eop's default count; any other timed run may be named; the relay's and the flood's
    rows may not."""
    assert [r.key for r in pgprofile.chosen(runs.Options())] == ["h", "hn", "c1", "c"]
    assert [r.key for r in pgprofile.chosen(runs.Options(runs="k,b"))] == ["k", "b"]
    with pytest.raises(errors.ConfigurationError, match="--pg-profile"):
        pgprofile.chosen(runs.Options(runs="r"))
