"""The ``eop`` command line: ``eop worker``, ``eop db ...``, ``eop dlq ...``, ``eop status``, ...

Every flag can also be set by the ``EOP_*`` variable that ``--help`` shows.
Errors print their cause chain, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, get_type_hints

from eop import errors, log
from eop import settings as settings_mod
from eop.app import App

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
    *NATS_AUTH_FIELDS,
    "metrics_port",
    "metrics_host",
    "tracing",
    "startup_attempts",
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

    _add_ops_commands(sub)
    _add_audit(sub)

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
    app = import_attribute(path, "MODULE:APP, e.g. myapp:app")
    if not isinstance(app, App):
        raise errors.ConfigurationError(f"{path!r} is not an eop.App (got {type(app).__name__})")
    return app


def import_attribute(path: str, form: str) -> object:
    """Import ``module:attribute`` and return the attribute (``None`` when it is missing).

    ``form`` names what the user should have written, for the error message.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise errors.ConfigurationError(f"expected {form}, not {path!r}")
    # Like uvicorn: the current directory is importable, as users expect.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise errors.ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    return getattr(module, attr, None)


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


def _add_audit(sub: Any) -> None:
    audit = sub.add_parser(
        "audit",
        help="prove exactly-once on your data: walk the stream against the inbox "
        "(exit 0 clean, 1 anomalies, 2 errors)",
    )
    _add_log_options(audit, suppress=True)
    audit.add_argument("app", metavar="MODULE:APP", help="the eop.App to audit, e.g. myapp:app")
    audit.add_argument(
        "--handler",
        action="append",
        default=[],
        metavar="NAME",
        help="audit only this handler (repeatable; default: all)",
    )
    for flag, help_text in (
        ("from-seq", "first stream sequence to walk (default: the stream's first)"),
        ("to-seq", "last stream sequence to walk (default: the stream's last)"),
        ("limit", "check at most this many messages per handler, then stop"),
    ):
        audit.add_argument(f"--{flag}", type=int, metavar="N", help=help_text)
    audit.add_argument(
        "--batch", type=int, default=500, metavar="N", help="messages per fetch (default: 500)"
    )
    audit.add_argument(
        "--stuck-after-s",
        type=float,
        metavar="S",
        help="a delivery unacknowledged this long is stuck (default: 3 AckWaits)",
    )
    audit.add_argument(
        "--current-epoch-only",
        action="store_true",
        help="ignore outcomes of earlier incarnations of the stream (after a deliberate "
        "recreation)",
    )
    audit.add_argument("--json", action="store_true", help="print the report as JSON")
    for name in ("database_url", "nats_url", "schema"):
        _add_setting(audit, name)
    audit.set_defaults(command=_cmd_audit)


def _cmd_audit(args: argparse.Namespace) -> int:
    from eop import audit

    try:
        for flag in ("from_seq", "to_seq", "limit", "batch"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise errors.ConfigurationError(f"--{flag.replace('_', '-')} must be at least 1")
        app = load_app(args.app).with_settings(
            **_overrides(args, ("database_url", "nats_url", "schema"))
        )
        options = audit.Options(
            from_seq=args.from_seq,
            to_seq=args.to_seq,
            limit=args.limit,
            batch=args.batch,
            stuck_after_s=args.stuck_after_s,
            current_epoch_only=args.current_epoch_only,
        )
        report = asyncio.run(audit.run(app, args.handler, options))
    except errors.EopError as exc:
        _print_error(exc)
        return 2
    print(report.as_json() if args.json else audit.render(report))
    return 0 if report.clean else 1


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


# --- Operations: `eop dlq ...` (eop.dlq) and `eop status` (eop.status) ------


def _add_ops_commands(sub: Any) -> None:
    dlq = sub.add_parser("dlq", help="list, show, replay and purge dead letters")
    dlq_sub = dlq.add_subparsers(title="actions", required=True, metavar="ACTION")

    listing = dlq_sub.add_parser("list", help="dead letters as a table (newest first)")
    _add_dlq_filters(listing, before=False)
    listing.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    listing.add_argument("--json", action="store_true", help="one JSON array, for scripts")
    listing.set_defaults(command=_cmd_dlq_list)

    show = dlq_sub.add_parser("show", help="everything about one dead letter")
    show.add_argument("id", type=int, metavar="ID")
    show.add_argument(
        "--payload", action="store_true", help="write the raw payload (only it) to stdout"
    )
    show.add_argument("--json", action="store_true", help="as JSON (without the payload)")
    show.set_defaults(command=_cmd_dlq_show)

    replay = dlq_sub.add_parser(
        "replay",
        help="publish dead letters again with a fresh Nats-Msg-Id, or --rerun their handler; "
        "safe to repeat",
    )
    replay.add_argument("ids", type=int, nargs="*", metavar="ID")
    replay.add_argument("--all", action="store_true", help="every dead letter the filters match")
    _add_dlq_filters(replay, before=False)
    replay.add_argument("--limit", type=int, default=None, help="with --all: at most this many")
    replay.add_argument(
        "--rerun",
        action="store_true",
        help="run the handler here, in one transaction with the bookkeeping (needs --app)",
    )
    replay.add_argument(
        "--again",
        action="store_true",
        help="replay dead letters replayed before once more (a second effect)",
    )
    replay.add_argument(
        "--allow-fanout",
        action="store_true",
        help="publish even if other durable consumers of the subject would get the message",
    )
    replay.add_argument("--json", action="store_true", help="results as JSON")
    _add_setting(replay, "nats_url")
    replay.set_defaults(command=_cmd_dlq_replay)

    purge = dlq_sub.add_parser("purge", help="delete dead letters (their inbox rows stay)")
    _add_dlq_filters(purge, before=True)
    purge.add_argument("--all", action="store_true", help="every dead letter (no filter needed)")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    purge.set_defaults(command=_cmd_dlq_purge)

    for p in (listing, show, replay, purge):
        _add_log_options(p, suppress=True)
        _add_db_options(p)

    status = sub.add_parser(
        "status", help="per handler: lag, ack-pending window, redeliveries, inbox, dead letters"
    )
    _add_log_options(status, suppress=True)
    status.add_argument("app", metavar="MODULE:APP", help="the eop.App, e.g. myapp:app")
    status.add_argument(
        "--handler", action="append", default=[], metavar="NAME", help="only this handler"
    )
    status.add_argument("--json", action="store_true", help="one JSON array, for scripts")
    for name in ("database_url", "nats_url", "schema"):
        _add_setting(status, name)
    status.set_defaults(command=_cmd_status)


def _add_dlq_filters(parser: argparse.ArgumentParser, *, before: bool) -> None:
    parser.add_argument("--handler", metavar="NAME", help="only this handler's dead letters")
    parser.add_argument(
        "--reason", metavar="TEXT", help="reason or error contains TEXT (case-insensitive)"
    )
    parser.add_argument("--since", metavar="WHEN", help="created at or after WHEN (ISO or 2h)")
    parser.add_argument(
        "--before" if before else "--until",
        dest="until",
        metavar="WHEN",
        help="created before WHEN (ISO time, UTC if no offset, or a duration ago like 7d)",
    )


def _dlq_filters(args: argparse.Namespace, ids: Sequence[int] = ()) -> Any:
    from eop import dlq

    limit = getattr(args, "limit", None)
    return dlq.Filters(
        ids=tuple(ids),
        handler=args.handler,
        reason=args.reason,
        since=dlq.parse_when(args.since) if args.since else None,
        until=dlq.parse_when(args.until) if args.until else None,
        limit=limit if limit and limit > 0 else None,
    )


def _ops_app(args: argparse.Namespace, names: Sequence[str]) -> App:
    """The app named by --app (or EOP_APP) with flags applied, else one built from settings."""
    path = getattr(args, "app", None)
    if path:
        return load_app(path).with_settings(**_overrides(args, names))
    return App(settings=settings_mod.Settings.from_env(overrides=_overrides(args, names)))


def _run_with(app: App, coro: Any) -> Any:
    async def run() -> Any:
        try:
            return await coro
        finally:
            await app.dispose()

    return asyncio.run(run())


_DLQ_DB = ("database_url", "schema")


def _cmd_dlq_list(args: argparse.Namespace) -> int:
    import json

    from eop import dlq

    app = _ops_app(args, _DLQ_DB)
    filters = _dlq_filters(args)
    store = dlq.DeadLetters(app)

    async def read() -> tuple[list[dict[str, Any]], int]:
        return await store.rows(filters), await store.count(filters)

    rows, total = _run_with(app, read())
    if args.json:
        print(json.dumps([dlq.to_json(r) for r in rows], indent=2))
        return 0
    print(dlq.format_table(rows))
    if total > len(rows):
        print(f"({len(rows)} of {total} shown; --limit N shows more)", file=sys.stderr)
    return 0


def _cmd_dlq_show(args: argparse.Namespace) -> int:
    import json

    from eop import dlq

    app = _ops_app(args, _DLQ_DB)
    store = dlq.DeadLetters(app)
    if args.payload:
        payload = _run_with(app, store.payload(args.id))
        sys.stdout.buffer.write(payload)
        sys.stdout.flush()
        return 0
    row = _run_with(app, store.get(args.id))
    print(json.dumps(dlq.to_json(row), indent=2) if args.json else dlq.format_details(row))
    return 0


def _cmd_dlq_replay(args: argparse.Namespace) -> int:
    import json

    from eop import dlq, jetstream

    if bool(args.ids) == bool(args.all):
        raise errors.ConfigurationError("name the dead letters to replay (IDs) or pass --all")
    if args.rerun and not args.app:
        raise errors.ConfigurationError("--rerun runs the handler: pass --app MODULE:APP")
    if args.ids and (args.handler or args.reason or args.since or args.until):
        raise errors.ConfigurationError("filters apply to --all only, not to listed IDs")
    app = _ops_app(args, (*_DLQ_DB, "nats_url"))
    mode: dlq.ReplayMode = "rerun" if args.rerun else "publish"

    async def replay() -> list[dlq.ReplayResult]:
        ids = list(args.ids) or await dlq.DeadLetters(app).ids(_dlq_filters(args))
        if mode == "rerun":
            return await dlq.Replayer(app).replay_many(ids, mode=mode, again=args.again)
        nc = await jetstream.connect(app.settings, name="eop-dlq-replay")
        try:
            replayer = dlq.Replayer(app, nc.jetstream(), allow_fanout=args.allow_fanout)
            return await replayer.replay_many(ids, mode=mode, again=args.again)
        finally:
            await nc.close()

    results = _run_with(app, replay())
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    else:
        for result in results:
            print(result.describe())
        if not results:
            print("no dead letters match")
    return 1 if any(r.status == "failed" for r in results) else 0


def _cmd_dlq_purge(args: argparse.Namespace) -> int:
    from eop import dlq

    filters = _dlq_filters(args)
    if filters.empty and not args.all:
        raise errors.ConfigurationError(
            "purge needs a filter (--handler, --reason, --since, --before) or --all"
        )
    app = _ops_app(args, _DLQ_DB)
    store = dlq.DeadLetters(app)
    if not args.yes:
        count = _run_with(app, store.count(filters))
        if count == 0:
            print("purged 0 dead letters")
            return 0
        if not sys.stdin.isatty():
            raise errors.ConfigurationError(
                f"{count} dead letters match: pass --yes to delete them without a prompt"
            )
        answer = input(f"Delete {count} dead letters? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
        app = _ops_app(args, _DLQ_DB)
    deleted = _run_with(app, dlq.DeadLetters(app).purge(filters))
    print(f"purged {deleted} dead letters")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from eop import status

    app = load_app(args.app).with_settings(
        **_overrides(args, ("database_url", "nats_url", "schema"))
    )
    handlers = args.handler or _env_list("EOP_HANDLERS")
    statuses = _run_with(app, status.collect(app, handlers))
    if args.json:
        print(json.dumps([s.to_json() for s in statuses], indent=2))
    else:
        print(status.format_table(statuses))
    problems = [f"{s.handler}: {p}" for s in statuses for p in s.problems]
    if problems:
        raise errors.StatusProblem("; ".join(problems))
    return 0
