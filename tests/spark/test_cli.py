"""`eop spark`'s command line, without running Spark."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import eop.contrib.spark as spark_pkg
from eop import cli, errors
from eop.cli import spark as spark_cli


@pytest.mark.parametrize("action", ["backfill", "stream"])
def test_every_flag_names_its_environment_variable(
    action: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--help shows the EOP_* variable of each flag, like the other commands."""
    with pytest.raises(SystemExit):
        cli.main(["spark", action, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for var in ("EOP_SPARK_HANDLER", "EOP_SPARK_MASTER", "EOP_SPARK_CONF", "EOP_DATABASE_URL"):
        assert var in out
    specific = ["EOP_SPARK_TO_SEQ"] if action == "backfill" else ["EOP_SPARK_CHECKPOINT"]
    assert all(var in out for var in specific)


def test_environment_variables_give_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """EOP_SPARK_* set a flag's default; a flag given still wins."""
    monkeypatch.setenv("EOP_SPARK_HANDLER", "billing")
    monkeypatch.setenv("EOP_SPARK_FROM_SEQ", "10")
    monkeypatch.setenv("EOP_SPARK_MASTER", "spark://m:7077")
    args = cli.build_parser("spark").parse_args(
        ["spark", "backfill", "app:app", "--from-seq", "20"]
    )
    assert (args.handler, args.from_seq, args.master) == ("billing", 20, "spark://m:7077")


def test_spark_settings_are_key_value_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """--conf KEY=VALUE, or EOP_SPARK_CONF comma separated; Spark's progress bar is off."""
    monkeypatch.setenv("EOP_SPARK_CONF", "spark.a=1, spark.b=x=y")
    args = cli.build_parser("spark").parse_args(["spark", "backfill", "app:app", "--handler", "h"])
    conf = spark_cli._conf(args)
    assert conf == {"spark.a": "1", "spark.b": "x=y", "spark.ui.showConsoleProgress": "false"}
    args.conf = ["nonsense"]
    with pytest.raises(errors.ConfigurationError, match="KEY=VALUE"):
        spark_cli._conf(args)


def test_python_and_py_files_are_options_with_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--python and --py-files (EOP_SPARK_PYTHON, EOP_SPARK_PY_FILES); a missing file is refused."""
    app = tmp_path / "myapp.py"
    app.write_text("")
    monkeypatch.setenv("EOP_SPARK_PYTHON", "/opt/env/bin/python")
    monkeypatch.setenv("EOP_SPARK_PY_FILES", f"{app}")
    args = cli.build_parser("spark").parse_args(["spark", "backfill", "app:app", "--handler", "h"])
    assert args.python == "/opt/env/bin/python"
    assert spark_cli.py_files(args) == [str(app)]
    args.py_files = [f"{app},{tmp_path / 'gone.py'}"]
    with pytest.raises(errors.ConfigurationError, match=r"gone\.py' is not a file"):
        spark_cli.py_files(args)


def test_the_spark_submit_entry_point_is_in_the_package() -> None:
    """`python -m eop.contrib.spark --path` prints a file of the installed package that runs
    `eop spark`."""
    out = subprocess.run(
        [sys.executable, "-m", "eop.contrib.spark", "--path"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    ).stdout.strip()
    path = Path(out)
    assert path.is_file()
    assert path.parent == Path(spark_pkg.__file__).parent
    helped = subprocess.run(
        [sys.executable, str(path), "backfill", "--help"], capture_output=True, text=True, cwd="/"
    )
    assert helped.returncode == 0, helped.stderr
    assert "--py-files" in helped.stdout


def test_a_stream_on_spark_connect_refuses_py_files_whose_tasks_would_not_see_them(
    tmp_path: Path,
) -> None:
    """Spark Connect gives --py-files artifacts to batch jobs only: a stream's micro-batches
    would fail on importing the app after the probe (a batch job) passed, so the command
    refuses at once, naming the fix, before it connects."""
    app = tmp_path / "myapp.py"
    app.write_text("")
    argv = ["spark", "stream", "myapp:app", "--handler", "h", "--checkpoint", str(tmp_path)]
    args = cli.build_parser("spark").parse_args(
        [*argv, "--remote", "sc://127.0.0.1:1", "--py-files", str(app)]
    )
    session = spark_cli._session(args, "eop-stream-h", streaming=True)
    with pytest.raises(errors.ConfigurationError, match="install the app's module"), session:
        pass
