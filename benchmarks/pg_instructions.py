"""PostgreSQL's instructions per message for the shapes of a claim, counted by callgrind.

    python benchmarks/pg_instructions.py [--short 20] [--long 60] [--shapes hand,eop,...]

Where ``eop bench --pg-profile`` counts statements, WAL and buffer accesses,
this counts the CPU work they cost PostgreSQL, without a clock: a
single-user backend (``postgres --single``) runs a script of batch
transactions under ``valgrind --tool=callgrind``, once with ``--short`` and
once with ``--long`` transactions of 64 messages each; the difference of the
two totals over ``(long - short) * 64`` is one more message's instructions,
start-up and set-up left out. Each run starts from a copy of one migrated
data directory (fsync off). The statements are prepared (``PREPARE``, then
``EXECUTE`` with literal values, as a driver's named statements are), so the
plan is cached as asyncpg's is; the values arrive as text, not in binary as
asyncpg sends them, which costs every shape a little parsing (the 64
fingerprints of eop's claim most).

The shapes, each a transaction per batch (BEGIN, the claim, COMMIT):

- ``hand``: the hand-written consumer's claim (``eop bench``'s (h)), a table of
  (stream, seq);
- ``eop``: eop's claim as it sends it (:func:`eop.pg.sql.claim.claim_driver_text`):
  since ``eop_0011`` into the inbox keyed by (lane, stream_seq), the lane and
  the watermark read from the watermark row once;
- ``eop-nowm``: the same without the watermark condition (what comparing with
  the watermark costs; the row is still read, for the lane);
- ``lanes``: the proposal the narrow key was measured by before it was built
  (BENCHMARKS.md, "Where PostgreSQL's time goes"): the lane passed as a value,
  not read from the watermark row, the outcome as one byte, the subscription
  as an integer;
- ``eop+compaction``: ``eop``, plus compaction's round after every 16 batches
  (1,024 messages, about one round's count), as
  :class:`eop.protocol.compaction.Compactor` sends a round counted by
  messages: the raise in a transaction of its own, then the delete of the
  sequences above the previous round's watermark (one chunk) in another;
- ``eop+compaction-lookup``: the same with the look-up of the first row that
  may go before the delete, as the compactor sends it before every chunk but
  a counted round's first;
- ``eop+compaction-ctid``: the same with the delete compaction sent before it
  deleted by key range (``ctid = ANY(array(SELECT ctid ... LIMIT n))``, the
  rows read twice), for the comparison.

The handler's INSERT, the same for all, is left out; ``--handler-insert`` adds
it (the bench's row, an ``EXECUTE`` a message as an ``executemany`` sends it), so
that the shapes compare as whole messages do.

``--wire`` counts what the drivers send instead of a script: the server runs
as usual (a postmaster under callgrind, its backends followed) and one asyncpg
connection sends each shape over the wire as the consumers do, the values
bound in binary, the handler's INSERT an ``executemany``; only that
connection's backend is counted. A script's text costs the single-user
backend work a driver's message does not (reading it a character at a time,
then parsing the 64 fingerprints' hex), and eop's claim, with its
fingerprints, carries more of that text than the hand-written one. Its
shapes: ``hand`` (as (h) sends it: BEGIN, the claim, the INSERTs as an
``executemany``, COMMIT, and asyncpg's reset as its pool takes the connection
back), ``hand+bound`` (the same, with the cheapest bound a hand-written inbox
could have: every 16 batches a DELETE of the previous 1,024 sequences' rows
by key range, in a transaction of its own), ``hand+rows`` (``hand`` with the
batch's rows in one INSERT, as an expert might write it), ``eop`` (as eop's
``eop.Writes`` path sends it: BEGIN, the timeouts' ``set_config``, the claim,
the batch's queued INSERTs as one statement of 64 rows
(:func:`eop.pg.direct.rows_of`), COMMIT) and ``eop+compaction`` (with
compaction's round every 16 batches). The handler's INSERT is always sent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import pwd
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import asyncpg
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from eop.pg import direct, migrate, models
from eop.pg.sql import base as base_sql
from eop.pg.sql import claim as claim_sql
from eop.pg.sql import inbox as inbox_sql
from eop.tools import embedded

BATCH = 64
SUBSCRIPTION, STREAM, EPOCH = "bench-one", "BENCH_C1", "e" * 32
SETUP = (
    "CREATE TABLE hand_inbox (stream text, seq bigint, PRIMARY KEY (stream, seq))",
    "CREATE TABLE bench_effects (variant text NOT NULL, seq bigint NOT NULL,"
    " stored_at timestamptz NOT NULL)",
    # The proposal's inbox: the (subscription, stream, epoch) as the integer of its
    # watermark row, the outcome as one byte, no subject.
    "CREATE TABLE eop.lanes_inbox (lane integer NOT NULL, stream_seq bigint NOT NULL,"
    ' fingerprint bytea NOT NULL, msg_id text, outcome "char" NOT NULL,'
    " delivery_count integer NOT NULL, processed_at timestamptz NOT NULL DEFAULT now(),"
    " subscription_id integer NOT NULL, msg_id_digest bytea, PRIMARY KEY (lane, stream_seq))",
    "CREATE UNIQUE INDEX lanes_inbox_msg_id_key ON eop.lanes_inbox (subscription_id,"
    " msg_id_digest) WHERE msg_id_digest IS NOT NULL",
    f"INSERT INTO eop.watermarks VALUES ('{SUBSCRIPTION}', '{STREAM}', '{EPOCH}', 0, now())",
)
_LANES = (
    "INSERT INTO eop.lanes_inbox (lane, stream_seq, fingerprint, msg_id, outcome,"
    " delivery_count, subscription_id, msg_id_digest) SELECT $1::integer, i.stream_seq,"
    " i.fingerprint, i.msg_id, 'p', COALESCE(i.delivery_count, $4::integer), $5::integer,"
    " sha256(convert_to(i.msg_id, 'UTF8')) FROM unnest($2::bigint[], $3::bytea[],"
    " $6::integer[], $7::text[]) AS i(stream_seq, fingerprint, delivery_count, msg_id)"
    " WHERE i.stream_seq > COALESCE((SELECT w.watermark FROM eop.watermarks AS w"
    " WHERE w.subscription = $8::text AND w.stream = $9::text AND w.stream_epoch = $10::text"
    " FOR SHARE), 0) ON CONFLICT DO NOTHING RETURNING stream_seq"
)
_HAND = (
    "INSERT INTO hand_inbox (stream, seq) SELECT $1, unnest($2::bigint[])"
    " ON CONFLICT DO NOTHING RETURNING seq"
)
_EFFECT = "INSERT INTO bench_effects (variant, seq, stored_at) VALUES ($1, $2, $3)"
COMPACTING = ("eop+compaction", "eop+compaction-lookup", "eop+compaction-ctid")
SHAPES = ("hand", "eop", "eop-nowm", "lanes", *COMPACTING)
WIRE_SHAPES = ("hand", "hand+bound", "hand+rows", "eop", "eop+compaction")
_EFFECT_ROWS = direct.rows_of(_EFFECT, 3)
assert _EFFECT_ROWS is not None
_HAND_BOUND = "DELETE FROM hand_inbox WHERE stream = $1 AND seq > $2 AND seq <= $3"
_TIMEOUTS = base_sql.set_local_timeouts_text(2000, 30000)
_WIRE_PORT = 5499


def _claim(shape: str) -> str:
    text = claim_sql.claim_driver_text("eop")
    if shape == "eop-nowm":
        text = text[: text.index(" WHERE i.stream_seq >")]
        text += " ON CONFLICT DO NOTHING RETURNING stream_seq"
    return text


def _array(values: list[str]) -> str:
    return "'{" + ",".join(values) + "}'"


def _claim_values(shape: str, seqs: list[int]) -> str:
    numbers = _array([str(s) for s in seqs])
    prints = _array(['"\\\\x' + random.randbytes(32).hex() + '"' for _ in seqs])
    if shape == "hand":
        return f"'{STREAM}', {numbers}"
    if shape == "lanes":
        lane = f"'{SUBSCRIPTION}', '{STREAM}', '{EPOCH}'"
        return f"1, {numbers}, {prints}, 1, 1, '{{}}', '{{}}', {lane}"
    return (
        f"'{SUBSCRIPTION}', '{STREAM}', 'processed', {numbers}, {prints}, '{EPOCH}', '{{}}',"
        " 1, '{}', NULL, '{}'"
    )


def _wire_statement(bound: tuple[sa.Executable, dict[str, object]]) -> tuple[str, list[object]]:
    """One of eop's statements as asyncpg gets it: the text and its positional values."""
    stmt, params = bound
    compiled = stmt.compile(dialect=postgresql.asyncpg.dialect())  # type: ignore[no-untyped-call]
    values = compiled.construct_params(params)
    return str(compiled), [values[key] for key in compiled.positiontup or ()]


def _prepared(bound: tuple[sa.Executable, dict[str, object]], name: str) -> tuple[str, str]:
    """``PREPARE name AS ...`` of one of eop's statements, and the ``EXECUTE`` of its values."""
    text, values = _wire_statement(bound)
    one_line = text.replace("\n", " ")  # single-user mode reads a statement a line
    literals = [_literal(value) for value in values]
    return f"PREPARE {name} AS {one_line};", f"EXECUTE {name}({', '.join(literals)});"


def _literal(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


def _compaction(top: int, shape: str) -> list[str]:
    """Compaction's round after the messages up to ``top``: the raise, then the delete of
    the rows above the previous round's watermark, each in a transaction of its own."""
    t, epoch = models.tables("eop"), (SUBSCRIPTION, STREAM, EPOCH)
    raise_ = _prepared(inbox_sql.advance_watermark(t, *epoch, top, 250), "raise")[1]
    after = top - 16 * BATCH
    if shape == "eop+compaction-ctid":
        sweep = [_prepared(_ctid_delete(t, top, after), "sweep")[1]]
    else:
        # The chunk starts where the previous round ended and, at most 5,000 sequences
        # long, ends at the watermark; a look-up finds its first row at after + 1.
        chunk = inbox_sql.delete_below_watermark(t, *epoch, top, 5000, 3600.0, after)
        sweep = [_prepared(chunk, "sweep")[1]]
        if shape == "eop+compaction-lookup":
            first = inbox_sql.first_to_delete(t, *epoch, top, 3600.0, after)
            sweep.insert(0, _prepared(first, "first")[1])
    return ["BEGIN;", raise_, "COMMIT;", "BEGIN;", *sweep, "COMMIT;"]


def _ctid_delete(t: models.Tables, top: int, after: int) -> tuple[sa.Executable, dict[str, object]]:
    """The delete compaction sent before the key range: up to 5,000 rows' ctids selected
    (``LIMIT``), then deleted by them, the same rows kept."""
    c = t.inbox.c
    retention_s = sa.bindparam("p_retention_s", type_=sa.Float)
    cutoff = sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, retention_s)
    chunk = (
        sa.select(sa.literal_column("ctid"))
        .select_from(t.inbox)
        .where(
            c.lane == base_sql.lane_of(t, SUBSCRIPTION, STREAM, EPOCH),
            c.stream_seq > sa.bindparam("p_after", type_=sa.BigInteger),
            c.stream_seq <= sa.bindparam("p_value", type_=sa.BigInteger),
            sa.or_(c.msg_id.is_(None), c.processed_at < cutoff),
            c.outcome != models.OUTCOME_RETRYING,
        )
        .limit(sa.bindparam("p_limit", type_=sa.Integer))
    )
    stmt = sa.delete(t.inbox).where(
        sa.literal_column("ctid") == sa.any_(sa.func.array(chunk.scalar_subquery()))
    )
    params = {"p_after": after, "p_value": top, "p_limit": 5000, "p_retention_s": 3600.0}
    return stmt, params


def script(shape: str, transactions: int, handler: bool = False) -> str:
    """The statements a run sends, one a line (single-user mode reads a line each); with
    ``handler``, each batch's transaction also inserts the bench's row for each message."""
    claim = {"hand": _HAND, "lanes": _LANES}.get(shape) or _claim(shape)
    lines = [f"PREPARE claim AS {claim};", f"PREPARE effect AS {_EFFECT};"]
    if shape in COMPACTING:
        t, epoch = models.tables("eop"), (SUBSCRIPTION, STREAM, EPOCH)
        lines.append(_prepared(inbox_sql.advance_watermark(t, *epoch, 0, 250), "raise")[0])
        if shape == "eop+compaction-ctid":
            lines.append(_prepared(_ctid_delete(t, 0, 0), "sweep")[0])
        else:
            sweep = inbox_sql.delete_below_watermark(t, *epoch, 0, 5000, 3600.0)
            lines.append(_prepared(sweep, "sweep")[0])
        if shape == "eop+compaction-lookup":
            first = inbox_sql.first_to_delete(t, *epoch, 0, 3600.0)
            lines.append(_prepared(first, "first")[0])
    for n in range(transactions):
        seqs = list(range(n * BATCH + 1, (n + 1) * BATCH + 1))
        lines += ["BEGIN;", f"EXECUTE claim({_claim_values(shape, seqs)});"]
        if handler:  # an executemany: an Execute a row
            lines += [f"EXECUTE effect('{SUBSCRIPTION}', {seq}, now());" for seq in seqs]
        lines.append("COMMIT;")
        if shape in COMPACTING and (n + 1) % 16 == 0:
            lines += _compaction(seqs[-1], shape)
    return "\n".join(lines) + "\n"


def _template(folder: Path) -> Path:
    """A data directory with eop's tables and the shapes' own, its server stopped."""
    data = folder / "template"
    server = embedded.PostgresServer(data_dir=data)
    server.start()
    try:
        migrate.upgrade(server.url)
        engine = sa.create_engine(server.sync_url)
        with engine.begin() as conn:
            for ddl in SETUP:
                conn.execute(sa.text(ddl))
        engine.dispose()
    finally:
        server.close()
    return data


def _count(template: Path, shape: str, transactions: int, folder: Path, handler: bool) -> int:
    """Instructions of a single-user backend running ``transactions`` of ``shape``."""
    data = folder / f"{shape}-{transactions}"
    subprocess.run(["cp", "-a", str(template), str(data)], check=True)  # owner and modes kept
    owner = pwd.getpwuid(template.stat().st_uid).pw_name
    out = folder / f"{shape}-{transactions}.callgrind"
    postgres = embedded.postgres_bin_dir() / "postgres"
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", str(postgres)]
    command += ["--single", "-D", str(data), "-c", "fsync=off", "-c", "log_min_messages=warning"]
    command.append("postgres")
    if os.geteuid() == 0 and owner != "root":  # PostgreSQL refuses to run as root
        command = ["runuser", "-u", owner, "--", *command]
    done = subprocess.run(
        command,
        input=script(shape, transactions, handler),
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None or "ERROR" in done.stdout + done.stderr:
        raise SystemExit(
            f"{shape}: the callgrind run failed:\n{(done.stdout + done.stderr)[-3000:]}"
        )
    shutil.rmtree(data)
    return int(found.group(1))


@contextlib.contextmanager
def callgrind_postmaster(
    data: Path, out: str, port: int, socket_dir: Path, settings: Mapping[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A postmaster on ``data`` under callgrind, run as the data directory's owner, every
    process it starts followed (each writes its profile to ``out``, ``%p`` its pid, as it
    exits); a fast shutdown at exit, waited for."""
    postgres = embedded.postgres_bin_dir() / "postgres"
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", str(postgres)]
    command += ["-D", str(data), "-p", str(port), "-k", str(socket_dir)]
    for name, value in settings.items():
        command += ["-c", f"{name}={value}"]
    owner = pwd.getpwuid(data.stat().st_uid).pw_name
    if os.geteuid() == 0 and owner != "root":  # PostgreSQL refuses to run as root
        command = ["runuser", "-u", owner, "--", *command]
    with log.open("w") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        yield server
    finally:
        # Sent to the postmaster itself: runuser does not pass a signal on.
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((data / "postmaster.pid").read_text().split()[0]), signal.SIGINT)
        server.wait(timeout=600)


async def connect_when_up(
    server: subprocess.Popen[bytes], host: str, port: int
) -> asyncpg.Connection:
    """A connection to ``server`` once it accepts one (a postmaster under callgrind takes
    seconds to start)."""
    deadline = time.monotonic() + 300
    while True:
        try:
            return await asyncpg.connect(host=host, port=port, user="postgres", database="postgres")
        except (OSError, asyncpg.PostgresError):
            if time.monotonic() > deadline or server.poll() is not None:
                raise
            await asyncio.sleep(0.5)


def profile_total(path: Path) -> int | None:
    """The instructions callgrind counted in the profile ``path``; None until it is whole."""
    found = re.search(r"^(?:totals|summary): (\d+)", path.read_text(), re.MULTILINE)
    return int(found.group(1)) if found else None


async def _wire_batches(conn: asyncpg.Connection, shape: str, transactions: int) -> None:
    """Send ``transactions`` batches of ``shape`` as the consumer it names sends them."""
    t, epoch = models.tables("eop"), (SUBSCRIPTION, STREAM, EPOCH)
    now = datetime.datetime.now(datetime.UTC)
    for n in range(transactions):
        seqs = list(range(n * BATCH + 1, (n + 1) * BATCH + 1))
        async with conn.transaction():
            if shape.startswith("hand"):
                claimed = await conn.fetch(_HAND, STREAM, seqs)
            else:
                await conn.execute(_TIMEOUTS)  # no arguments: a simple query, as eop sends it
                arguments = claim_sql.claim_arguments(
                    SUBSCRIPTION,
                    STREAM,
                    "processed",
                    seqs,
                    [random.randbytes(32) for _ in seqs],
                    [EPOCH] * BATCH,
                    [1] * BATCH,
                    [None] * BATCH,
                )
                claimed = await conn.fetch(claim_sql.claim_driver_text("eop"), *arguments)
            if len(claimed) != BATCH:  # a shape that claims nothing counts nothing worth having
                raise SystemExit(f"{shape}: claimed {len(claimed)} of a batch of {BATCH}")
            effects = [(SUBSCRIPTION, seq, now) for seq in seqs]
            if shape in ("hand", "hand+bound"):
                await conn.executemany(_EFFECT, effects)
            else:  # one INSERT of the batch's rows, as eop sends queued INSERTs
                await conn.execute(_EFFECT_ROWS.text(BATCH), *[v for row in effects for v in row])
        if shape.startswith("hand"):
            await conn.reset()  # asyncpg's pool resets a connection it takes back
        if (n + 1) % 16 == 0 and shape == "hand+bound":
            await conn.execute(_HAND_BOUND, STREAM, seqs[-1] - 16 * BATCH, seqs[-1])
        elif (n + 1) % 16 == 0 and shape == "eop+compaction":
            top = seqs[-1]
            raise_ = _wire_statement(inbox_sql.advance_watermark(t, *epoch, top, 250))
            sweep = inbox_sql.delete_below_watermark(t, *epoch, top, 5000, 3600.0, top - 1024)
            for text, values in (raise_, _wire_statement(sweep)):
                async with conn.transaction():
                    await conn.execute(_TIMEOUTS)
                    await conn.execute(text, *values)


def _wire_count(template: Path, shape: str, transactions: int, folder: Path) -> int:
    """Instructions of the backend that served one asyncpg connection sending
    ``transactions`` of ``shape``, its server's postmaster run under callgrind."""
    data = folder / f"wire-{shape}-{transactions}"
    subprocess.run(["cp", "-a", str(template), str(data)], check=True)
    settings = {"listen_addresses": "", "fsync": "off", "autovacuum": "off"}

    async def session(server: subprocess.Popen[bytes]) -> int:
        conn = await connect_when_up(server, str(folder), _WIRE_PORT)
        pid = int(await conn.fetchval("SELECT pg_backend_pid()"))
        await _wire_batches(conn, shape, transactions)
        await conn.close()
        return pid

    log = folder / f"wire-{shape}-{transactions}.log"
    with callgrind_postmaster(data, f"{data}.%p", _WIRE_PORT, folder, settings, log) as server:
        pid = asyncio.run(session(server))
    out = Path(f"{data}.{pid}")
    total = None
    for _ in range(100):  # the backend writes its profile as it exits
        total = profile_total(out) if out.exists() else None
        if total is not None:
            break
        time.sleep(0.1)
    if total is None:
        raise SystemExit(f"{shape}: no count in {out}")
    shutil.rmtree(data)
    return total


def main() -> None:
    """Count each shape twice under callgrind; print its instructions a message."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--short", type=int, default=20)
    parser.add_argument("--long", type=int, default=60)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument(
        "--handler-insert",
        action="store_true",
        help="each message also inserts the bench's row, as every database run's handler does",
    )
    parser.add_argument(
        "--wire",
        action="store_true",
        help="send each shape from asyncpg to a running server, as the consumers do "
        f"(shapes: {','.join(WIRE_SHAPES)})",
    )
    args = parser.parse_args()
    if args.wire and args.shapes == parser.get_default("shapes"):
        args.shapes = ",".join(WIRE_SHAPES)
    random.seed(0)
    with tempfile.TemporaryDirectory(prefix="eop-pg-instructions-") as tmp:
        folder = Path(tmp)
        os.chmod(folder, 0o777)  # the server's account writes its callgrind files there
        template = _template(folder)
        for shape in args.shapes.split(","):
            started = time.monotonic()
            if args.wire:
                short = _wire_count(template, shape, args.short, folder)
                long = _wire_count(template, shape, args.long, folder)
            else:
                short = _count(template, shape, args.short, folder, args.handler_insert)
                long = _count(template, shape, args.long, folder, args.handler_insert)
            per = (long - short) / ((args.long - args.short) * BATCH)
            took = time.monotonic() - started
            print(f"{shape:<20} {per:>9,.0f} instructions a message  ({took:.0f} s)")


if __name__ == "__main__":
    main()
