"""`eop worker --processes N` as a user runs it: real processes, signals, servers."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from eop.observe import reports
from eop.tools import embedded

from .bed import create_effects_table, drained, effects_by_body, publish, wait_for
from .test_cli import Workers, consumer_exists
from .test_telemetry import get, scrape, value


def _started_pids(log: Path) -> list[int]:
    """The worker processes the supervisor says it started (its `processes.started` line)."""
    for line in log.read_text().splitlines():
        if line.startswith("{") and '"processes.started"' in line:
            return [int(pid) for pid in json.loads(line)["pids"]]
    return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def _pids(log: Path) -> list[int]:
    await wait_for(lambda: _have_pids(log), what="the supervisor's processes.started line")
    return _started_pids(log)


async def _have_pids(log: Path) -> bool:
    return len(_started_pids(log)) == 2


async def _all_gone(pids: list[int]) -> bool:
    return not any(_alive(pid) for pid in pids)


async def test_two_processes_share_the_consumer_and_stop_together_on_sigterm(
    engine: AsyncEngine, js: Any, workers: Workers, tmp_path: Path
) -> None:
    """Both processes consume; each message takes effect once; SIGTERM stops both; exit 0."""
    await create_effects_table(engine)
    proc = workers.start("--processes", "2", "--concurrency", "4", "--batch", "4")
    pids = await _pids(tmp_path / "worker-0.log")
    await wait_for(lambda: consumer_exists(js), what="the consumer")
    for i in range(200):
        await publish(js, f"m{i}")
    await wait_for(lambda: drained(js, "eop-cli"), timeout_s=60, what="all messages")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    await wait_for(lambda: _all_gone(pids), what="both worker processes to exit")
    assert await effects_by_body(engine) == {f"m{i}": 1 for i in range(200)}
    log = workers.logs()
    assert log.count('"worker.started"') == 2
    assert log.count('"worker.stopped"') == 2


async def test_a_worker_process_that_dies_stops_the_other_and_sets_the_exit_status(
    engine: AsyncEngine, js: Any, workers: Workers, tmp_path: Path
) -> None:
    """SIGKILL of one process: the supervisor stops the other (SIGTERM), exits 128 + 9, and
    says so at level error (an operator alerting on errors must see a crashed process)."""
    await create_effects_table(engine)
    proc = workers.start("--processes", "2")
    pids = await _pids(tmp_path / "worker-0.log")
    await wait_for(lambda: consumer_exists(js), what="the consumer")

    # Both at work: a process still importing would die of the SIGTERM (143)
    # before it could stop cleanly, which is another test's matter.
    async def both_started() -> bool:
        return workers.logs().count('"worker.started"') == 2

    await wait_for(both_started, what="both processes started")
    os.kill(pids[1], signal.SIGKILL)
    assert proc.wait(timeout=60) == 128 + signal.SIGKILL
    await wait_for(lambda: _all_gone(pids), what="the other worker process to exit")
    assert workers.logs().count('"worker.stopped"') == 1  # the survivor stopped cleanly
    exits = {
        line["pid"]: line["level"]
        for line in map(json.loads, _json_lines(workers.logs()))
        if line.get("event") == "processes.exited"
    }
    assert exits == {pids[1]: "error", pids[0]: "info"}


async def test_the_worker_processes_do_not_outlive_a_killed_supervisor(
    engine: AsyncEngine, js: Any, workers: Workers, tmp_path: Path
) -> None:
    """SIGKILL of the supervisor: its processes get SIGTERM (parent-death signal) and stop,
    and messages published afterwards are processed once by a new worker."""
    await create_effects_table(engine)
    proc = workers.start("--processes", "2")
    pids = await _pids(tmp_path / "worker-0.log")
    await wait_for(lambda: consumer_exists(js), what="the consumer")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    await wait_for(lambda: _all_gone(pids), timeout_s=60, what="the orphaned processes to stop")
    workers.start("--processes", "1")
    for i in range(20):
        await publish(js, f"after-{i}")
    await wait_for(lambda: drained(js, "eop-cli"), timeout_s=60, what="the new worker")
    assert await effects_by_body(engine) == {f"after-{i}": 1 for i in range(20)}


def _metrics_dir(pid: int) -> Path:
    """The directory the supervisor named to its process ``pid`` (its --metrics-dir)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return Path(argv[argv.index("--metrics-dir") + 1])


async def _status(port: int, path: str) -> int:
    try:
        return (await get(port, path))[0]
    except OSError:
        return 0  # not serving


async def test_one_port_serves_the_metrics_and_the_health_of_every_process(
    engine: AsyncEngine, js: Any, workers: Workers, tmp_path: Path
) -> None:
    """--processes 2 --metrics-port P: P alone serves; its counters are the sum over both
    processes (the messages processed); /readyz and /healthz fail while one process does not
    answer and hold again when it does; once one is gone /readyz fails for good; the shared
    directory is removed at the end."""
    await create_effects_table(engine)
    port = embedded.free_port()
    proc = workers.start(
        *("--processes", "2", "--metrics-port", str(port), "--concurrency", "4", "--batch", "4"),
        env={"EOP_METRICS_HOST": "127.0.0.1"},
    )
    pids = await _pids(tmp_path / "worker-0.log")
    directory = _metrics_dir(pids[0])
    assert _metrics_dir(pids[1]) == directory

    async def status_is(path: str, expected: int) -> bool:
        return await _status(port, path) == expected

    await wait_for(lambda: status_is("/readyz", 200), timeout_s=60, what="the worker ready")
    for i in range(200):
        await publish(js, f"m{i}")
    await wait_for(lambda: drained(js, "eop-cli"), timeout_s=60, what="all messages")
    samples = await scrape(port)
    labels = {"handler": "cli", "stream": "ORDERS"}
    assert value(samples, "eop_messages_processed_total", **labels) == 200
    assert value(samples, "eop_commit_to_ack_seconds_count", **labels) == 200
    assert value(samples, "eop_messages_in_flight", **labels) == 0
    assert await _status(port + 1, "/metrics") == 0  # no per-process port any more

    os.kill(pids[1], signal.SIGSTOP)  # one process stops answering
    try:
        await wait_for(
            lambda: status_is("/readyz", 503),
            timeout_s=reports.STALE_S + 30,
            what="/readyz to fail",
        )
        assert "processes_answering fail" in (await get(port, "/readyz"))[1]
        assert await _status(port, "/healthz") == 503
    finally:
        os.kill(pids[1], signal.SIGCONT)
    await wait_for(lambda: status_is("/readyz", 200), timeout_s=30, what="/readyz again")
    assert await _status(port, "/healthz") == 200

    os.kill(pids[1], signal.SIGKILL)  # one process gone: the worker is not ready any more
    await wait_for(lambda: _exited(workers, pids[1]), what="the supervisor to see it exit")
    assert await _status(port, "/readyz") in (503, 0)  # 0: the supervisor has ended already
    assert proc.wait(timeout=60) == 128 + signal.SIGKILL
    assert not directory.exists()
    assert await effects_by_body(engine) == {f"m{i}": 1 for i in range(200)}


def _json_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("{")]


async def _exited(workers: Workers, pid: int) -> bool:
    return any(
        line.startswith("{")
        and json.loads(line).get("event") == "processes.exited"
        and json.loads(line).get("pid") == pid
        for line in workers.logs().splitlines()
    )
