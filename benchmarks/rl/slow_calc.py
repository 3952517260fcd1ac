"""The calc tool behind a link with a long tail, for the calc demo's asynchronous rows (#47 point 7).

``calc`` here is the registry's ``calc`` (the same answers, the same name, so a model trained to
write ``<call>calc 1234*5678</call>`` calls it), answering after a lognormal delay: median 0.3 s,
sigma 1 (a mean of 0.49 s, one call in a hundred over 3 s), as code execution or a search behave.
It is not registered (a ``Tool`` object, not ``@tool``), so the registry's own ``calc`` stays
as it is; a run names this one by its file:

    python benchmarks/rl/demo_seeds.py --task calc --seeds 0 --out runs/calc-slow \
        "rollout.multi_turn.tools=[benchmarks/rl/slow_calc.py:calc]"

The delays come from a generator seeded with ``SLOW_CALC_SEED`` (default 0) when the file is
loaded; ``SLOW_CALC_MEDIAN_S`` sets the median. A sync and an async run draw from the same sequence,
though not call for call in the same order (their trajectories interleave differently).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import random

from rl_extension.agents import get_tool

MEDIAN_S = float(os.environ.get("SLOW_CALC_MEDIAN_S", "0.3"))
SIGMA = 1.0
_delays = random.Random(int(os.environ.get("SLOW_CALC_SEED", "0")))


def delay() -> float:
    """The next call's latency in seconds: lognormal, median ``MEDIAN_S``, sigma ``SIGMA``."""
    return _delays.lognormvariate(math.log(MEDIAN_S), SIGMA)


_calc = get_tool("calc")


async def _slow_calc(expression: str) -> str:
    await asyncio.sleep(delay())
    return _calc.fn(expression)


calc = dataclasses.replace(_calc, fn=_slow_calc)
