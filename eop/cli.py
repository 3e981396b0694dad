"""The ``eop`` command line: ``eop worker``, ``eop db ...``, ``eop demo``.

Every flag can also be set by the ``EOP_*`` variable that ``--help`` shows.
Errors print their cause chain, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, get_type_hints

from eop import errors, log
from eop import settings as settings_mod
from eop.app import App

_WORKER_FIELDS = (
    "database_url",
    "nats_url",
    "schema",
    "concurrency",
    "batch",
    "batch_transactions",
    "fetch_timeout_s",
    "ack_wait_s",
    "max_ack_pending",
    "max_attempts",
    "backoff_base_s",
    "backoff_max_s",
    "ack_timeout_s",
    "ack_give_up_s",
    "lock_timeout_s",
    "statement_timeout_s",
    "tx_retries",
    "lease_margin_s",
    "compaction_interval_s",
    "compaction_after_messages",
    "msg_id_retention_s",
    "shutdown_grace_s",
    "create",
    "uvloop",
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``eop`` command; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_mod.Settings.from_env(
            overrides={"log_format": args.log_format, "log_level": args.log_level}
        )
        log.configure(settings.log_format, settings.log_level)
        command: Callable[[argparse.Namespace], int] = args.command
        return command(args)
    except errors.EopError as exc:
        _print_error(exc)
        return 1
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``eop`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="eop",
        description="Exactly-once processing of NATS JetStream messages into PostgreSQL.",
    )
    _add_log_options(parser)
    sub = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    worker = sub.add_parser("worker", help="run handlers: pull, process exactly once, ack")
    _add_log_options(worker, suppress=True)
    worker.add_argument("app", metavar="MODULE:APP", help="the eop.App to run, e.g. myapp:app")
    worker.add_argument(
        "--handler",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this handler (repeatable; default: all) "
        "[env: EOP_HANDLERS, comma separated]",
    )
    for name in _WORKER_FIELDS:
        _add_setting(worker, name)
    worker.set_defaults(command=_cmd_worker)

    db = sub.add_parser("db", help="manage eop's tables (Alembic migrations)")
    db_sub = db.add_subparsers(title="actions", required=True, metavar="ACTION")
    for action, help_text in (
        ("upgrade", "migrate eop's tables up to REVISION (default: head)"),
        ("downgrade", "migrate eop's tables down to REVISION (default: -1; 'base' drops them)"),
        ("current", "print the current revision of eop's tables"),
        ("check", "exit non-zero unless eop's tables are at head and match the models"),
    ):
        p = db_sub.add_parser(action, help=help_text)
        _add_log_options(p, suppress=True)
        if action in ("upgrade", "downgrade"):
            p.add_argument("revision", nargs="?", default="head" if action == "upgrade" else "-1")
        _add_db_options(p)
        p.set_defaults(command=_cmd_db, action=action)

    demo = sub.add_parser(
        "demo",
        help="run the demo on embedded servers: duplicates and crashes, every message once",
    )
    _add_log_options(demo, suppress=True)
    for flag, default, help_text in (
        ("messages", 200, "logical messages"),
        ("workers", 2, "worker processes"),
        ("seed", None, "seed of the crash schedule (default: random)"),
    ):
        var = f"EOP_DEMO_{flag.upper()}"
        demo.add_argument(
            f"--{flag}",
            type=int,
            default=_env_int(var, default),
            help=f"{help_text} [env: {var}; default: {default}]",
        )
    demo.set_defaults(command=_cmd_demo)

    from eop.spark import cli as spark_cli  # here: it uses this module's helpers

    spark_cli.add_commands(sub)

    from eop.chaos import cli as chaos_cli

    chaos_cli.add_command(sub)

    from eop import bench

    bench.add_command(sub)
    return parser


def _env_list(var: str) -> list[str]:
    return [item.strip() for item in os.environ.get(var, "").split(",") if item.strip()]


def _env_int(var: str, default: int | None) -> int | None:
    raw = os.environ.get(var)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"eop: error: {var}={raw!r} is not an integer") from None


def _add_log_options(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """Log flags, accepted before and after the subcommand.

    On subcommands their default is SUPPRESS, so they only override a value
    given before the subcommand when they are given themselves.
    """
    _add_setting(parser, "log_format", choices=["console", "json"], suppress=suppress)
    _add_setting(
        parser, "log_level", choices=["debug", "info", "warning", "error"], suppress=suppress
    )


def _add_db_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--app",
        metavar="MODULE:APP",
        default=os.environ.get("EOP_APP"),
        help="take the database URL and schema from this app [env: EOP_APP]",
    )
    _add_setting(parser, "database_url")
    _add_setting(parser, "schema")


def _add_setting(
    parser: argparse.ArgumentParser,
    name: str,
    choices: Sequence[str] | None = None,
    *,
    suppress: bool = False,
) -> None:
    """A flag for a Settings field; its help names the env var and the default."""
    field = {f.name: f for f in dataclasses.fields(settings_mod.Settings)}[name]
    hint = get_type_hints(settings_mod.Settings)[name]
    flag = "--" + name.replace("_", "-")
    help_text = (
        f"{field.metadata['help']} [env: {settings_mod.env_var(name)}; default: {field.default}]"
    )
    if hint is bool:
        parser.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
        return
    kind: Any = hint if hint in (int, float) else str
    parser.add_argument(
        flag,
        type=kind,
        default=argparse.SUPPRESS if suppress else None,
        choices=choices,
        metavar=name.upper(),
        help=help_text,
    )


def _overrides(args: argparse.Namespace, names: Sequence[str]) -> dict[str, object]:
    return {n: getattr(args, n, None) for n in names if getattr(args, n, None) is not None}


def load_app(path: str) -> App:
    """Import ``module:attribute`` and return the :class:`eop.App` it names."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise errors.ConfigurationError(f"expected MODULE:APP, e.g. myapp:app, not {path!r}")
    # Like uvicorn: the current directory is importable, as users expect.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise errors.ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    app = getattr(module, attr, None)
    if not isinstance(app, App):
        raise errors.ConfigurationError(f"{path!r} is not an eop.App (got {type(app).__name__})")
    return app


def _cmd_worker(args: argparse.Namespace) -> int:
    from eop import eventloop, faults, worker

    # Fault points stay disarmed unless a chaos run set EOP_FAULTS (eop.faults).
    faults.arm_from_env()
    app = load_app(args.app).with_settings(**_overrides(args, _WORKER_FIELDS))
    # Flags replace the environment's list rather than adding to it.
    handlers = args.handler or _env_list("EOP_HANDLERS")
    eventloop.run(worker.run_worker(app, handlers=handlers), use_uvloop=app.settings.uvloop)
    return 0


def _cmd_db(args: argparse.Namespace) -> int:
    from eop import migrate

    if args.app:
        base = load_app(args.app).settings
        settings = base.replace(**_overrides(args, ("database_url", "schema")))
    else:
        settings = settings_mod.Settings.from_env(
            overrides=_overrides(args, ("database_url", "schema"))
        )
    url, schema = settings.database_url, settings.schema
    if args.action == "upgrade":
        migrate.upgrade(url, schema=schema, revision=args.revision)
        print(f"eop tables at {migrate.current(url, schema=schema)} in schema {schema!r}")
    elif args.action == "downgrade":
        migrate.downgrade(url, schema=schema, revision=args.revision)
        print(f"eop tables at {migrate.current(url, schema=schema) or 'base'} in schema {schema!r}")
    elif args.action == "current":
        print(migrate.current(url, schema=schema) or "base (not migrated)")
    else:
        migrate.check(url, schema=schema)
        print("eop tables are up to date")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from eop import demo

    return demo.run(messages=args.messages, workers=args.workers, seed=args.seed)


def _print_error(exc: BaseException) -> None:
    print(f"eop: error: {exc}", file=sys.stderr)
    cause = exc.__cause__
    while cause is not None:
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        print(f"  caused by {type(cause).__name__}: {text}"[:300], file=sys.stderr)
        cause = cause.__cause__
