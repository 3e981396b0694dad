"""What the commands of ``eop`` share: flags for settings, app loading, running, errors.

Also used by the commands that live beside their features (:mod:`eop.cli.spark`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import dataclasses
import datetime
import functools
import json
import os
import re
import sys
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    NoReturn,
    TypeVar,
    get_args,
    get_origin,
    get_type_hints,
)

from eop import errors, log, redaction
from eop import settings as settings_mod
from eop.app import App
from eop.pg import migrate

if TYPE_CHECKING:
    #: What ``add_subparsers()`` returns: each subcommand module adds its parsers to it.
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

T = TypeVar("T")

#: The NATS authentication and TLS settings offered as flags. Passwords and
#: tokens are not: a command line is visible to every user of the machine.
NATS_AUTH_FIELDS = (
    "nats_user",
    "nats_nkey_seed_file",
    "nats_creds_file",
    "nats_tls_ca_file",
    "nats_tls_cert_file",
    "nats_tls_key_file",
    "nats_tls_hostname",
    "nats_tls_handshake_first",
)


@dataclasses.dataclass(frozen=True)
class Host:
    """A program that runs eop's command line on its own configuration (Django's
    ``manage.py eop``): the help then says where the settings and the app come from."""

    prog: str
    """The command as its users type it, e.g. ``manage.py eop``."""
    settings: str
    """Where its settings are written, e.g. ``settings.EOP``: each key a setting's name in
    capitals, exported to the environment variable the help names."""
    app: str
    """Where the app comes from, given for the user where a command takes one."""
    fixed: tuple[str, ...] = ()
    """Settings the host sets itself and refuses as flags: left out of the help."""


_HOST: contextvars.ContextVar[Host | None] = contextvars.ContextVar("eop_cli_host", default=None)


@contextlib.contextmanager
def hosted(host: Host | None) -> Iterator[None]:
    """Build the parsers within for ``host`` (None: the plain ``eop`` command)."""
    token = _HOST.set(host)
    try:
        yield
    finally:
        _HOST.reset(token)


def prog() -> str:
    """The program the help's usage lines name."""
    host = _HOST.get()
    return "eop" if host is None else host.prog


#: The settings of the commands that read the database only.
DB_FIELDS = ("database_url", "schema", "db_pooler")

#: The settings of the commands that read the database and the stream.
SERVER_FIELDS = ("database_url", "nats_url", "schema", "db_pooler")

#: How the outbox relay publishes: offered by ``eop relay`` and by ``eop worker``, which
#: runs a relay too.
PUBLISHING_FIELDS = (
    "outbox_batch",
    "outbox_poll_s",
    "outbox_keep_s",
    "outbox_max_attempts",
    "relay_lease_s",
    "publish_timeout_s",
)


class Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line, ``eop: error: ...``.

    Its subcommands' parsers are of this class too (``add_subparsers`` makes
    them with the class of their parent).
    """

    def error(self, message: str) -> NoReturn:
        """Print ``message`` on one line, with where to read the usage, and exit 2 (a JSON
        ``command.failed`` line when JSON lines are asked for: :func:`json_asked`)."""
        print_error(errors.ConfigurationError(f"{message} (see `{self.prog} --help`)"))
        self.exit(2)


class _CommandLine:
    argv: Sequence[str] | None = None


def command_line(argv: Sequence[str] | None) -> None:
    """The arguments of the command being run (None: ``sys.argv``), for :func:`json_asked`
    when a parser refuses them."""
    _CommandLine.argv = argv


def json_asked(argv: Sequence[str] | None = None) -> bool:
    """Whether the command line (``--log-format``, which wins) or ``EOP_LOG_FORMAT`` asks
    for JSON lines: read before the arguments are parsed, or when they cannot be."""
    given = argv if argv is not None else _CommandLine.argv
    args = list(sys.argv[1:] if given is None else given)
    for i, arg in enumerate(args):
        if arg == "--log-format" and i + 1 < len(args):
            return args[i + 1].strip().lower() == "json"
        if arg.startswith("--log-format="):
            return arg.partition("=")[2].strip().lower() == "json"
    return os.environ.get(settings_mod.env_var("log_format"), "").strip().lower() == "json"


def env_list(var: str) -> list[str]:
    """The comma separated items of the environment variable ``var`` (none when unset)."""
    return [item.strip() for item in os.environ.get(var, "").split(",") if item.strip()]


def env_value(var: str, kind: Any, raw: str) -> Any:
    """``raw``, the value of ``EOP_*`` variable ``var``, as a ``kind`` (bool, int, float, str).

    The rules of eop's settings (true/false words, numbers); a bad value stops
    the command with one sentence naming the variable, not a traceback (parsers
    are built before ``main`` can catch anything).
    """
    try:
        return settings_mod.parse_value(var.removeprefix("EOP_").lower(), kind, raw)
    except errors.ConfigurationError as exc:
        print_error(exc)
        raise SystemExit(1) from None


def env_int(var: str, default: int | None) -> int | None:
    """The integer in the environment variable ``var``, else ``default``; exits if not one."""
    raw = os.environ.get(var)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"eop: error: {var}={raw!r} is not an integer") from None


def add_log_options(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """Log flags, accepted before and after the subcommand.

    On subcommands their default is SUPPRESS, so they only override a value
    given before the subcommand when they are given themselves.
    """
    add_setting(parser, "log_format", choices=["console", "json"], suppress=suppress)
    add_setting(
        parser, "log_level", choices=["debug", "info", "warning", "error"], suppress=suppress
    )


def add_app_arguments(parser: argparse.ArgumentParser, *, app_help: str, handler_help: str) -> None:
    """The log flags, the ``MODULE:APP`` argument and a repeatable ``--handler NAME``."""
    add_log_options(parser, suppress=True)
    host = _HOST.get()
    if host is None:
        parser.add_argument("app", metavar="MODULE:APP", help=app_help)
    else:
        parser.add_argument(
            "app", metavar="MODULE:APP", nargs="?", help=f"{app_help} [default: {host.app}]"
        )
    parser.add_argument("--handler", action="append", default=[], metavar="NAME", help=handler_help)


def add_db_options(parser: argparse.ArgumentParser) -> None:
    """``--app`` (optional: where the database settings come from) and the database flags."""
    add_app_option(parser, "take the database URL and schema from this app")
    add_settings(parser, DB_FIELDS)


def add_app_option(parser: argparse.ArgumentParser, help_text: str) -> None:
    """An optional ``--app MODULE:APP`` (default ``$EOP_APP``): the app whose settings a
    command takes (:func:`db_app`)."""
    parser.add_argument(
        "--app",
        metavar="MODULE:APP",
        default=os.environ.get("EOP_APP"),
        help=f"{help_text} [{_app_source()}]",
    )


def _app_source() -> str:
    """Where ``--app`` comes from when it is not given, as its help says it."""
    host = _HOST.get()
    return "env: EOP_APP" if host is None else f"default: {host.app}"


def add_settings(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """A flag for each of the Settings fields ``names``."""
    for name in names:
        add_setting(parser, name)


@functools.cache
def _settings_fields() -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    """Each Settings field with its resolved type hint, read once: resolving the hints
    per flag cost every command a tenth of a second at start."""
    hints = get_type_hints(settings_mod.Settings)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(settings_mod.Settings)}


def add_setting(
    parser: argparse.ArgumentParser,
    name: str,
    choices: Sequence[str] | None = None,
    *,
    suppress: bool = False,
) -> None:
    """A flag for a Settings field; its help names the env var and the default."""
    field, hint = _settings_fields()[name]
    if choices is None and get_origin(hint) is Literal:
        choices = get_args(hint)
    flag = "--" + name.replace("_", "-")
    # The help is written for the docs (reST ``literals``); a terminal shows `literals`.
    text = field.metadata["help"].replace("``", "`")
    host = _HOST.get()
    source = f"env: {settings_mod.env_var(name)}"
    if host is not None:
        source = f"{host.settings}[{name.upper()!r}] or {source}"
    help_text = f"{text} [{source}; default: {field.default}]"
    if host is not None and name in host.fixed:
        help_text = argparse.SUPPRESS
    if hint is bool:
        parser.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
        return
    parser.add_argument(
        flag,
        type=_flag_type(name, hint),
        default=argparse.SUPPRESS if suppress else None,
        choices=choices,
        metavar=name.upper(),
        help=help_text,
    )


def _flag_type(name: str, hint: Any) -> Callable[[str], Any]:
    """A flag's converter: the settings' parsing rules, refusals in argparse's terms."""

    def convert(raw: str) -> Any:
        try:
            return settings_mod.parse_value(name, hint, raw)
        except errors.ConfigurationError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(hint, "__name__", "value")  # argparse's fallback message
    return convert


def overrides(args: argparse.Namespace, names: Sequence[str]) -> dict[str, object]:
    """The settings among ``names`` given as flags (unset flags leave the environment's)."""
    return {n: getattr(args, n, None) for n in names if getattr(args, n, None) is not None}


def load_app(path: str) -> App:
    """Import ``module:attribute`` and return the :class:`eop.App` it names."""
    return App.from_path(path)


def configured_app(args: argparse.Namespace, names: Sequence[str]) -> App:
    """The app of the ``MODULE:APP`` argument with the flags among ``names`` applied."""
    return load_app(args.app).with_settings(**overrides(args, names))


def db_app(args: argparse.Namespace, names: Sequence[str]) -> App:
    """The app named by --app (or EOP_APP) with flags applied, else one built from settings."""
    if getattr(args, "app", None):
        return configured_app(args, names)
    return App(settings=settings_mod.Settings.from_env(overrides=overrides(args, names)))


def run_with(app: App, coro: Coroutine[Any, Any, T], *, schema_ready: bool = False) -> T:
    """Run ``coro`` to its end, then close the app's connection pools.

    With ``schema_ready``, first check that eop's tables are migrated, so that a
    command on an unmigrated database says to run ``eop db upgrade``.
    """

    async def run() -> T:
        try:
            if schema_ready:
                await migrate.ensure_ready(app.engine, app.settings.schema)
            return await coro
        finally:
            coro.close()  # not started when the check failed: no "never awaited" warning
            await app.dispose()

    return asyncio.run(run())


TOOLS_PACKAGE = "eop.tools"
"""The developer tools' package, which a production image may leave out."""


@contextlib.contextmanager
def developer_tools(command: str) -> Iterator[None]:
    """Report :mod:`eop.tools` missing as one :class:`eop.ConfigurationError` naming the remedy.

    ``eop chaos``, ``eop bench`` and ``eop demo`` import it when they run; an
    image that deleted it (the Dockerfile's does) gets a sentence, not a traceback.
    Any other missing module is not this one's to explain.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        name = exc.name or ""
        if name != TOOLS_PACKAGE and not name.startswith(TOOLS_PACKAGE + "."):
            raise
        raise errors.ConfigurationError(
            f"`eop {command}` needs eop's developer tools (eop.tools), which this "
            "installation leaves out: reinstall eop with them and their servers, "
            "pip install --force-reinstall 'eop[embedded]'"
        ) from None


_WRAPPER = re.compile(r"^[\w.]+: (\([\w.]+\) )?")


def _said(line: str) -> str:
    """What a cause's line says, without its type and SQLAlchemy's ``(driver.Error)``."""
    return _WRAPPER.sub("", line, count=1)


def print_error(exc: BaseException, to: str | None = None, *, as_json: bool | None = None) -> None:
    """Print ``exc`` and the causes that add to it to stderr, one line each, never a
    traceback (a login PostgreSQL refuses is one line, not one per wrapper).

    ``as_json`` (by default, whether the logs are JSON lines: :func:`eop.log.renders_json`):
    one JSON object instead, a ``command.failed`` line at level error with the
    ``error`` and the ``caused_by`` texts, so that a log pipeline reading JSON
    gets the command's last words as a line like the others.

    ``to``: write them to that file instead, for ``eop worker --processes N``
    to print once however many of its processes met the same error
    (:func:`eop.runtime.supervisor.supervise`); stderr when it cannot be written.
    """
    # An app's import error or a bad URL may quote a password: masked like a log line's.
    said = [redaction.redact_text(str(exc))]
    cause = exc.__cause__
    while cause is not None:
        # A database error's text may quote bound values: described, not printed.
        text = log.describe_error(cause).strip()
        first = text.splitlines()[0] if text else type(cause).__name__
        # A cause whose words a line above already says (a driver's error, wrapped
        # by SQLAlchemy, wrapped by eop's) would only repeat them.
        if _said(first) not in "\n".join(said):
            said.append(first[:288])
        cause = cause.__cause__
    if as_json if as_json is not None else (log.renders_json() or json_asked()):
        entry: dict[str, object] = {"error": said[0]}
        if len(said) > 1:
            entry["caused_by"] = said[1:]
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        entry.update(
            event=log.Event.COMMAND_FAILED.value,
            level="error",
            pid=os.getpid(),
            timestamp=now.replace("+00:00", "Z"),
        )
        report = json.dumps(entry) + "\n"
    else:
        lines = [f"eop: error: {said[0]}", *(f"  caused by {c}" for c in said[1:])]
        report = "".join(f"{line}\n" for line in lines)
    if to is not None:
        try:
            Path(to).write_text(report)
            return
        except OSError:
            pass
    sys.stderr.write(report)
