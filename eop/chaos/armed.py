"""``python -m eop.chaos.armed``: an alias of ``python -m eop.tools.chaos.armed``, where it moved.

An ``eop`` command with its fault points armed from ``EOP_FAULTS``; the
children of ``worker --processes N`` are started through the new path.
"""

from __future__ import annotations

import sys

from eop.tools.chaos.armed import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
