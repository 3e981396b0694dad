"""``python -m eop.tools.bench KIND ...``: a child process of the bench.

KIND is ``a``, ``h``, ``hb``, ``hf`` or ``b`` (:mod:`eop.tools.bench.baselines`), ``m``
(:mod:`eop.tools.bench.floor`), ``fan N KIND ...`` (N copies of one of them), ``publish``
or ``relay-polling`` (:mod:`eop.tools.bench.loops`).
``python -m eop.tools.bench spark ...`` is the Spark bench (:mod:`eop.tools.bench.spark`).
"""

from __future__ import annotations

import asyncio
import sys

from eop.runtime import eventloop
from eop.tools.bench import baselines, floor, loops

kind, args = sys.argv[1], sys.argv[2:]
if kind == "spark":
    from eop.tools.bench import spark

    sys.exit(spark.main(args))
elif kind == "publish":
    # On uvloop when installed, as the relay it is the ceiling of.
    eventloop.run(loops.publish(*args[:6]))
elif kind == "relay-polling":
    sys.exit(eventloop.run(loops.polling_relay(*args[:2])))
elif kind == "fan":
    sys.exit(baselines.fan_out(int(args[0]), args[1:]))
elif kind == "a":
    # uvloop when installed, as eop's workers: the lean loop is the client's best.
    eventloop.run(baselines.lean(*args[:4]))
elif kind == "h":
    eventloop.run(baselines.handwritten(*args[:4]))
elif kind == "hb":
    eventloop.run(baselines.handwritten_bounded(*args[:4]))
elif kind == "m":
    eventloop.run(floor.floor(*args[:4]))
elif kind == "hf":
    eventloop.run(baselines.handwritten_flood(*args[:7]))
else:
    asyncio.run(baselines.naive_loop(*args[:4]))
