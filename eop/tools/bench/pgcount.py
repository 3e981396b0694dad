"""PostgreSQL's work counted, not timed: statements, transactions, WAL and rows.

What :mod:`eop.tools.bench.pgprofile` (``eop bench --pg-profile``) and the
regression guard of the tests count, on a PostgreSQL of their own started
with :data:`SERVER_SETTINGS`:

- **Statements and transactions** from the server's log: with
  ``log_statement = all`` every statement a client sends is one line
  (``statement: ...`` for a simple query, ``execute <name>: ...`` for each
  Execute of the extended protocol, so each row of a pipelined
  ``executemany`` is one), in JSON (``jsonlog``) with its backend's pid and
  application name. The bundled PostgreSQL has no ``pg_stat_statements``;
  the log says the same (calls per statement), and a connection named
  :data:`OWN_APPLICATION` (the counter's own) is left out. A transaction is
  a ``BEGIN`` or a statement outside one (an implicit transaction).
- **WAL** from ``pg_waldump`` between two LSNs: records, bytes, full-page
  images, by record type and by relation (a table, an index), so that a
  byte is traced to the statement that wrote it; ``COMMIT`` records are the
  transactions that wrote something (each one a WAL flush).
- **Rows** from ``pg_stat_user_tables``: inserted, updated (HOT or not),
  deleted, dead, autovacuums; and the indexes of each table.

None of these depends on the machine's speed. What can move them is how
the consumer's work falls into transactions: the messages a fetch returns
(a backlog gives full batches), and the rounds driven by the clock (the
retry poll, the ack floors' record, compaction's interval), which the
statement labels tell apart from the work done per message.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa

OWN_APPLICATION = "eop-pgcount"
"""The application name of the counter's own connection, whose statements are not counted."""

LOG_FILE = "pgcount.json"
"""The log file, under the data directory's ``log`` folder (jsonlog names it ``.json``)."""

SERVER_SETTINGS: Mapping[str, str] = {
    "logging_collector": "on",
    "log_destination": "jsonlog",
    "log_directory": "log",
    "log_filename": "pgcount.log",
    "log_rotation_size": "0",
    "log_rotation_age": "0",
    "log_statement": "all",
    "log_parameter_max_length": "0",
}
"""PostgreSQL settings that make the log a statement count (one file, never rotated, no
bound values)."""

_LABELS: tuple[tuple[str, str], ...] = (
    (r"^(BEGIN|START TRANSACTION)\b", "BEGIN"),
    (r"^(COMMIT|END)\b", "COMMIT"),
    (r"^(ROLLBACK|ABORT)\b(?! TO)", "ROLLBACK"),
    (r"^(SAVEPOINT|RELEASE|ROLLBACK TO)\b", "savepoint"),
    # The claim may carry the timeouts (pg/sql/base.timeouts_first): it is still the claim.
    (r"^INSERT INTO \w+\.inbox .*unnest", "claim (eop inbox)"),
    (r"set_config\('lock_timeout'", "SET LOCAL timeouts"),
    (r"^INSERT INTO bench_hand_inbox", "claim (hand inbox)"),
    (r"^DELETE FROM bench_hand_inbox", "bound (hand inbox)"),
    (r"^INSERT INTO bench_effects", "handler INSERT"),
    (r"^UPDATE \w+\.watermarks", "compaction: raise watermark"),
    (r"^DELETE FROM \w+\.inbox WHERE .*\bleast\(", "compaction: delete"),
    (r"^SELECT \w+\.inbox\.stream_seq FROM .* LIMIT", "compaction: first row"),
    (r"^INSERT INTO \w+\.watermarks", "compaction: create watermark"),
    (r"\w+\.retries\b", "retries"),
    (r"\w+\.ack_floors\b", "ack floors record"),
    (r"\w+\.(outbox|relay_leases)\b|^LISTEN\b|^UNLISTEN\b", "outbox relay"),
    (r"\w+\.(partitions|members|handovers)\b", "ordered ownership"),
    (r"^SELECT pg_advisory_unlock_all\(\); CLOSE ALL", "asyncpg pool reset"),
    (r"^SELECT pg_backend_pid\(\)|^SELECT 1\b", "connection checks"),
    (
        r"'jit'|^WITH RECURSIVE typeinfo_tree|^select current_schema|^show |pg_catalog\.pg_class"
        r"|eop_alembic_version|^select pg_catalog\.version",
        "connection set-up",
    ),
)
_COMPILED = tuple((re.compile(pattern, re.IGNORECASE), label) for pattern, label in _LABELS)
_PREFIX = re.compile(r"^(statement|execute [^:]+): ", re.DOTALL)
_SPACE = re.compile(r"\s+")

PER_MESSAGE = frozenset(
    {
        "BEGIN",
        "COMMIT",
        "ROLLBACK",
        "savepoint",
        "SET LOCAL timeouts",
        "claim (eop inbox)",
        "claim (hand inbox)",
        "bound (hand inbox)",
        "handler INSERT",
        "compaction: raise watermark",
        "compaction: delete",
        "compaction: first row",
        "asyncpg pool reset",
    }
)
"""Statement labels whose count follows the messages (a batch's transaction, compaction's
rounds after so many messages); the others follow the clock (polls, records, checks)."""


def label(sql: str) -> str:
    """The concern a statement serves (a label of :data:`_LABELS`, else its first words)."""
    text = _SPACE.sub(" ", sql.replace('"', "")).strip()
    for pattern, name in _COMPILED:
        if pattern.search(text):
            return name
    return text[:60]


@dataclasses.dataclass
class Statements:
    """The statements of a stretch of the log: calls per label, and transactions."""

    calls: dict[str, int]
    transactions: int

    @property
    def total(self) -> int:
        """Every statement."""
        return sum(self.calls.values())


class StatementLog:
    """The server's JSON log, read from a remembered offset."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "log" / LOG_FILE

    def offset(self) -> int:
        """Where the log ends now (the collector writes whole lines)."""
        return self.path.stat().st_size if self.path.exists() else 0

    def since(self, offset: int, application: str | None = None) -> Statements:
        """The statements logged after ``offset`` by every client backend but the counter's
        own (only ``application``'s, when given)."""
        calls: collections.Counter[str] = collections.Counter()
        in_transaction: dict[int, bool] = {}
        transactions = 0
        with self.path.open("rb") as file:
            file.seek(offset)
            for raw in file:
                entry = _entry(raw)
                if entry is None:
                    continue
                app = entry.get("application_name", "")
                if app == OWN_APPLICATION or (application is not None and app != application):
                    continue
                match = _PREFIX.match(entry.get("message", ""))
                if match is None:
                    continue
                name = label(entry["message"][match.end() :])
                calls[name] += 1
                pid = int(entry.get("pid", 0))
                if name == "BEGIN":
                    transactions += 1
                    in_transaction[pid] = True
                elif name in ("COMMIT", "ROLLBACK"):
                    in_transaction[pid] = False
                elif not in_transaction.get(pid, False):
                    transactions += 1  # an implicit transaction of its own
        return Statements(dict(calls), transactions)


def _entry(raw: bytes) -> dict[str, Any] | None:
    """One log line, if it is a client backend's LOG line."""
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    if entry.get("backend_type") != "client backend" or entry.get("error_severity") != "LOG":
        return None
    return entry if isinstance(entry, dict) else None


_RECORD = re.compile(
    r"^rmgr: (\w+)\s+len \(rec/tot\):\s*(\d+)/\s*(\d+), tx:\s*\d+, lsn: \S+, prev \S+, "
    r"desc: (\S+)(.*)$"
)
_BLOCK = re.compile(r"blkref #\d+: rel (\d+)/(\d+)/(\d+)(?: forknum (\d+)| fork (\w+))?")


@dataclasses.dataclass
class Wal:
    """The WAL between two LSNs: records and bytes, by record type and by relation."""

    records: int = 0
    bytes: int = 0
    fpi_bytes: int = 0
    """Bytes of full-page images (the first change of a page after a checkpoint)."""
    fpis: int = 0
    commits: int = 0
    """COMMIT records: transactions that wrote something, each a WAL flush."""
    by_type: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """``rmgr TYPE`` -> [records, bytes]."""
    by_relation: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Relation file node (``db/node`` or ``db/node fork``) -> [records, bytes]; named by
    :meth:`name_relations`."""

    @property
    def index_entries(self) -> int:
        """B-tree leaf entries added: each insert's record, or the split that took it in."""
        kinds = ("INSERT_LEAF", "INSERT_POST", "SPLIT_L", "SPLIT_R")
        return sum(self.by_type.get(f"Btree {kind}", [0])[0] for kind in kinds)

    def add(self, rmgr: str, kind: str, rec: int, tot: int, relation: str, fpis: int) -> None:
        """Count one record."""
        self.records += 1
        self.bytes += tot
        self.fpi_bytes += tot - rec
        self.fpis += fpis
        if rmgr == "Transaction" and kind.startswith("COMMIT"):
            self.commits += 1
        for table, key in ((self.by_type, f"{rmgr} {kind}"), (self.by_relation, relation)):
            counts = table.setdefault(key, [0, 0])
            counts[0] += 1
            counts[1] += tot

    def name_relations(self, names: Mapping[str, str]) -> None:
        """Rename :attr:`by_relation`'s file nodes to the relations' names."""
        named: dict[str, list[int]] = {}
        for node, counts in self.by_relation.items():
            base, _, fork = node.partition(" ")
            name = names.get(base, node if base else "(no relation)")
            key = f"{name} ({fork})" if fork else name
            total = named.setdefault(key, [0, 0])
            total[0] += counts[0]
            total[1] += counts[1]
        self.by_relation = named


def waldump(bin_dir: Path, data_dir: Path, start: str, end: str) -> Wal:
    """``pg_waldump`` of the records from LSN ``start`` to ``end``, counted."""
    if start == end:
        return Wal()
    argv = [str(bin_dir / "pg_waldump"), "-p", str(data_dir / "pg_wal"), "-s", start, "-e", end]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0 and not proc.stdout:
        raise RuntimeError(f"pg_waldump failed: {proc.stderr.strip()}")
    return parse_waldump(proc.stdout.splitlines())


def parse_waldump(lines: Iterable[str]) -> Wal:
    """Count ``pg_waldump``'s record lines."""
    wal = Wal()
    for line in lines:
        match = _RECORD.match(line)
        if match is None:
            continue
        rmgr, rec, tot, kind, rest = match.groups()
        block = _BLOCK.search(rest)
        relation = ""
        if block is not None:
            db, node, forknum, fork = block.group(2), block.group(3), block.group(4), block.group(5)
            relation = f"{db}/{node}"
            fork = fork or {"1": "fsm", "2": "vm", "3": "init"}.get(forknum or "", "")
            if fork and fork != "main":
                relation += f" {fork}"
        fpis = rest.count("FPW")
        wal.add(rmgr, kind.split("+")[0], int(rec), int(tot), relation, fpis)
    return wal


async def relation_names(conn: Any, wal: Wal) -> dict[str, str]:
    """The names of :attr:`Wal.by_relation`'s file nodes in ``conn``'s database (``conn``: a
    SQLAlchemy async connection)."""
    query = sa.text("SELECT oid FROM pg_database WHERE datname = current_database()")
    database = (await conn.execute(query)).scalar_one()
    names: dict[str, str] = {}
    for node in wal.by_relation:
        base = node.partition(" ")[0]
        db, _, filenode = base.partition("/")
        if not filenode or base in names:
            continue
        found = None
        if db in (str(database), "0"):
            query = sa.text("SELECT pg_filenode_relation(0, :n)::text")
            found = (await conn.execute(query, {"n": int(filenode)})).scalar_one()
        names[base] = found or f"(db {db} file {filenode})"
    return names


_TABLES = sa.text(
    "SELECT s.schemaname || '.' || s.relname, s.n_tup_ins, s.n_tup_upd, s.n_tup_hot_upd,"
    " s.n_tup_del, s.n_dead_tup, s.autovacuum_count,"
    " (SELECT count(*) FROM pg_index AS i WHERE i.indrelid = s.relid),"
    " io.heap_blks_hit + io.heap_blks_read, io.idx_blks_hit + io.idx_blks_read"
    " FROM pg_stat_user_tables AS s JOIN pg_statio_user_tables AS io USING (relid)"
)


@dataclasses.dataclass(frozen=True)
class TableRow:
    """One table's counters (``pg_stat_user_tables``) and its number of indexes."""

    inserted: int
    updated: int
    hot_updated: int
    deleted: int
    dead: int
    autovacuums: int
    indexes: int
    heap_blocks: int
    """Buffer accesses (hits and reads) of the table's heap."""
    index_blocks: int
    """Buffer accesses of its indexes."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The server's counters at one moment."""

    lsn: str
    tables: dict[str, TableRow]


async def snapshot(conn: Any) -> Snapshot:
    """The counters now (``conn``: a SQLAlchemy async connection of the counter's own,
    outside a transaction's cached statistics)."""
    await conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
    rows = (await conn.execute(_TABLES)).all()
    lsn = (await conn.execute(sa.text("SELECT pg_current_wal_insert_lsn()::text"))).scalar_one()
    tables = {str(r[0]): TableRow(*(int(v or 0) for v in r[1:])) for r in rows}
    return Snapshot(str(lsn), tables)


@dataclasses.dataclass(frozen=True)
class TableWork:
    """What a stretch of work did to one table."""

    inserted: int
    updated: int
    hot_updated: int
    deleted: int
    dead_left: int
    """Dead row versions waiting for a VACUUM at the end (pruning removes some on the way)."""
    autovacuums: int
    indexes: int
    heap_blocks: int = 0
    """Buffer accesses of the table's heap (hits and reads: the work of finding rows)."""
    index_blocks: int = 0
    """Buffer accesses of its indexes."""

    @property
    def written(self) -> int:
        """Rows inserted, updated and deleted."""
        return self.inserted + self.updated + self.deleted

    @property
    def dead_made(self) -> int:
        """Row versions made dead: one per update and per delete."""
        return self.updated + self.deleted


def table_work(before: Snapshot, after: Snapshot) -> dict[str, TableWork]:
    """Each table's work between two snapshots (tables without any left out)."""
    zero = TableRow(0, 0, 0, 0, 0, 0, 0, 0, 0)
    work: dict[str, TableWork] = {}
    for name, end in after.tables.items():
        start = before.tables.get(name, zero)
        change = TableWork(
            inserted=end.inserted - start.inserted,
            updated=end.updated - start.updated,
            hot_updated=end.hot_updated - start.hot_updated,
            deleted=end.deleted - start.deleted,
            dead_left=end.dead,
            autovacuums=end.autovacuums - start.autovacuums,
            indexes=end.indexes,
            heap_blocks=end.heap_blocks - start.heap_blocks,
            index_blocks=end.index_blocks - start.index_blocks,
        )
        if change.written or change.autovacuums or change.heap_blocks or change.index_blocks:
            work[name] = change
    return work
