"""``python -m eop.bench KIND ...``: the consumer process of run (a) or (b)."""

from __future__ import annotations

import asyncio
import sys

from eop.bench import loops

asyncio.run(loops.consume(*sys.argv[1:7]))
