"""An ordered handler under Django: ``manage.py eop_worker`` processes sharing its partitions.

The project's ``ledger`` handler (djproject/handlers.py) is a per-account state
machine written with the ORM: it locks the account, records whether the step it
applies is the account's next one (``shop_step.in_order``) and makes it the last,
so an inversion or a gap is counted in the database itself. Its partition leases
are taken on eop's own engine (``app.engine``, asyncpg) while its transactions
run on Django's connection.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.integration.bed import wait_for

from .test_handlers import rows, worker
from .test_manage import manage_env, start_worker

pytestmark = pytest.mark.timeout(300)

PARTITIONS = 2


async def ledger_accounts(count: int) -> None:
    """Accounts ``acc0``... at step 0 (an Account's balance is its last step)."""
    for i in range(count):
        await rows(
            "INSERT INTO shop_account (name, balance) VALUES (%s, 0) RETURNING id", f"acc{i}"
        )


async def publish_burst(js: Any, accounts: int, steps: int) -> None:
    """Steps 1..``steps`` of every account, interleaved, in one burst."""
    acks = [
        js.publish(f"djledger.acc{i}.step", str(step).encode())
        for step in range(1, steps + 1)
        for i in range(accounts)
    ]
    await asyncio.gather(*acks)


async def owner_pids() -> set[int] | None:
    """The processes owning the ledger's partitions now; None while one has no live owner."""
    found = await rows(
        "SELECT owner_pid FROM eop.partitions WHERE subscription = 'ledger'"
        " AND owner IS NOT NULL AND expires_at >= now()"
    )
    if len(found) != PARTITIONS:
        return None
    return {int(pid) for (pid,) in found}


async def epochs() -> dict[int, int]:
    """Each partition's epoch (one more per ownership)."""
    found = await rows("SELECT partition, epoch FROM eop.partitions WHERE subscription = 'ledger'")
    return {int(p): int(e) for p, e in found}


async def ledger_counts() -> tuple[int, int, int]:
    """(steps applied, applied out of order, steps applied more than once)."""
    ((total, bad),) = await rows(
        "SELECT count(*), count(*) FILTER (WHERE NOT in_order) FROM shop_step"
    )
    ((twice,),) = await rows(
        "SELECT count(*) FROM (SELECT 1 FROM shop_step GROUP BY account, step"
        " HAVING count(*) > 1) d"
    )
    return int(total), int(bad), int(twice)


async def applied(count: int) -> bool:
    """At least ``count`` steps applied."""
    return int((await rows("SELECT count(*) FROM shop_step"))[0][0]) >= count


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
async def test_two_eop_workers_share_an_ordered_handlers_partitions_and_keep_order(
    project: str, nats_url: str, js: Any, tmp_path: Path, stop: str
) -> None:
    """Two ``manage.py eop_worker --handler ledger`` processes: the stream eop creates has
    the partition transform, each process owns one of the 2 partitions (leases on eop's
    engine, the ORM's writes on Django's connection), and one stopped mid-burst (SIGTERM:
    hands over at once; SIGKILL: when its lease runs out) leaves its partition to the
    other: every step of every account applied once and in order, the survivor exits 0."""
    accounts, steps = 8, 50
    await ledger_accounts(accounts)
    env = manage_env(project, nats_url, EOP_PARTITION_LEASE_S="3", EOP_CONCURRENCY="16")
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = start_worker(env, logs[0], "--handler", "ledger")
    second = start_worker(env, logs[1], "--handler", "ledger")

    def log() -> str:
        return "".join(path.read_text() for path in logs if path.exists())

    async def owned_by(pids: set[int]) -> bool:
        return await owner_pids() == pids

    try:
        await wait_for(
            lambda: owned_by({first.pid, second.pid}),
            timeout_s=90,
            what=f"a partition owned by each worker; their log:\n{log()[-3000:]}",
        )
        transform = (await js.stream_info("DJLEDGER")).config.subject_transform
        assert transform is not None
        assert transform.dest == "{{partition(2,1)}}.djledger.{{wildcard(1)}}.step"
        before = await epochs()
        await publish_burst(js, accounts, steps)
        await wait_for(
            lambda: applied(accounts * steps // 4), timeout_s=60, what="a quarter of the steps"
        )
        second.send_signal(getattr(signal, stop))
        at_stop = int((await rows("SELECT count(*) FROM shop_step"))[0][0])
        stopped = await asyncio.to_thread(second.wait, 60)
        await wait_for(lambda: owned_by({first.pid}), timeout_s=60, what="the survivor owning both")
        await wait_for(
            lambda: applied(accounts * steps),
            timeout_s=120,
            what=f"every step; the workers' log:\n{log()[-3000:]}",
        )
        after = await epochs()
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(first.wait, 40)
        if second.poll() is None:
            second.kill()
    print(f"\n[django ordered, {stop}] steps applied at the stop: {at_stop}")
    assert at_stop < accounts * steps  # mid-burst
    assert stopped == (0 if stop == "SIGTERM" else -signal.SIGKILL)
    assert code == 0, log()[-3000:]
    assert await ledger_counts() == (accounts * steps, 0, 0)
    # Only the stopped worker's partition changed hands (a new epoch).
    assert sum(after[p] > before[p] for p in before) == 1, (before, after)
    assert await rows("SELECT count(*) FROM eop.dead_letters") == [(0,)]
    assert '"event": "partition.failed"' not in log()
    assert "Traceback" not in log()


async def test_a_worker_of_other_handlers_started_first_creates_the_ledgers_stream_right(
    project: str, nats_url: str, js: Any
) -> None:
    """``manage.py eop_worker --handler slow`` started before the ledger's workers creates
    every stream the app declares, DJLEDGER included: with the partition transform the
    ledger's 2 partitions need, so that the ledger's worker then starts (which process of
    a fleet starts first is nobody's choice)."""
    async with worker(nats_url, "slow"):
        pass
    async with worker(nats_url, "ledger"):
        pass
    transform = (await js.stream_info("DJLEDGER")).config.subject_transform
    assert transform is not None
