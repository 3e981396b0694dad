"""``eop bench``: its flags (each with an ``EOP_BENCH_*`` variable) and its output."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from eop.cli import options

_FLAGS: tuple[tuple[str, Any, str], ...] = (
    ("messages", int, "backlog of each run but the naive (b) and the poison flood (f) ones"),
    ("flood-messages", int, "backlog of the poison flood (f, fh): half failing, then half good"),
    ("naive-messages", int, "backlog of the naive run (b), which is slow"),
    (
        "warm-messages",
        int,
        "messages each timed run drains first, unmeasured: its connections opened and its "
        "statements planned",
    ),
    ("payload-bytes", int, "size of every message's payload"),
    ("latency-s", float, "length of each run's steady-load latency phase"),
    ("latency-load", float, "publish rate of the latency phase, as a share of the run's rate"),
    ("tuned", str, "`eop worker` flags of the tuned run (d), which has a batch handler"),
    ("big", bool, "also the long run: --big-messages through eop default (minutes)"),
    ("big-messages", int, "messages of the long run (rates at 10k-20k and the last 10k)"),
    ("fsync", bool, "PostgreSQL with fsync on, as in production"),
    (
        "runs",
        str,
        "which runs: 'all', keys separated by commas (r: the relay's rows, f: the poison "
        "flood's), or 'none' (with --big: the long run alone)",
    ),
    ("relay-messages", int, "outbox rows of the relay's throughput run (r), and of (rw), (rp)"),
    ("relay-payload-bytes", int, "size of each outbox row's payload"),
    ("relay-rate", float, "rows/s, one per transaction, of the commit-to-PubAck runs (rl), (rn)"),
    ("relay-latency-s", float, "length of each commit-to-PubAck run"),
    (
        "pg-cpus",
        float,
        "hold PostgreSQL to this many cores (a cgroup CPU quota, e.g. 0.5; 0: no limit) and "
        "report where each run saturates it: the fleet's ceiling",
    ),
    (
        "pg-profile",
        bool,
        "instead of timing, count PostgreSQL's work per message (statements, transactions, "
        "WAL, rows) of the chosen runs ('all': h,hn,c1,c)",
    ),
)


HELP = "measure eop beside a lean raw loop and a hand-written consumer, on embedded servers"


def add_command(sub: options.Subparsers) -> None:
    """Add ``bench`` to the subparsers of ``eop``."""
    from eop.tools import bench
    from eop.tools.bench import runs

    parser = sub.add_parser(
        "bench",
        help=HELP,
        # The package's docstring says what the runs are.
        description=(bench.__doc__ or "").split("\n\n")[1],
    )
    defaults = runs.Options()
    for flag, kind, help_text in _FLAGS:
        var = "EOP_BENCH_" + flag.upper().replace("-", "_")
        default = getattr(defaults, flag.replace("-", "_"))
        raw = os.environ.get(var)
        parser.add_argument(
            f"--{flag}",
            default=default if raw is None else options.env_value(var, kind, raw),
            help=f"{help_text} [env: {var}; default: {default}]",
            **({"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}),
        )
    parser.add_argument(
        "--json",
        metavar="FILE",
        default=os.environ.get("EOP_BENCH_JSON"),
        help="also write the results as JSON to FILE ('-': stdout, instead of the table) "
        "[env: EOP_BENCH_JSON]",
    )
    parser.set_defaults(command=run_command)


def run_command(args: argparse.Namespace) -> int:
    """Run ``eop bench``: print the table (and write the JSON)."""
    from eop.tools.bench import pgprofile, report, runner, runs

    chosen = runs.Options(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(runs.Options)}
    )
    results = pgprofile.run(chosen) if chosen.pg_profile else runner.run(chosen)
    if args.json == "-":
        print(json.dumps(results, indent=2))
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    formatted = pgprofile.format_profile if chosen.pg_profile else report.format_report
    print(formatted(results))
    return 0
