"""``python -m eop.tools.chaos.armed COMMAND ...``: an ``eop`` command with its fault points armed.

The chaos harness starts its workers through this entry point, not ``eop
worker``: it arms the fault points from ``EOP_FAULTS`` and ``EOP_FAULT_SEED``
(:func:`eop.faults.arm_from_env`), then runs the command exactly as ``eop``
would. ``eop`` itself never arms from the environment, so a variable left in a
production environment cannot SIGKILL a production worker. The children of
``worker --processes N`` are started through this entry point too, so each
arms the same rules.

Not a documented command: it is the harness's, and a test's that needs a
worker process to crash at a fault point.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from eop import cli, faults

MODULE = "eop.tools.chaos.armed"
"""This module's name, for ``python -m`` (run so, its ``__name__`` is ``__main__``)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``eop`` with ``argv`` (default: the command line), fault points armed."""
    return cli.main(argv, prepare=faults.arm_from_env, program=[sys.executable, "-m", MODULE])


if __name__ == "__main__":
    sys.exit(main())
