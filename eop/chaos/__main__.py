"""``python -m eop.chaos``: an alias of ``python -m eop.tools.chaos``, the same as ``eop chaos``."""

from __future__ import annotations

import sys

from eop.cli import main

sys.exit(main(["chaos", *sys.argv[1:]]))
