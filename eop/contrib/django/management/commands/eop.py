"""``manage.py eop <command> ...``: any eop command on this project (``eop --help``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import BaseCommand

from eop.contrib.django import cli


class Command(BaseCommand):
    """eop's command line, with the app and the database of ``settings.EOP``."""

    help = "eop's commands (worker, db, dlq, status, outbox, ...) on this project's settings"

    def add_arguments(self, parser: Any) -> None:
        """Everything after ``eop`` goes to eop's own parser."""
        parser.add_argument("args", nargs=argparse.REMAINDER)

    def run_from_argv(self, argv: list[str]) -> None:
        """Skip Django's parser: ``manage.py eop worker --help`` is eop's help."""
        sys.exit(cli.run(argv[2:]))

    def handle(self, *args: str, **options: Any) -> None:
        """For ``call_command("eop", "db", "upgrade")``: a non-zero status raises SystemExit."""
        status = cli.run(args)
        if status:
            sys.exit(status)
