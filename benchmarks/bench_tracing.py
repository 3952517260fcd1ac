"""What ``sc.trace`` costs per no-op group call (world 2): enabled vs disabled, on every backend.

Enabled, every call records a dispatch span, one span per rank (timed in the worker) and a collect
span. Disabled, a call pays two ``tracing.active()`` checks; that check is timed on its own.

Run it:

    .venv/bin/python -m pytest benchmarks/bench_tracing.py --benchmark-only --benchmark-columns=median,iqr,ops
"""

from __future__ import annotations

import json

import pytest
from workers import Noop

import spmdcall as sc
from spmdcall import tracing

GROUP = "5. sc.trace on a no-op call, world 2"
WORLD = 2
ROUNDS = {"inline": 3000, "process": 3000, "ray": 600}


@pytest.fixture(scope="module", params=["inline", "process", "ray"])
def noop_group(request):
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    with sc.WorkerGroup(sc.ResourcePool([WORLD]), sc.ClassWithInitArgs(Noop), backend=request.param) as wg:
        wg.noop()
        yield request.param, wg


@pytest.mark.parametrize("traced", [False, True], ids=["off", "on"])
def test_trace_overhead(case, noop_group, traced, tmp_path):
    backend, wg = noop_group
    off = f"{backend}, trace off"
    if not traced:
        case(GROUP, off).pedantic(wg.noop, rounds=ROUNDS[backend], warmup_rounds=50)
        return
    path = tmp_path / "trace.json"
    with sc.trace(path):
        bench = case(GROUP, f"{backend}, trace on", baseline=off)
        bench.pedantic(wg.noop, rounds=ROUNDS[backend], warmup_rounds=50)
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(e["name"] == "noop" for e in events) >= WORLD


def test_trace_disabled_check(case):
    """The whole cost of a disabled trace: ``tracing.active()`` twice per group call."""
    assert tracing.active() is None
    case(GROUP, "trace off: one tracing.active() check")(tracing.active)
