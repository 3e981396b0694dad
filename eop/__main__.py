"""``python -m eop``: the ``eop`` command."""

from __future__ import annotations

import sys

from eop.cli import main

sys.exit(main())
