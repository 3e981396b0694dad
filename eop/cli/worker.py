"""``eop worker``, ``eop db ...`` and ``eop demo``: running handlers and what they need."""

from __future__ import annotations

import argparse
import contextlib

from eop.cli import options

#: The settings offered as ``eop worker`` flags: all but the secrets.
WORKER_FIELDS = (
    "database_url",
    "nats_url",
    "schema",
    "processes",
    "concurrency",
    "db_pool_size",
    "db_pooler",
    "db_connect_timeout_s",
    "batch",
    "batch_transactions",
    "fetch_timeout_s",
    "ack_wait_s",
    "max_ack_pending",
    "max_attempts",
    "max_deliveries",
    "backoff_base_s",
    "backoff_max_s",
    "retry_poll_s",
    "ack_timeout_s",
    "ack_give_up_s",
    "lock_timeout_s",
    "statement_timeout_s",
    "tx_retries",
    "lease_margin_s",
    "partition_lease_s",
    "stuck_after_ack_waits",
    "compaction_interval_s",
    "compaction_after_messages",
    "msg_id_retention_s",
    "epoch_sweep_after_s",
    "shutdown_grace_s",
    "create",
    *options.NATS_AUTH_FIELDS,
    "metrics_port",
    "metrics_host",
    "tracing",
    "startup_attempts",
    "nats_auth_refusals",
    "uvloop",
    "relay",
    *options.PUBLISHING_FIELDS,
    "outbox_max_payload",
)


def add_worker(sub: options.Subparsers) -> None:
    """Add ``worker`` to the subparsers of ``eop``."""
    worker = sub.add_parser(
        "worker",
        help="run handlers: pull, process exactly once, ack",
        # No abbreviated flags: --processes N passes the arguments on to its
        # children, replacing --processes, --handler and --metrics-port by name.
        allow_abbrev=False,
    )
    options.add_app_arguments(
        worker,
        app_help="the eop.App to run, e.g. myapp:app",
        handler_help="run only this handler (repeatable; default: all) "
        "[env: EOP_HANDLERS, comma separated]",
    )
    options.add_settings(worker, WORKER_FIELDS)
    # Set by `eop worker --processes N` for its processes (eop.runtime.gathered).
    worker.add_argument("--metrics-dir", help=argparse.SUPPRESS)
    # Set by `eop worker --processes N`: where a process writes its `eop: error:` lines,
    # which the supervisor prints once however many processes met the same error.
    worker.add_argument("--error-file", help=argparse.SUPPRESS)
    worker.set_defaults(command=_cmd_worker)


def add_db(sub: options.Subparsers) -> None:
    """Add ``db`` and its actions to the subparsers of ``eop``."""
    db = sub.add_parser("db", help="manage eop's tables (Alembic migrations)")
    db_sub = db.add_subparsers(title="actions", required=True, metavar="ACTION")
    for action, help_text in (
        ("upgrade", "migrate eop's tables up to REVISION (default: head)"),
        ("downgrade", "migrate eop's tables down to REVISION (default: -1; 'base' drops them)"),
        ("current", "print the current revision of eop's tables"),
        ("check", "exit non-zero unless eop's tables are at head and match the models"),
    ):
        p = db_sub.add_parser(action, help=help_text)
        options.add_log_options(p, suppress=True)
        if action in ("upgrade", "downgrade"):
            p.add_argument("revision", nargs="?", default="head" if action == "upgrade" else "-1")
        options.add_db_options(p)
        p.set_defaults(command=_cmd_db, action=action)


def add_demo(sub: options.Subparsers) -> None:
    """Add ``demo`` to the subparsers of ``eop``."""
    demo = sub.add_parser(
        "demo",
        help="run the demo on embedded servers: duplicates and crashes, every message once",
    )
    options.add_log_options(demo, suppress=True)
    for flag, default, help_text in (
        ("messages", 200, "logical messages"),
        ("workers", 2, "worker processes"),
        ("seed", None, "seed of the crash schedule (default: random)"),
    ):
        var = f"EOP_DEMO_{flag.upper()}"
        demo.add_argument(
            f"--{flag}",
            type=int,
            default=options.env_int(var, default),
            help=f"{help_text} [env: {var}; default: {default}]",
        )
    demo.set_defaults(command=_cmd_demo)


def _cmd_worker(args: argparse.Namespace) -> int:
    from eop import faults
    from eop.app import select_handlers
    from eop.runtime import eventloop, gathered, shutdown, supervisor, worker

    # Never armed from the environment here: only the chaos harness's own entry
    # point arms fault points (eop.faults). A stray EOP_FAULTS gets a warning.
    faults.warn_if_ignored()
    app = options.configured_app(args, WORKER_FIELDS)
    # Flags replace the environment's list rather than adding to it.
    handlers = args.handler or options.env_list("EOP_HANDLERS")
    count = supervisor.process_count(app.settings.processes)
    if count > 1:
        specs = select_handlers(app, handlers)
        children = supervisor.plan(
            count,
            [(s.name, s.order_by is not None) for s in specs],
            app.settings.db_connections(count),
        )
        if len(children) > 1:
            s = app.settings
            with contextlib.ExitStack() as stack:
                served = None
                if s.metrics_port:
                    served = stack.enter_context(gathered.Gathered(s.metrics_host, s.metrics_port))
                directory = served.directory if served is not None else None
                return supervisor.supervise(
                    [supervisor.child_argv(args.argv, c, directory) for c in children],
                    # The children's own deadline, then a margin for them to be reaped.
                    stop_deadline_s=shutdown.deadline_s(s) + shutdown.STOP_MARGIN_S,
                    served=served,
                    program=args.program,
                )
    # exit_hard: a stop always ends the process, even with a handler's thread stuck.
    return eventloop.run(
        worker.run_worker(app, handlers=handlers, exit_hard=True, report_to=args.metrics_dir),
        use_uvloop=app.settings.uvloop,
    )


def _cmd_db(args: argparse.Namespace) -> int:
    from eop.pg import migrate

    settings = options.db_app(args, options.DB_FIELDS).settings
    url, schema = settings.database_url, settings.schema
    pooler = settings.db_pooler
    if args.action == "upgrade":
        migrate.upgrade(url, schema=schema, revision=args.revision, pooler=pooler)
        found = migrate.current(url, schema=schema, pooler=pooler)
        print(f"eop tables at {found} in schema {schema!r}")
    elif args.action == "downgrade":
        migrate.downgrade(url, schema=schema, revision=args.revision, pooler=pooler)
        found = migrate.current(url, schema=schema, pooler=pooler)
        print(f"eop tables at {found or 'base'} in schema {schema!r}")
    elif args.action == "current":
        at = migrate.recorded(url, schema=schema, pooler=pooler)
        where = f" (recorded by your own Alembic in {at.host_table})" if at.host_table else ""
        print(f"{at.heads}{where}" if at.heads else "base (not migrated)")
    else:
        migrate.check(url, schema=schema, pooler=pooler)
        print("eop tables are up to date")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from eop.tools import demo

    return demo.run(messages=args.messages, workers=args.workers, seed=args.seed)
