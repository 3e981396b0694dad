"""``eop audit``: prove exactly-once on the user's data (:mod:`eop.ops.audit`)."""

from __future__ import annotations

import argparse
import asyncio

from eop import errors
from eop.cli import options


def add_audit(sub: options.Subparsers) -> None:
    """Add ``audit`` to the subparsers of ``eop``."""
    audit = sub.add_parser(
        "audit",
        help="prove exactly-once on your data: walk the stream against the inbox "
        "(exit 0 no anomaly, even with messages still in flight or never delivered, "
        "which the result names; 1 anomalies; 2 errors)",
    )
    options.add_app_arguments(
        audit,
        app_help="the eop.App to audit, e.g. myapp:app",
        handler_help="audit only this handler (repeatable; default: all) [env: EOP_HANDLERS, "
        "comma separated]",
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
        help="a delivery unacknowledged this long is stuck (default: stuck_after_ack_waits, 3, "
        "AckWaits of its consumer)",
    )
    audit.add_argument(
        "--current-epoch-only",
        action="store_true",
        help="ignore outcomes of earlier incarnations of the stream (after a deliberate "
        "recreation)",
    )
    audit.add_argument("--json", action="store_true", help="print the report as JSON")
    options.add_settings(audit, options.SERVER_FIELDS)
    audit.set_defaults(command=_cmd_audit)


def _cmd_audit(args: argparse.Namespace) -> int:
    from eop.ops import audit

    # Exit status 1 means anomalies found, so errors take 2 here, not main()'s 1.
    try:
        for flag in ("from_seq", "to_seq", "limit", "batch"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise errors.ConfigurationError(f"--{flag.replace('_', '-')} must be at least 1")
        if args.from_seq is not None and args.to_seq is not None and args.to_seq < args.from_seq:
            # An empty range would check nothing and read "clean".
            raise errors.ConfigurationError(
                f"--to-seq {args.to_seq} is below --from-seq {args.from_seq}: nothing to walk"
            )
        if args.stuck_after_s is not None and args.stuck_after_s <= 0:
            raise errors.ConfigurationError("--stuck-after-s must be above 0")
        app = options.configured_app(args, options.SERVER_FIELDS)
        audit_options = audit.Options(
            from_seq=args.from_seq,
            to_seq=args.to_seq,
            limit=args.limit,
            batch=args.batch,
            stuck_after_s=args.stuck_after_s,
            current_epoch_only=args.current_epoch_only,
        )
        # audit.run closes the app's pools itself.
        handlers = args.handler or options.env_list("EOP_HANDLERS")
        report = asyncio.run(audit.run(app, handlers, audit_options))
    except errors.EopError as exc:
        options.print_error(exc)
        return 2
    print(report.as_json() if args.json else audit.render(report))
    # In flight and never delivered are not anomalies: 0, and the result says
    # "clean so far" with their counts (and the JSON "settled": false).
    return 0 if report.clean else 1
