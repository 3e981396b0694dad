"""eop.runtime.supervisor: how many processes, what each runs, with which arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eop.runtime import supervisor
from eop.runtime.supervisor import Child
from eop.settings import Settings


def _affinity() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        ("150000 100000\n", lambda n: min(n, 2)),  # 1.5 CPUs: two processes' worth
        ("50000 100000\n", lambda n: 1),
        ("max 100000\n", lambda n: n),
        (None, lambda n: n),  # no cgroup v2 file
        ("garbage", lambda n: n),
    ],
    ids=["quota-1.5", "quota-0.5", "no-quota", "no-file", "unreadable"],
)
def test_available_cpus_is_the_affinity_capped_by_the_cgroup_quota(
    tmp_path: Path, cpu_max: str | None, expected: object
) -> None:
    """A container's CPU quota caps the cores its affinity shows."""
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    assert supervisor.available_cpus(path) == expected(_affinity())  # type: ignore[operator]


def test_process_count_zero_means_available_cpus_up_to_four() -> None:
    """0 is automatic (one per CPU, at most 4); anything else is taken as it is."""
    assert supervisor.process_count(0) == min(supervisor.available_cpus(), 4)
    assert supervisor.process_count(7) == 7
    assert supervisor.process_count(1) == 1


def test_every_process_runs_every_handler_ordered_ones_included() -> None:
    """Ordered handlers share their partitions out among processes: every child runs them."""
    children = supervisor.plan(3, [("a", False), ("ordered", True), ("b", False)], 5)
    assert [c.handlers for c in children] == [("a", "ordered", "b")] * 3
    assert {c.db_pool_size for c in children} == {5}


def test_only_ordered_handlers_still_start_every_process() -> None:
    """An app of ordered handlers only scales out too: as many children as asked for."""
    children = supervisor.plan(4, [("ordered", True)], 4)
    assert children == [Child(("ordered",), 4)] * 4


def test_a_child_gets_the_same_arguments_with_its_own_per_child_flags() -> None:
    """--processes, --handler, --metrics-port and --db-pool-size are replaced, in both
    spellings; every other argument is passed on in order. With the supervisor's metrics
    directory, a child serves nothing (--metrics-port 0) and reports there."""
    argv = [
        "--log-level",
        "debug",
        "worker",
        "myapp:app",
        "--processes",
        "2",
        "--handler",
        "a",
        "--handler=ordered",
        "--metrics-port=9000",
        "--batch",
        "32",
        "--db-pool-size",
        "3",
    ]
    child = Child(("a",), 4)
    assert supervisor.child_argv(argv, child, "/tmp/eop-metrics-x") == [
        "--log-level",
        "debug",
        "worker",
        "myapp:app",
        "--batch",
        "32",
        "--processes",
        "1",
        "--handler",
        "a",
        "--metrics-port",
        "0",
        "--metrics-dir",
        "/tmp/eop-metrics-x",
        "--db-pool-size",
        "4",
    ]
    assert "--metrics-port" not in supervisor.child_argv(argv, child)


def test_the_connections_are_shared_out_but_never_below_four() -> None:
    """min(concurrency, 16) divided among the processes, at least 4 each; a set
    db_pool_size is taken as it is."""
    assert Settings(concurrency=128).db_connections(2) == 8
    assert Settings(concurrency=128).db_connections(4) == 4
    assert Settings(concurrency=128).db_connections(8) == 4
    assert Settings(concurrency=8).db_connections(1) == 8
    assert Settings(concurrency=2).db_connections() == 2  # one process: as before
    assert Settings(db_pool_size=3).db_connections(2) == 3


def test_worker_flags_cannot_be_abbreviated() -> None:
    """The supervisor replaces its per-child flags by their full names only."""
    from eop import cli

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["worker", "m:app", "--proc", "2"])


def test_exit_codes_follow_the_shell_convention_for_signals() -> None:
    """A child killed by signal N makes the supervisor exit 128 + N; an exit code passes as is."""
    import signal

    assert supervisor._exit_code(-signal.SIGKILL) == 128 + signal.SIGKILL
    assert supervisor._exit_code(3) == 3
    assert supervisor._exit_code(0) == 0


# A child that meets an error at start: written where the supervisor says, else on stderr.
_FAILING_CHILD = """
import sys
import time
args = sys.argv[1:]
report = "eop: error: eop's tables are missing\\n"
if "--error-file" in args:
    with open(args[args.index("--error-file") + 1], "w") as out:
        out.write(report)
else:
    sys.stderr.write(report)
sys.exit(1)
"""


# supervise() in a process of its own: pytest's may run other tests' threads, and a
# child forked with a preexec_fn beside threads can hang before its exec.
_SUPERVISOR = """
import sys
import time
from eop.runtime import supervisor
if sys.argv[1] == "no-tmp":
    def unwritable(*_, **__):
        raise OSError("read-only file system")
    supervisor.tempfile.TemporaryDirectory = unwritable
children = [["worker", "a"]] * int(sys.argv[2])
sys.exit(supervisor.supervise(children, program=[sys.executable, "-c", sys.argv[3]]))
"""


def _supervised(mode: str, children: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _SUPERVISOR, mode, str(children), _FAILING_CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_an_error_every_child_meets_is_printed_once() -> None:
    """Three processes refusing to start for the same reason: one `eop: error:` line, and
    the supervisor exits with the first child's status."""
    done = _supervised("tmp", 3)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("eop: error: ") == 1, done.stderr


def test_json_reports_that_differ_only_in_pid_and_time_are_printed_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With JSON logs each process's `command.failed` line has its own pid and time: the
    supervisor still prints one line for one error, and one per different error."""
    printed: set[str] = set()
    for pid, error in ((11, "tables missing"), (12, "tables missing"), (13, "other")):
        report = tmp_path / str(pid)
        entry = {"error": error, "event": "command.failed", "pid": pid, "timestamp": str(pid)}
        report.write_text(json.dumps(entry) + "\n")
        supervisor._print_once(report, printed)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(line["error"], line["pid"]) for line in lines] == [
        ("tables missing", 11),
        ("other", 13),
    ]


def test_without_a_temporary_directory_each_child_prints_its_own_error() -> None:
    """A read-only filesystem without /tmp: the supervisor still runs its processes, and
    each prints its error itself, as a lone process does."""
    done = _supervised("no-tmp", 2)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("eop: error: ") == 2, done.stderr


def test_a_child_that_ends_by_itself_with_status_0_makes_the_worker_exit_1() -> None:
    """A process that ended before any stop, even cleanly (a SIGTERM sent to it alone),
    leaves the worker short of a process: the supervisor stops the others and exits 1,
    a failure to a restart policy, rather than 0, which reads as a worker that finished."""
    done = subprocess.run(
        [sys.executable, "-c", _SUPERVISOR, "tmp", "2", "import sys; sys.exit(0)"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr


def test_a_child_reaped_elsewhere_is_still_seen_to_exit() -> None:
    """Another part of the process reaped one of the children while another child of the
    process lives on: the supervisor still sees it gone (waiting for any child found
    nothing for ever then)."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        os.waitpid(child.pid, 0)  # reaped behind the supervisor's back
        deadline = time.monotonic() + 10
        seen: tuple[int | None, int] = (None, 0)
        while seen[0] is None and time.monotonic() < deadline:
            seen = supervisor._wait_any({child.pid: child})
        assert seen[0] == child.pid
    finally:
        other.kill()
        other.wait()
