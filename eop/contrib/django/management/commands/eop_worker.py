"""``manage.py eop_worker [flags]``: ``eop worker`` on this project's handlers."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import BaseCommand

from eop.contrib.django import cli


class Command(BaseCommand):
    """Run the handlers of ``settings.EOP["APP"]`` (flags as ``eop worker --help``)."""

    help = "run this project's eop handlers: pull, process exactly once, ack"

    def add_arguments(self, parser: Any) -> None:
        """Everything goes to ``eop worker``'s own parser."""
        parser.add_argument("args", nargs=argparse.REMAINDER)

    def run_from_argv(self, argv: list[str]) -> None:
        """Skip Django's parser: the flags are ``eop worker``'s."""
        sys.exit(cli.run(["worker", *argv[2:]]))

    def handle(self, *args: str, **options: Any) -> None:
        """For ``call_command("eop_worker")``."""
        status = cli.run(["worker", *args])
        if status:
            sys.exit(status)
