"""The throughput benchmark as a script: ``python benchmarks/bench.py [FLAGS]``.

The same as ``eop bench [FLAGS]`` and ``python3 run.py bench [FLAGS]`` (see
``eop bench --help``, :mod:`eop.tools.bench` and BENCHMARKS.md): a raw at-least-once
loop, the naive exactly-once loop, eop default and eop tuned, and the outbox
relay's runs, measured in one run on embedded servers; ``--big`` adds the
1,000,000-message run.
"""

from __future__ import annotations

import sys

from eop import cli

if __name__ == "__main__":
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
