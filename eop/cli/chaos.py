"""``eop chaos``: the seeded chaos run from the command line.

Importing this module imports nothing heavy; the run does when it starts.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eop import errors
from eop.cli import options

if TYPE_CHECKING:
    from eop.tools.chaos.workers import BatchMode

# flag, type, default, help
_OPTIONS: tuple[tuple[str, type, Any, str], ...] = (
    ("messages", int, None, "logical messages (default: 3000, or 10 per second of --duration-s)"),
    ("workers", int, 3, "worker processes"),
    ("duration-s", float, 75.0, "length of the chaos phase (publishing and faults)"),
    ("seed", int, None, "seed of the fault schedule (default: random; printed)"),
    ("fault-gap-s", float, 0.3, "mean time between injected faults"),
    (
        "drain-deadline-s",
        float,
        None,
        "time allowed to drain after healing, else a liveness failure "
        "(default: 90 s, or a third of --duration-s if longer)",
    ),
    ("concurrency", int, 4, "messages in flight per worker"),
    ("batch-mode", str, "mixed", "batch transactions: mixed (odd worker slots), on or off"),
    (
        "scenario",
        str,
        "classic",
        "classic, mixed (classic plus the never-zero-times hunts), pipeline (two handlers "
        "chained through the outbox, relays killed), cluster (3 nats-servers, an R3 "
        "stream, its and its consumer's leaders killed), ordered (an order_by ledger: per-key "
        "order checked, workers scaled 1-3-2 and killed) or one hunt: "
        "sync-hot-rows, transfers, pg-outage, read-only, lock-timeouts, long-msg-id, "
        "bad-subject, poison-flood (see RELIABILITY.md)",
    ),
    ("log-dir", str, None, "keep the workers' logs here (default: a temp folder, kept on failure)"),
    ("json", str, None, "also write the report as JSON to this file"),
    (
        "app",
        str,
        None,
        "your app, MODULE:APP (default: the built-in bank, eop.tools.chaos.bank:app)",
    ),
    ("handler", str, None, "the handler of --app to run"),
    ("effects-sql", str, None, "query returning (key, effect count) per logical message"),
    ("payloads", str, None, "MODULE:FUNCTION (index, rng) -> eop.tools.chaos.Payload"),
    ("setup", str, None, "MODULE:FUNCTION (sync database URL) creating your tables"),
    ("invariant-sql", str, None, "query returning one row per violated invariant"),
)


def _env_var(flag: str) -> str:
    return "EOP_CHAOS_" + flag.upper().replace("-", "_")


HELP = "prove exactly-once under fire: seeded crashes, outages and lost replies"


def add_command(sub: options.Subparsers) -> None:
    """Add ``chaos`` to the subparsers of ``eop``."""
    parser = sub.add_parser(
        "chaos",
        help=HELP,
        description="Start nats-server and PostgreSQL, run worker processes behind fault "
        "proxies, publish while injecting seeded faults, heal, drain, and check that every "
        "message took effect exactly once. Exit status 0 only if it did.",
    )
    for flag, kind, default, help_text in _OPTIONS:
        var = _env_var(flag)
        raw = os.environ.get(var)
        value = options.env_value(var, kind, raw) if raw is not None else default
        parser.add_argument(
            f"--{flag}",
            type=kind,
            default=value,
            help=f"{help_text} [env: {var}; default: {default}]",
        )
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra `eop worker` argument, repeatable (e.g. --worker-arg=--batch-transactions)",
    )
    parser.add_argument(
        "--require-evidence",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fail unless every fault point killed a worker and the hard races happened "
        "(default: on)",
    )
    parser.set_defaults(command=run_command)


def run_command(args: argparse.Namespace) -> int:
    """Run ``eop chaos``; 0 when exactly-once held."""
    from eop.tools import chaos
    from eop.tools.chaos import bank, harness, scenarios, target

    custom = (args.app, args.handler, args.effects_sql, args.payloads)
    if any(custom) and not all(custom):
        raise errors.UsageError(
            "--app needs --handler, --effects-sql and --payloads (and they need --app)"
        )
    chosen = (
        target.from_options(
            app=args.app,
            handler=args.handler,
            effects_sql=args.effects_sql,
            payloads=args.payloads,
            setup=args.setup,
            invariant_sql=args.invariant_sql,
        )
        if args.app
        else bank.target()
    )
    scenarios.get(args.scenario)  # an unknown name is one sentence, before any server starts
    messages = args.messages
    if messages is None:
        messages = 3000 if args.duration_s <= 300 else int(args.duration_s * 10)
    # A SIGTERM (a CI timeout, `kill`) ends the run like Ctrl-C: its servers and
    # workers are stopped on the way out instead of being left behind.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # Printed first, so that even a run that crashes can be replayed.
    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    print(f"eop chaos: seed {seed}", flush=True)
    config = harness.Config(
        target=chosen,
        messages=messages,
        workers=args.workers,
        duration_s=args.duration_s,
        seed=seed,
        mean_fault_gap_s=args.fault_gap_s,
        drain_deadline_s=args.drain_deadline_s or max(90.0, args.duration_s / 3),
        concurrency=args.concurrency,
        batch_mode=_batch_mode(args.batch_mode),
        worker_args=tuple(args.worker_arg),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        require_evidence=args.require_evidence,
        scenario=args.scenario,
    )
    report = chaos.run(config)
    print(report.render(), flush=True)
    if args.json:
        Path(args.json).write_text(report.to_json() + "\n", encoding="utf-8")
    return 0 if report.ok else 1


def _batch_mode(value: str) -> BatchMode:
    if value not in ("mixed", "on", "off"):
        raise errors.UsageError(f"--batch-mode must be mixed, on or off, not {value!r}")
    return value  # type: ignore[return-value]  # checked above
