"""Who arms fault points: never `eop worker` from its environment, always the chaos
harness's entry point (`python -m eop.tools.chaos.armed worker`), its supervised children too."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from eop.tools.chaos import armed

from .bed import create_effects_table, drained, effects_by_body, publish, wait_for
from .test_cli import Workers, consumer_exists

KILL_AFTER_COMMIT = {"EOP_FAULTS": "after_commit=kill#1", "EOP_FAULT_SEED": "1"}


def events(logs: str, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of ``event``."""
    lines = (json.loads(line) for line in logs.splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == event]


async def test_eop_worker_with_eop_faults_set_warns_and_is_not_killed(
    engine: AsyncEngine, js: Any, workers: Workers
) -> None:
    """A stray EOP_FAULTS=after_commit=kill#1 in production: `eop worker` logs one
    `fault.ignored` warning, processes and acks the message, and stops cleanly."""
    await create_effects_table(engine)
    proc = workers.start(env=KILL_AFTER_COMMIT)
    await wait_for(lambda: consumer_exists(js), what="the consumer")
    await publish(js, "m1", msg_id="id-1")
    await wait_for(lambda: drained(js, "eop-cli"), what="the message to be acked")
    assert proc.poll() is None
    assert workers.stop_all() == [0]
    assert await effects_by_body(engine) == {"m1": 1}
    logs = workers.logs()
    assert [e["level"] for e in events(logs, "fault.ignored")] == ["warning"]
    assert events(logs, "fault.armed") == events(logs, "fault.hit") == []


async def test_the_chaos_entry_point_kills_the_worker_at_the_armed_point(
    engine: AsyncEngine, js: Any, workers: Workers
) -> None:
    """The same variables through `python -m eop.tools.chaos.armed worker`: the worker SIGKILLs
    itself after its first COMMIT, so the effect stands and the ack never went."""
    await create_effects_table(engine)
    proc = workers.start(env=KILL_AFTER_COMMIT, module=armed.MODULE)
    await wait_for(lambda: consumer_exists(js), what="the consumer")
    await publish(js, "m1", msg_id="id-1")
    assert await asyncio.to_thread(proc.wait, 30) == -signal.SIGKILL
    assert await effects_by_body(engine) == {"m1": 1}
    assert not await drained(js, "eop-cli")
    [hit] = events(workers.logs(), "fault.hit")
    assert (hit["point"], hit["action"]) == ("after_commit", "kill")


async def test_the_chaos_entry_point_arms_the_children_of_processes_n(
    engine: AsyncEngine, js: Any, workers: Workers
) -> None:
    """`python -m eop.tools.chaos.armed worker --processes 2` starts its children through the
    same entry point: each arms the rules, and the one given the message dies at them."""
    await create_effects_table(engine)
    proc = workers.start("--processes", "2", env=KILL_AFTER_COMMIT, module=armed.MODULE)
    await wait_for(lambda: consumer_exists(js), what="the consumer")

    async def both_started() -> bool:
        # Else the supervisor may stop a child still starting, before it armed anything.
        return len({e["pid"] for e in events(workers.logs(), "worker.started")}) == 2

    await wait_for(both_started, what="both children started")
    await publish(js, "m1", msg_id="id-1")
    # A child ended by itself: the supervisor stops the other and exits 128 + SIGKILL.
    assert await asyncio.to_thread(proc.wait, 60) == 128 + signal.SIGKILL
    logs = workers.logs()
    [hit] = events(logs, "fault.hit")
    assert hit["point"] == "after_commit"
    armed_pids = {e["pid"] for e in events(logs, "fault.armed")}
    assert armed_pids - {proc.pid} == {e["pid"] for e in events(logs, "worker.starting")}
    assert len(armed_pids - {proc.pid}) == 2
    assert hit["pid"] in armed_pids
