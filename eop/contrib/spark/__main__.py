"""``eop spark`` as a Spark application, for spark-submit (client and cluster deploy mode).

    spark-submit --master spark://host:7077 --py-files myapp.py \\
        "$(python -m eop.contrib.spark --path)" backfill myapp:app --handler billing

The arguments are those of ``eop spark``; the master is spark-submit's.
``python -m eop.contrib.spark --path`` prints this file's path; ``python -m eop.contrib.spark
backfill ...`` is ``eop spark backfill ...``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str]) -> int:
    """Print this file's path (``--path``), or run ``eop spark`` with ``argv``."""
    if list(argv) == ["--path"]:
        print(Path(__file__).resolve())
        return 0
    from eop import cli

    return cli.main(["spark", *argv])


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    # Run as a script (spark-submit's way), Python puts eop/contrib/spark/ first on the path,
    # where eop's modules would shadow top-level ones of the same name (errors, session...).
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]
    sys.exit(main(sys.argv[1:]))
