"""``eop demo``: exactly-once under duplicates and crashes, on embedded servers.

It starts a nats-server and a PostgreSQL of its own, publishes money
transfers (each several times, some again after the duplicate window, one
poison message), runs worker processes through the ``eop worker`` command and
SIGKILLs them at random on the way, then prints what every transfer did to
the ledger: exactly one effect each, and balances equal to the sum of the
distinct transfers.

The module is also the demo's eop app (``eop.tools.demo:app``), which the worker
processes import.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import nats
import nats.js.errors
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import eop
from eop import errors
from eop.pg import migrate

STREAM = "DEMO"
SUBJECT = "demo.transfers"
ACCOUNTS = ("alice", "bob", "carol", "dave")
DUPLICATE_WINDOW_S = 2.0

demo_metadata = sa.MetaData()
ledger = sa.Table(
    "demo_ledger",
    demo_metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    # Deliberately not unique: the demo counts effects, so a duplicate would show.
    sa.Column("transfer_id", sa.Text, nullable=False),
    sa.Column("account", sa.Text, nullable=False),
    sa.Column("amount", sa.BigInteger, nullable=False),
)

app = eop.App()
app.stream(STREAM, subjects=[SUBJECT], duplicate_window_s=DUPLICATE_WINDOW_S)

_WORKER = [sys.executable, "-m", "eop", "worker", "eop.tools.demo:app"]


@app.handler(stream=STREAM, subject=SUBJECT, name="demo-ledger")
async def apply_transfer(msg: eop.Message, session: AsyncSession) -> None:
    """Book one transfer; slow enough that the demo's crashes land mid-work."""
    transfer = msg.json()
    if not isinstance(transfer, dict) or "account" not in transfer:
        raise eop.Reject("a transfer needs an account")
    await asyncio.sleep(0.01)
    await session.execute(
        ledger.insert().values(
            transfer_id=transfer["id"], account=transfer["account"], amount=transfer["amount"]
        )
    )


@dataclass
class Plan:
    """What the publisher sends: transfers, how often each, and a poison message."""

    transfers: list[dict[str, object]]
    publishes: dict[str, int] = field(default_factory=dict)
    late_republishes: list[str] = field(default_factory=list)


def make_plan(messages: int, rng: random.Random) -> Plan:
    """Transfers with ids t0001..., each to be published 1-3 times."""
    transfers: list[dict[str, object]] = [
        {"id": f"t{i:04d}", "account": rng.choice(ACCOUNTS), "amount": rng.randint(1, 100)}
        for i in range(1, messages + 1)
    ]
    plan = Plan(transfers=transfers)
    for t in transfers:
        plan.publishes[str(t["id"])] = rng.choice((1, 1, 2, 3))
    plan.late_republishes = [str(t["id"]) for t in rng.sample(transfers, max(1, messages // 20))]
    return plan


def run(messages: int = 200, workers: int = 2, seed: int | None = None) -> int:
    """Run the demo end to end; returns 0 when every transfer took effect exactly once."""
    from eop.tools import embedded  # needs the `embedded` extra

    seed = seed if seed is not None else random.randrange(1_000_000)
    rng = random.Random(seed)
    print(f"eop demo: {messages} transfers, {workers} workers, seed {seed}")
    with (
        tempfile.TemporaryDirectory(prefix="eop-demo-") as tmp,
        embedded.NatsServer() as nats_server,
        embedded.PostgresServer() as pg,
    ):
        print(f"  nats-server on {nats_server.url}, PostgreSQL on port {pg.port}")
        database_url = pg.url
        migrate.upgrade(database_url)
        asyncio.run(_create_demo_tables(database_url))
        env = dict(
            os.environ,
            EOP_DATABASE_URL=database_url,
            EOP_NATS_URL=nats_server.url,
            EOP_LOG_FORMAT="json",
            EOP_ACK_WAIT_S="5",
            EOP_LEASE_MARGIN_S="1",
            EOP_MAX_ATTEMPTS="3",
            EOP_BACKOFF_BASE_S="0.2",
        )
        plan = make_plan(messages, rng)
        crashes = asyncio.run(_publish_and_crash(plan, env, workers, rng, tmp))
        skipped = _count_events(tmp, "message.duplicate")
        return asyncio.run(_report(plan, database_url, nats_server.url, crashes, skipped))


def _count_events(log_dir: str, event: str) -> int:
    """How many times the workers logged ``event`` (their logs are JSON lines)."""
    count = 0
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name), encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("{") and json.loads(line).get("event") == event:
                    count += 1
    return count


async def _create_demo_tables(database_url: str) -> None:
    engine = create_async_engine(database_url)
    async with engine.begin() as conn:
        await conn.run_sync(demo_metadata.create_all)
    await engine.dispose()


class _Workers:
    """The worker processes, started through the real ``eop worker`` command."""

    def __init__(self, env: dict[str, str], count: int, log_dir: str) -> None:
        self.env, self.log_dir = env, log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started = 0
        for _ in range(count):
            self.procs.append(self._spawn())

    def _spawn(self) -> subprocess.Popen[bytes]:
        self.started += 1
        log_path = os.path.join(self.log_dir, f"worker-{self.started}.log")
        with open(log_path, "wb") as out:
            return subprocess.Popen(
                # One process each: the demo SIGKILLs workers to show crashes.
                [*_WORKER, "--concurrency", "4", "--processes", "1"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def crash_and_restart(self, index: int) -> None:
        """SIGKILL one worker (no graceful anything) and start a fresh one in its place."""
        self.procs[index].send_signal(signal.SIGKILL)
        self.procs[index].wait()
        self.procs[index] = self._spawn()

    def stop(self) -> None:
        """SIGTERM every worker and wait for its graceful exit."""
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


async def _publish_and_crash(
    plan: Plan, env: dict[str, str], workers: int, rng: random.Random, log_dir: str
) -> int:
    nc = await nats.connect(env["EOP_NATS_URL"])
    js = nc.jetstream()
    await js.add_stream(name=STREAM, subjects=[SUBJECT], duplicate_window=DUPLICATE_WINDOW_S)
    pool = _Workers(env, workers, log_dir)
    crashes = 0
    try:
        sends = [t for t in plan.transfers for _ in range(plan.publishes[str(t["id"])])]
        rng.shuffle(sends)
        await js.publish(SUBJECT, b"\xff not json", headers={"Nats-Msg-Id": "poison"})
        for i, transfer in enumerate(sends):
            await js.publish(
                SUBJECT, json.dumps(transfer).encode(), headers={"Nats-Msg-Id": transfer["id"]}
            )
            if i % 40 == 39:
                await asyncio.sleep(0.15)
                pool.crash_and_restart(rng.randrange(workers))
                crashes += 1
        # Republish some after the server's duplicate window has forgotten them:
        # the server stores them again, eop's msg-id guard must skip them.
        await asyncio.sleep(DUPLICATE_WINDOW_S + 0.5)
        by_id = {str(t["id"]): t for t in plan.transfers}
        for transfer_id in plan.late_republishes:
            body = json.dumps(by_id[transfer_id]).encode()
            await js.publish(SUBJECT, body, headers={"Nats-Msg-Id": transfer_id})
        for _ in range(2):
            await asyncio.sleep(0.5)
            pool.crash_and_restart(rng.randrange(workers))
            crashes += 1
        await _wait_drained(js, deadline_s=90)
    finally:
        pool.stop()
        await nc.close()
    return crashes


async def _wait_drained(js: nats.js.JetStreamContext, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    created = False
    while time.monotonic() < end:
        try:
            info = await js.consumer_info(STREAM, "eop-demo-ledger")
        except nats.js.errors.NotFoundError:
            # The first worker to start creates the consumer. On a slow or busy machine
            # every worker may still be importing (or was just SIGKILLed) at this point.
            await asyncio.sleep(0.25)
            continue
        created = True
        if info.num_pending == 0 and info.num_ack_pending == 0:
            return
        await asyncio.sleep(0.25)
    if not created:
        raise errors.EopError(f"no worker created the demo's consumer within {deadline_s:.0f} s")
    raise errors.EopError(f"the demo did not drain within {deadline_s:.0f} s")


async def _report(plan: Plan, database_url: str, nats_url: str, crashes: int, skipped: int) -> int:
    engine = create_async_engine(database_url)
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.select(ledger.c.transfer_id, sa.func.count()).group_by(ledger.c.transfer_id)
            )
        ).all()
        dead = (
            await conn.execute(sa.text("SELECT reason, count(*) FROM eop.dead_letters GROUP BY 1"))
        ).all()
        balances = dict(
            (
                await conn.execute(
                    sa.select(ledger.c.account, sa.func.sum(ledger.c.amount)).group_by(
                        ledger.c.account
                    )
                )
            ).all()
        )
    await engine.dispose()
    nc = await nats.connect(nats_url)
    stored = (await nc.jetstream().stream_info(STREAM)).state.messages
    await nc.close()

    effects = {str(t["id"]): 0 for t in plan.transfers}
    effects.update({tid: n for tid, n in rows})
    expected = {a: 0 for a in ACCOUNTS}
    for t in plan.transfers:
        expected[str(t["account"])] += int(str(t["amount"]))
    published = sum(plan.publishes.values()) + len(plan.late_republishes) + 1
    by_count: dict[int, int] = {}
    for n in effects.values():
        by_count[n] = by_count.get(n, 0) + 1
    print(f"  published {published} times; the server stored {stored} (it dropped duplicates")
    print(f"  inside its {DUPLICATE_WINDOW_S:.0f} s window); workers SIGKILLed {crashes} times;")
    print(f"  {skipped} redeliveries and late republishes were skipped by the inbox")
    print()
    print(f"  {'transfers':>10}  {'effects each':>12}")
    for n in sorted(by_count):
        print(f"  {by_count[n]:>10}  {n:>12}")
    print()
    print(f"  {'account':<8} {'balance':>8} {'expected':>9}")
    for account in ACCOUNTS:
        got = int(balances.get(account) or 0)
        print(f"  {account:<8} {got:>8} {expected[account]:>9}")
    print()
    print("  dead letters: " + (", ".join(f"{r} x{c}" for r, c in dead) or "none"))
    ok = set(by_count) == {1} and all(int(balances.get(a) or 0) == expected[a] for a in ACCOUNTS)
    print(
        "  every transfer took effect exactly once"
        if ok
        else "  FAILED: some transfer was lost or applied twice"
    )
    return 0 if ok else 1
