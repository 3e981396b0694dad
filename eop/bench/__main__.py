"""``python -m eop.bench KIND ...``: a child process of the bench (:mod:`eop.bench.loops`)."""

from __future__ import annotations

import asyncio
import sys

from eop.bench import loops
from eop.runtime import eventloop

if sys.argv[1] == "publish":
    # On uvloop when installed, as the relay it is the ceiling of.
    eventloop.run(loops.publish(*sys.argv[2:8]))
elif sys.argv[1] == "relay-polling":
    sys.exit(eventloop.run(loops.polling_relay(*sys.argv[2:4])))
else:
    asyncio.run(loops.consume(*sys.argv[1:7]))
