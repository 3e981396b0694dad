"""The ``eop`` command line: ``eop worker``, ``eop db ...``, ``eop dlq ...``, ``eop status``, ...

Every flag can also be set by the ``EOP_*`` variable that ``--help`` shows.
Errors print their cause chain, never a traceback.

One module per family of commands (:mod:`eop.cli.worker`,
:mod:`eop.cli.operations`, :mod:`eop.cli.audit`), each adding its commands to
the parser; what they share is in :mod:`eop.cli.options`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from eop import errors, log
from eop import settings as settings_mod
from eop.cli import audit, operations, options, worker
from eop.cli import bench as bench_cli
from eop.cli import chaos as chaos_cli
from eop.cli import spark as spark_cli
from eop.cli.options import (
    NATS_AUTH_FIELDS,
    load_app,
    overrides,
)
from eop.cli.worker import WORKER_FIELDS
from eop.outbox import cli as outbox_cli

__all__ = [
    "main",
    "build_parser",
    "load_app",
    "overrides",
    "NATS_AUTH_FIELDS",
    "WORKER_FIELDS",
]


#: The tools' commands: their parsers, and the packages behind them, are loaded
#: only when one of them is run, so that ``eop worker`` never imports them.
_TOOLS: dict[str, tuple[str, Callable[[options.Subparsers], None]]] = {
    "spark": (spark_cli.HELP, spark_cli.add_commands),
    "chaos": (chaos_cli.HELP, chaos_cli.add_command),
    "bench": (bench_cli.HELP, bench_cli.add_command),
}


def main(
    argv: Sequence[str] | None = None,
    *,
    prepare: Callable[[], None] | None = None,
    program: Sequence[str] | None = None,
    host: options.Host | None = None,
) -> int:
    """Run the ``eop`` command; returns the process exit code.

    ``host`` is a program that runs these commands on its own configuration
    (Django's ``manage.py eop``): the help names it and its settings.

    ``prepare`` and ``program`` serve an entry point that wraps this one (the
    chaos harness's :mod:`eop.tools.chaos.armed`, which arms fault points):
    ``prepare`` runs once logging is configured, before the command, its
    errors reported as the command's would be; ``program`` is the command line
    that runs that entry point again, which ``eop worker --processes N``
    starts its children with (default: ``python -m eop``).
    """
    options.command_line(argv)
    with options.hosted(host):
        args, _ = build_parser().parse_known_args(argv)
        tool = getattr(args, "tool", None)
        try:
            # A tool's command is parsed again, by its own full parser (bench's reads
            # eop.tools).
            with options.developer_tools(args.command_name):
                parser = build_parser(tool)
        except errors.EopError as exc:
            options.print_error(exc, as_json=options.json_asked(argv))
            return 1
    args = parser.parse_args(argv)
    # `eop worker --processes N` starts its children with the same arguments,
    # through the same entry point.
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    args.program = program  # None: the supervisor's default, `python -m eop`
    try:
        settings = settings_mod.Settings.from_env(
            overrides={"log_format": args.log_format, "log_level": args.log_level}
        )
        log.configure(settings.log_format, settings.log_level, libraries=not log.host_logging())
        if prepare is not None:
            prepare()
        command: Callable[[argparse.Namespace], int] = args.command
        with options.developer_tools(args.command_name):
            return command(args)
    except errors.UsageError as exc:
        options.print_error(exc, to=getattr(args, "error_file", None))
        return 2
    except errors.EopError as exc:
        # print_error's default: the logs' format, or as asked when a setting was refused
        # before logging was configured (command_line above).
        options.print_error(exc, to=getattr(args, "error_file", None))
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `eop ... | head`: the reader left. Python would complain again when it
        # flushes stdout at exit: point it at /dev/null. 128 + SIGPIPE, as tools
        # that die of the signal report it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def build_parser(tool: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``eop`` and its subcommands.

    ``tool`` (``spark``, ``chaos`` or ``bench``) gets its full parser; the
    others are listed by name and help only.
    """
    parser: argparse.ArgumentParser = options.Parser(
        prog=options.prog(),
        description="Exactly-once processing of NATS JetStream messages into PostgreSQL.",
    )
    options.add_log_options(parser)
    sub = parser.add_subparsers(
        title="commands", required=True, metavar="COMMAND", dest="command_name"
    )
    # In this order in --help.
    worker.add_worker(sub)
    outbox_cli.add_relay(sub)
    worker.add_db(sub)
    operations.add_dlq(sub)
    operations.add_status(sub)
    operations.add_streams(sub)
    outbox_cli.add_outbox(sub)
    audit.add_audit(sub)
    worker.add_demo(sub)

    for name, (help_text, add) in _TOOLS.items():
        if name == tool:
            add(sub)
        else:
            stub = sub.add_parser(name, help=help_text, add_help=False)
            stub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            stub.set_defaults(tool=name)
    return parser
