"""``python -m eop.spark``: an alias of ``python -m eop.contrib.spark``, where it moved.

spark-submit may still be given this file (``.../site-packages/eop/spark/__main__.py``):
it runs the same ``eop spark`` command; ``--path`` prints the new entry point's file.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    # Run as a script (spark-submit's way), Python puts eop/spark/ first on the path.
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]
    from eop.contrib.spark.__main__ import main

    sys.exit(main(sys.argv[1:]))
