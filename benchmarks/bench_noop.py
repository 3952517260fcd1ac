"""A no-op group call on 2 ranks, on every backend, beside the raw ways of doing the same fan-out.

What is left when the method does nothing is the price of driving the group: dispatch, one message
to each rank and back, collect. Baselines: two plain Ray actors (``ray.get([a.noop.remote() ...])``)
and two processes answering over ``multiprocessing.Pipe``.

Run it:

    .venv/bin/python -m pytest benchmarks/bench_noop.py --benchmark-only --benchmark-columns=median,iqr,ops
"""

from __future__ import annotations

import pytest
from workers import Noop, PipeWorkers, RawRayActor

import spmdcall as sc

GROUP = "1. no-op call, world 2"
WORLD = 2
RAW_RAY = "raw Ray fan-out"
RAW_PIPE = "raw mp.Pipe fan-out"
# Fixed rounds keep the run short and its length predictable (a Ray call takes ~1 ms).
ROUNDS = {"inline": 3000, "process": 3000, "ray": 600}
# Targets on the 2-core development machine (issue 6).
PROCESS_TARGET_S = 150e-6
RAY_TARGET_RATIO = 1.15


@pytest.fixture(scope="module", params=["inline", "process", "ray"])
def noop_group(request):
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    with sc.WorkerGroup(sc.ResourcePool([WORLD]), sc.ClassWithInitArgs(Noop), backend=request.param) as wg:
        wg.noop()
        yield request.param, wg


def test_noop_group(case, noop_group):
    backend, wg = noop_group
    if backend == "ray":
        bench = case(GROUP, "spmdcall ray", baseline=RAW_RAY, target_ratio=RAY_TARGET_RATIO)
    elif backend == "process":
        bench = case(GROUP, "spmdcall process", baseline=RAW_PIPE, target_s=PROCESS_TARGET_S)
    else:
        bench = case(GROUP, "spmdcall inline", baseline=RAW_PIPE)
    assert bench.pedantic(wg.noop, rounds=ROUNDS[backend], warmup_rounds=50) == [None] * WORLD


def test_noop_raw_ray(case, ray_session):
    ray = ray_session
    actor_cls = ray.remote(num_cpus=0)(RawRayActor)
    actors = [actor_cls.remote() for _ in range(WORLD)]
    try:
        ray.get([a.noop.remote() for a in actors])

        def fan_out():
            return ray.get([a.noop.remote() for a in actors])

        bench = case(GROUP, RAW_RAY)
        assert bench.pedantic(fan_out, rounds=ROUNDS["ray"], warmup_rounds=50) == [None] * WORLD
    finally:
        for a in actors:
            ray.kill(a)


def test_noop_raw_pipe(case):
    workers = PipeWorkers(WORLD)
    try:
        case(GROUP, RAW_PIPE).pedantic(workers.call, rounds=ROUNDS["process"], warmup_rounds=50)
    finally:
        workers.close()
