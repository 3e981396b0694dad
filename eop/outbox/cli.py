"""``eop relay`` and ``eop outbox ...``
(:mod:`eop.outbox.process`, :mod:`eop.outbox.operations`)."""

from __future__ import annotations

import argparse
import json
import sys

from eop import errors
from eop.cli import options

#: The settings offered as ``eop relay`` flags.
RELAY_FIELDS = (
    *options.SERVER_FIELDS,
    *options.PUBLISHING_FIELDS,
    *options.NATS_AUTH_FIELDS,
    "startup_attempts",
    "nats_auth_refusals",
    "create",
    "metrics_port",
    "metrics_host",
    "uvloop",
)


def add_relay(sub: options.Subparsers) -> None:
    """Add ``relay`` to the subparsers of ``eop``."""
    relay = sub.add_parser(
        "relay",
        help="publish the outbox (a relay of its own; `eop worker` runs one too)",
        allow_abbrev=False,
    )
    options.add_log_options(relay, suppress=True)
    options.add_app_option(relay, "take the settings from this app (its handlers are not run)")
    options.add_settings(relay, RELAY_FIELDS)
    relay.set_defaults(command=_cmd_relay)


def add_outbox(sub: options.Subparsers) -> None:
    """Add ``outbox`` and its actions to the subparsers of ``eop``."""
    outbox = sub.add_parser("outbox", help="the outbox's backlog; list, retry and purge its rows")
    actions = outbox.add_subparsers(title="actions", required=True, metavar="ACTION")

    status = actions.add_parser("status", help="pending and parked rows, lag, the relay")
    status.add_argument("--json", action="store_true", help="as JSON, for scripts")
    status.set_defaults(command=_cmd_status)

    listing = actions.add_parser("list", help="rows as a table, oldest first (default: parked)")
    _add_selection(listing, default_state="parked")
    listing.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    listing.add_argument("--json", action="store_true", help="one JSON array, for scripts")
    listing.set_defaults(command=_cmd_list)

    retry = actions.add_parser("retry", help="queue parked rows for the relay again")
    retry.add_argument("ids", type=int, nargs="*", metavar="ID", help="these parked rows")
    retry.add_argument("--all", action="store_true", help="every parked row (of --subject)")
    retry.add_argument("--subject", help="only rows to this subject")
    retry.set_defaults(command=_cmd_retry)

    purge = actions.add_parser("purge", help="delete parked rows (never sent)")
    purge.add_argument("ids", type=int, nargs="*", metavar="ID", help="these parked rows")
    purge.add_argument("--all", action="store_true", help="every parked row (of --subject)")
    purge.add_argument("--subject", help="only rows to this subject")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    purge.set_defaults(command=_cmd_purge)

    for p in (status, listing, retry, purge):
        options.add_log_options(p, suppress=True)
        options.add_db_options(p)


def _add_selection(parser: argparse.ArgumentParser, *, default_state: str) -> None:
    parser.add_argument("ids", type=int, nargs="*", metavar="ID", help="only these rows")
    parser.add_argument(
        "--state",
        choices=["parked", "pending", "published", "all"],
        default=default_state,
        help=f"which rows (default: {default_state})",
    )
    parser.add_argument("--subject", help="only rows to this subject")


def _cmd_relay(args: argparse.Namespace) -> int:
    from eop import faults
    from eop.outbox import process
    from eop.runtime import eventloop

    # As `eop worker`: never armed from the environment (eop.faults).
    faults.warn_if_ignored()
    app = options.db_app(args, RELAY_FIELDS)
    return eventloop.run(process.run_relay(app), use_uvloop=app.settings.uvloop)


def _cmd_status(args: argparse.Namespace) -> int:
    from eop.outbox import operations as outbox

    app = options.db_app(args, options.DB_FIELDS)
    backlog = options.run_with(app, outbox.Outbox(app).backlog(), schema_ready=True)
    print(json.dumps(backlog.to_json(), indent=2) if args.json else backlog.describe())
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from eop.outbox import operations as outbox

    app = options.db_app(args, options.DB_FIELDS)
    rows = options.run_with(
        app,
        outbox.Outbox(app).rows(args.state, ids=args.ids, subject=args.subject, limit=args.limit),
        schema_ready=True,
    )
    if args.json:
        print(json.dumps([outbox.to_json(r) for r in rows], indent=2))
    elif rows:
        print(outbox.format_table(rows))
    else:
        print(f"no {args.state if args.state != 'all' else ''} outbox rows".replace("  ", " "))
    return 0


def _check_selection(args: argparse.Namespace, action: str) -> None:
    if bool(args.ids) == bool(args.all):
        raise errors.UsageError(f"name the parked rows to {action} (IDs) or pass --all")


def _cmd_retry(args: argparse.Namespace) -> int:
    from eop.outbox import operations as outbox

    _check_selection(args, "retry")
    app = options.db_app(args, options.DB_FIELDS)
    ids = options.run_with(
        app, outbox.Outbox(app).retry(ids=args.ids, subject=args.subject), schema_ready=True
    )
    print(f"queued {outbox.count_text(len(ids), 'parked')} again")
    return _not_parked(args.ids, ids)


def _not_parked(asked: list[int], done: list[int]) -> int:
    """1 (and say which) when some of the IDs asked for were not parked rows."""
    missing = sorted(set(asked) - set(done))
    if not missing:
        return 0
    shown = ", ".join(str(i) for i in missing[:20]) + (" ..." if len(missing) > 20 else "")
    print(f"eop: error: not parked (published, pending or no such row): {shown}", file=sys.stderr)
    return 1


def _cmd_purge(args: argparse.Namespace) -> int:
    from eop.outbox import operations as outbox

    _check_selection(args, "purge")
    app = options.db_app(args, options.DB_FIELDS)
    if not args.yes:
        rows = options.run_with(
            app,
            outbox.Outbox(app).rows("parked", ids=args.ids, subject=args.subject, limit=1_000_000),
            schema_ready=True,
        )
        if not rows:
            print("purged 0 parked rows")
            return _not_parked(args.ids, [])
        if not sys.stdin.isatty():
            raise errors.ConfigurationError(
                f"{outbox.count_text(len(rows), 'parked')} match: pass --yes to delete them "
                "without a prompt"
            )
        question = f"Delete {outbox.count_text(len(rows), 'parked')}? [y/N] "
        if input(question).strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
        app = options.db_app(args, options.DB_FIELDS)
    ids = options.run_with(
        app,
        outbox.Outbox(app).purge("parked", ids=args.ids, subject=args.subject),
        schema_ready=True,
    )
    print(f"purged {outbox.count_text(len(ids), 'parked')}")
    return _not_parked(args.ids, ids)
