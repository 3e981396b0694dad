"""``eop dlq ...``, ``eop status`` and ``eop streams`` (:mod:`eop.ops.dlq`,
:mod:`eop.ops.status`, :mod:`eop.ops.streams`)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
from collections.abc import Sequence
from typing import Any

from eop import errors
from eop.app import App
from eop.cli import options


def add_dlq(sub: options.Subparsers) -> None:
    """Add ``dlq`` and its actions to the subparsers of ``eop``."""
    dlq = sub.add_parser("dlq", help="list, show, replay and purge dead letters")
    dlq_sub = dlq.add_subparsers(title="actions", required=True, metavar="ACTION")

    listing = dlq_sub.add_parser("list", help="dead letters as a table (newest first)")
    _add_dlq_filters(listing, before=False)
    listing.add_argument(
        "--limit", type=int, default=100, help="at most this many (default 100; 0: all)"
    )
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
    options.add_setting(replay, "nats_url")
    replay.set_defaults(command=_cmd_dlq_replay)

    purge = dlq_sub.add_parser("purge", help="delete dead letters (their inbox rows stay)")
    _add_dlq_filters(purge, before=True)
    purge.add_argument("--all", action="store_true", help="every dead letter (no filter needed)")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    purge.set_defaults(command=_cmd_dlq_purge)

    for p in (listing, show, replay, purge):
        options.add_log_options(p, suppress=True)
        options.add_db_options(p)


def add_status(sub: options.Subparsers) -> None:
    """Add ``status`` to the subparsers of ``eop``."""
    status = sub.add_parser(
        "status",
        help="per handler: lag, ack-pending window, redeliveries, inbox, dead letters; "
        "replicas and leaders of its stream and consumer; an ordered handler's partitions, "
        "their owners and lag, its members and last rebalance",
    )
    options.add_app_arguments(
        status,
        app_help="the eop.App, e.g. myapp:app",
        handler_help="only this handler (repeatable; default: all) [env: EOP_HANDLERS, comma "
        "separated]",
    )
    status.add_argument("--json", action="store_true", help="one JSON array, for scripts")
    options.add_settings(status, options.SERVER_FIELDS)
    status.set_defaults(command=_cmd_status)


def add_streams(sub: options.Subparsers) -> None:
    """Add ``streams`` and its action to the subparsers of ``eop``."""
    streams = sub.add_parser(
        "streams", help="create the app's streams before any worker runs, as a worker would"
    )
    streams_sub = streams.add_subparsers(title="actions", required=True, metavar="ACTION")
    create = streams_sub.add_parser(
        "create",
        help="create the declared streams and the handlers' that are missing (epoch id, "
        "partition transforms); check those that exist; list them",
    )
    options.add_log_options(create, suppress=True)
    create.add_argument(
        "app",
        metavar="MODULE:APP",
        nargs="?",
        default=os.environ.get("EOP_APP"),
        help="the eop.App, e.g. myapp:app [env: EOP_APP; under Django, the project's]",
    )
    options.add_setting(create, "nats_url")
    create.set_defaults(command=_cmd_streams_create)


def _cmd_streams_create(args: argparse.Namespace) -> int:
    from eop.ops import streams

    if not args.app:
        raise errors.UsageError("name the app: eop streams create MODULE:APP (or EOP_APP)")
    app = options.configured_app(args, ("nats_url",))
    print(streams.format_table(options.run_with(app, streams.create(app))))
    return 0


def _add_dlq_filters(parser: argparse.ArgumentParser, *, before: bool) -> None:
    parser.add_argument("--handler", metavar="NAME", help="only this handler's dead letters")
    parser.add_argument(
        "--reason", metavar="TEXT", help="reason or error contains TEXT (case-insensitive)"
    )
    parser.add_argument(
        "--since", type=_when, metavar="WHEN", help="created at or after WHEN (ISO or 2h)"
    )
    parser.add_argument(
        "--before" if before else "--until",
        dest="until",
        type=_when,
        metavar="WHEN",
        help="created before WHEN (ISO time, UTC if no offset, or a duration ago like 7d)",
    )


def _when(text: str) -> datetime.datetime:
    """A ``WHEN`` flag's time; a refused one is a usage error, as a malformed flag is."""
    from eop.ops import dlq

    try:
        return dlq.parse_when(text)
    except errors.ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _dlq_app(args: argparse.Namespace, names: Sequence[str]) -> App:
    """The app of a dlq command; with --app, a --handler it does not have is refused (an
    empty listing or "purged 0" would read as nothing to do)."""
    app = options.db_app(args, names)
    handler = getattr(args, "handler", None)
    if getattr(args, "app", None) and handler and handler not in app.handlers:
        known = ", ".join(sorted(app.handlers)) or "none"
        raise errors.ConfigurationError(
            f"the app has no handler {handler!r} (it has: {known}); for the dead letters "
            "of a handler it no longer has, leave --app out"
        )
    return app


def _dlq_filters(args: argparse.Namespace, ids: Sequence[int] = ()) -> Any:
    from eop.ops import dlq

    limit = getattr(args, "limit", None)
    return dlq.Filters(
        ids=tuple(ids),
        handler=args.handler,
        reason=args.reason,
        since=args.since,
        until=args.until,
        limit=limit if limit and limit > 0 else None,
    )


def _cmd_dlq_list(args: argparse.Namespace) -> int:
    import json

    from eop.ops import dlq

    app = _dlq_app(args, options.DB_FIELDS)
    filters = _dlq_filters(args)
    store = dlq.DeadLetters(app)

    async def read() -> tuple[list[dict[str, Any]], int]:
        return await store.rows(filters), await store.count(filters)

    rows, total = options.run_with(app, read(), schema_ready=True)
    if args.json:
        print(json.dumps([dlq.to_json(r) for r in rows], indent=2))
    else:
        print(dlq.format_table(rows))
    if total > len(rows):
        # On stderr in both forms: the JSON on stdout stays a plain list for scripts,
        # and a script counting it is told it holds only part of them.
        print(
            f"({len(rows)} of {total} shown; --limit N shows more, --limit 0 all)",
            file=sys.stderr,
        )
    return 0


def _cmd_dlq_show(args: argparse.Namespace) -> int:
    import json

    from eop.ops import dlq

    app = options.db_app(args, options.DB_FIELDS)
    store = dlq.DeadLetters(app)
    if args.payload:
        payload = options.run_with(app, store.payload(args.id), schema_ready=True)
        sys.stdout.buffer.write(payload)
        sys.stdout.flush()
        return 0
    row = options.run_with(app, store.get(args.id), schema_ready=True)
    print(json.dumps(dlq.to_json(row), indent=2) if args.json else dlq.format_details(row))
    return 0


def _cmd_dlq_replay(args: argparse.Namespace) -> int:
    import json

    from eop.broker import jetstream
    from eop.ops import dlq

    if bool(args.ids) == bool(args.all):
        raise errors.UsageError("name the dead letters to replay (IDs) or pass --all")
    if args.rerun and not args.app:
        raise errors.UsageError("--rerun runs the handler: pass --app MODULE:APP")
    if args.ids and (args.handler or args.reason or args.since or args.until):
        raise errors.UsageError("filters apply to --all only, not to listed IDs")
    app = _dlq_app(args, (*options.DB_FIELDS, "nats_url"))
    mode: dlq.ReplayMode = "rerun" if args.rerun else "publish"

    def shown(result: dlq.ReplayResult) -> None:
        # As each one is done: a replay cut short (killed, an outage) has said what it did.
        print(result.describe(), flush=True)

    on_result = None if args.json else shown

    async def replay() -> list[dlq.ReplayResult]:
        ids = list(args.ids) or await dlq.DeadLetters(app).ids(_dlq_filters(args))
        if mode == "rerun":
            return await dlq.Replayer(app).replay_many(
                ids, mode=mode, again=args.again, on_result=on_result
            )
        nc = await jetstream.connect(app.settings, name="eop-dlq-replay")
        try:
            replayer = dlq.Replayer(app, nc.jetstream(), allow_fanout=args.allow_fanout)
            return await replayer.replay_many(ids, mode=mode, again=args.again, on_result=on_result)
        finally:
            await nc.close()

    results = options.run_with(app, replay(), schema_ready=True)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    elif not results:
        print("no dead letters match")
    return 1 if any(r.status == "failed" for r in results) else 0


def _cmd_dlq_purge(args: argparse.Namespace) -> int:
    from eop.ops import dlq, tables

    filters = _dlq_filters(args)
    if filters.empty and not args.all:
        raise errors.UsageError(
            "purge needs a filter (--handler, --reason, --since, --before) or --all"
        )
    app = _dlq_app(args, options.DB_FIELDS)
    store = dlq.DeadLetters(app)
    if not args.yes:
        count = options.run_with(app, store.count(filters), schema_ready=True)
        if count == 0:
            print("purged 0 dead letters")
            return 0
        if not sys.stdin.isatty():
            raise errors.ConfigurationError(
                f"{tables.counted(count, 'dead letter')} match: pass --yes to delete them "
                "without a prompt"
            )
        answer = input(f"Delete {tables.counted(count, 'dead letter')}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
        app = options.db_app(args, options.DB_FIELDS)
    deleted = options.run_with(app, dlq.DeadLetters(app).purge(filters), schema_ready=True)
    print(f"purged {tables.counted(deleted, 'dead letter')}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from eop.ops import status
    from eop.outbox import operations as outbox

    app = options.configured_app(args, options.SERVER_FIELDS)
    handlers = args.handler or options.env_list("EOP_HANDLERS")

    async def collect() -> tuple[list[status.HandlerStatus], outbox.Backlog]:
        statuses = await status.collect(app, handlers)
        return statuses, await outbox.Outbox(app).backlog()

    statuses, backlog = options.run_with(app, collect())
    if args.json:
        # The handlers' array, as before; `eop outbox status --json` has the outbox.
        print(json.dumps([s.to_json() for s in statuses], indent=2))
    else:
        print(status.format_table(statuses))
        print(backlog.describe())
    problems = status.problem_summary(statuses)
    if problems:
        raise errors.StatusProblem(problems)
    return 0
