"""10. How long a 2-rank group takes to start (#66): ranks forked from a warm template, beside fresh
interpreters and Ray actors.

Each group times every side once a round, the sides one after another, for several rounds (the
VM's speed drifts between blocks of a run; interleaving puts the drift on every side alike), and
keeps each side's times (``extra_info["sides"]``: ``report.py`` makes a row of each).

10a. A group of a class whose module imports torch and transformers (``start_workers.py``), from
``WorkerGroup(...)`` until its first call has answered: ``process`` forking from its warm template
(target 0.3 s), ``process`` with ``start_method="spawn"`` (two fresh interpreters), two plain Ray
actors of the same class (Ray running already). Baseline: two bare interpreters importing the same
modules side by side (``python -c "import torch, transformers"``), which a fresh rank cannot beat.

10b. ``restart([1])`` of such a group until rank 1 answers again: template (target 0.3 s), spawn.

10c. The same for a class whose module imports nothing but spmdcall (``workers.Noop``): template
(target 0.05 s), spawn, Ray actors; baseline two bare interpreters (``python -c pass``).

10d. The first group of a run: a fresh controller that imports the class's module and starts the
10a group, timed inside it from ``WorkerGroup(...)`` to the first answer, template (made then:
the price the first group pays once) beside spawn.

Run it:

    .venv/bin/python -m pytest benchmarks/bench_start.py --benchmark-only --benchmark-columns=median -s
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
from workers import Noop

import spmdcall as sc

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
ROUNDS = {"torch": 5, "bare": 10, "first": 3}
TEMPLATE, SPAWN, RAY = "process, template (warm)", "process, spawn", "Ray actors (Ray running)"
TORCH_TARGET_S, BARE_TARGET_S = 0.3, 0.05
GROUPS = {
    "torch": "10a. start a 2-rank group, class importing torch + transformers, to its first answer",
    "restart": "10b. restart([1]) of that group, to rank 1's answer",
    "bare": "10c. start a 2-rank group, class importing nothing, to its first answer",
    "first": "10d. the first 2-rank group of a fresh controller (torch + transformers class)",
}


def _torch_class():
    from start_workers import TorchWorker

    return TorchWorker


def _group(cls: type, start_method: str) -> sc.WorkerGroup:
    return sc.WorkerGroup(sc.ResourcePool([WORLD]), sc.ClassWithInitArgs(cls), start_method=start_method)


def _interpreters(code: str) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(WORLD)]
    assert [p.wait() for p in procs] == [0] * WORLD


def _start_and_ask(cls: type, start_method: str) -> Callable[[], None]:
    def run() -> None:
        with _group(cls, start_method) as wg:
            method = wg.ping if hasattr(cls, "ping") else wg.noop
            assert len(method()) == WORLD

    return run


def _ray_actors(ray, cls: type) -> Callable[[], None]:
    remote = ray.remote(num_cpus=0)(cls)
    method = "ping" if hasattr(cls, "ping") else "noop"

    def run() -> None:
        actors = [remote.remote() for _ in range(WORLD)]
        try:
            assert len(ray.get([getattr(a, method).remote() for a in actors])) == WORLD
        finally:
            for a in actors:
                ray.kill(a)

    return run


def _interleave(bench, sides: dict[str, Callable[[], None]], rounds: int, spec: dict[str, dict]) -> None:
    """Time each side once a round, for ``rounds`` rounds (after one round of warm-up); each
    side's times go to ``extra_info["sides"]`` with its baseline and target (``spec``)."""
    times: dict[str, list[float]] = {label: [] for label in sides}

    def one_round() -> None:
        for label, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - start)

    bench.pedantic(one_round, rounds=rounds, warmup_rounds=1)
    bench.extra_info["sides"] = [
        {"label": label, "times": got[1:], **spec.get(label, {})}  # the warm-up round left out
        for label, got in times.items()
    ]
    print()
    for label, got in times.items():
        print(f"{label:40s} median {sorted(got[1:])[len(got[1:]) // 2] * 1e3:9.1f} ms")


@pytest.fixture(scope="module")
def ray_or_none(request):
    try:
        return request.getfixturevalue("ray_session")
    except pytest.skip.Exception:
        return None


def test_start_torch_class(case, ray_or_none):
    cls = _torch_class()
    baseline = "two bare interpreters: import torch, transformers"
    sides = {
        baseline: lambda: _interpreters("import torch, transformers"),
        SPAWN: _start_and_ask(cls, "spawn"),
        TEMPLATE: _start_and_ask(cls, "template"),
    }
    if ray_or_none is not None:
        sides[RAY] = _ray_actors(ray_or_none, cls)
    spec = {
        SPAWN: {"baseline": baseline},
        TEMPLATE: {"baseline": baseline, "target_s": TORCH_TARGET_S},
        RAY: {"baseline": baseline},
    }
    _interleave(case(GROUPS["torch"], "one round of every side"), sides, ROUNDS["torch"], spec)


def test_restart_one_rank(case):
    cls = _torch_class()
    groups = {method: _group(cls, method) for method in ("spawn", "template")}
    try:
        for wg in groups.values():
            wg.ping()

        def restart(wg: sc.WorkerGroup) -> Callable[[], None]:
            def run() -> None:
                wg.restart([1])
                wg.ping()

            return run

        sides = {SPAWN: restart(groups["spawn"]), TEMPLATE: restart(groups["template"])}
        spec = {TEMPLATE: {"baseline": SPAWN, "target_s": TORCH_TARGET_S}}
        _interleave(case(GROUPS["restart"], "one round of every side"), sides, ROUNDS["torch"], spec)
    finally:
        for wg in groups.values():
            wg.shutdown()


def test_start_bare_class(case, ray_or_none):
    baseline = "two bare interpreters: pass"
    sides = {
        baseline: lambda: _interpreters("pass"),
        SPAWN: _start_and_ask(Noop, "spawn"),
        TEMPLATE: _start_and_ask(Noop, "template"),
    }
    if ray_or_none is not None:
        sides[RAY] = _ray_actors(ray_or_none, Noop)
    spec = {
        SPAWN: {"baseline": baseline},
        TEMPLATE: {"baseline": baseline, "target_s": BARE_TARGET_S},
        RAY: {"baseline": baseline},
    }
    _interleave(case(GROUPS["bare"], "one round of every side"), sides, ROUNDS["bare"], spec)


_FIRST_GROUP = """
import sys, time
sys.path.insert(0, {here!r})
import spmdcall as sc
from start_workers import TorchWorker

start = time.perf_counter()
with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(TorchWorker), start_method={method!r}) as wg:
    wg.ping()
    print(time.perf_counter() - start)
"""


def test_first_group_of_a_fresh_controller(case):
    inside: dict[str, list[float]] = {"spawn": [], "template": []}

    def fresh(method: str) -> Callable[[], None]:
        def run() -> None:
            code = textwrap.dedent(_FIRST_GROUP.format(here=HERE, method=method))
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            inside[method].append(float(out.stdout.split()[-1]))

        return run

    bench = case(GROUPS["first"], "one round of both (whole controllers)")
    _interleave(bench, {"spawn": fresh("spawn"), "template": fresh("template")}, ROUNDS["first"], {})
    # The rows: the time each controller measured from WorkerGroup(...) to the first answer.
    bench.extra_info["sides"] = [
        {"label": f"process, {method}: WorkerGroup(...) to first answer", "times": got[1:]}
        for method, got in inside.items()
    ]
    bench.extra_info["sides"][1]["baseline"] = bench.extra_info["sides"][0]["label"]
