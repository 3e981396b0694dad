"""The developer tools in one folder, eop/tools: left out of a production image, old paths kept.

A production image deletes eop/tools (the Dockerfile); CONTRIBUTING.md says why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Run in a copy of the package without eop/tools: the worker's start-up, then each
#: tool's command; prints what each did as JSON.
WITHOUT_TOOLS = """
import contextlib, io, json, sys
import eop
from eop import cli

def run(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = cli.main(argv)
        except SystemExit as exc:
            status = exc.code
    return {"status": status, "stderr": err.getvalue().splitlines()}

found = {"package": eop.__file__, "worker --help": run(["worker", "--help"])}
found["worker"] = run(["worker", "no_such_module_xyz:app"])
found["loaded"] = sorted(m for m in sys.modules if m.startswith("eop"))
for argv in (["chaos"], ["bench", "--help"], ["demo"]):
    found[" ".join(argv)] = run(argv)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def without_tools(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """What the ``eop`` command did in a copy of eop that has no eop/tools, as an image
    that deleted it has."""
    copy = tmp_path_factory.mktemp("without-tools")
    shutil.copytree(
        ROOT / "eop",
        copy / "eop",
        ignore=shutil.ignore_patterns("__pycache__", "tools"),
    )
    assert not (copy / "eop" / "tools").exists()
    env = {**os.environ, "PYTHONPATH": str(copy)}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TOOLS],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    found: dict[str, object] = json.loads(done.stdout)
    assert str(found["package"]).startswith(str(copy)), found["package"]  # not /work's eop
    return found


def test_a_worker_starts_without_the_tools(without_tools: dict[str, object]) -> None:
    """``eop worker --help`` and a worker's start-up (as far as loading its app) need
    nothing of eop/tools."""
    assert without_tools["worker --help"] == {"status": 0, "stderr": []}
    assert "eop.runtime.worker" in without_tools["loaded"]  # type: ignore[operator]  # a list
    # The app does not exist: the worker says so in its own words, not about the tools.
    worker = without_tools["worker"]
    assert worker["status"] == 1, worker  # type: ignore[index]  # a dict
    assert "eop.tools" not in " ".join(worker["stderr"])  # type: ignore[index]  # a dict


@pytest.mark.parametrize("command", ["chaos", "bench --help", "demo"])
def test_a_tool_left_out_is_one_line_naming_the_extra(
    without_tools: dict[str, object], command: str
) -> None:
    """``eop chaos``, ``eop bench`` and ``eop demo`` without eop/tools print one error line
    saying what to install, and no traceback."""
    done = without_tools[command]
    assert done["status"] == 1, done  # type: ignore[index]  # a dict
    (line,) = done["stderr"]  # type: ignore[index]  # a dict
    assert line.startswith("eop: error: ")
    assert f"`eop {command.split()[0]}` needs eop's developer tools (eop.tools)" in line
    assert "pip install --force-reinstall 'eop[embedded]'" in line


def test_the_production_image_deletes_the_tools() -> None:
    """The Dockerfile's runtime stage removes eop/tools after installing eop."""
    stages = (ROOT / "Dockerfile").read_text().split("\nFROM ")
    runtime = stages[-1]
    assert "pip install" in runtime
    install = runtime[runtime.index("pip install") :]
    assert "rm -r \"$(python -c 'import eop.tools, os; print(os.path.dirname(" in install


def test_the_old_paths_are_aliases_of_the_new() -> None:
    """``eop.embedded``, ``eop.embedded_cluster``, ``eop.chaos`` and ``eop.spark`` give the
    objects of their new modules."""
    from eop import chaos, embedded, embedded_cluster, spark
    from eop.contrib.spark import errors as spark_errors
    from eop.tools import chaos as new_chaos
    from eop.tools import embedded as new_embedded
    from eop.tools import embedded_cluster as new_cluster

    assert embedded.NatsServer is new_embedded.NatsServer
    assert embedded.free_port is new_embedded.free_port
    assert embedded_cluster.NatsCluster is new_cluster.NatsCluster
    assert (chaos.run, chaos.Config, chaos.Payload) == (
        new_chaos.run,
        new_chaos.Config,
        new_chaos.Payload,
    )
    assert spark.errors is spark_errors
    with pytest.raises(AttributeError):
        spark.no_such_module  # noqa: B018  # the attribute access is the test


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["eop.spark", "--path"], "eop/contrib/spark/__main__.py"),
        (["eop.chaos", "--help"], "usage: eop chaos"),
        (["eop.chaos.armed", "--help"], "usage: eop"),
    ],
)
def test_the_old_entry_points_run_the_new(argv: list[str], expected: str) -> None:
    """``python -m eop.spark`` (spark-submit's), ``python -m eop.chaos`` and ``python -m
    eop.chaos.armed`` still run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", *argv], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout
