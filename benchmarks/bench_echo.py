"""Echo a 32 MiB DataProto through a 2-rank group, beside raw Ray, raw pipes and a plain memory copy.

The batch has 1024 rows and two float32 (1024, 4096) columns. ``DP_COMPUTE_PROTO`` splits it in
two, each rank returns its half, the controller concatenates: 32 MiB out and 32 MiB back.
Baselines: two plain Ray actors given the same row halves (``ray.put`` each half, the actors
return them, the controller concatenates), once as torch tensors and once as numpy arrays (Ray's
zero-copy path, whose results are read-only views of the object store); two processes echoing
the halves over ``multiprocessing.Pipe`` (torch's reductions move a tensor's storage into shared
memory on its first send, after which only file descriptors cross: no copy at all, and the
workers write into the caller's tensors, where spmdcall hands every rank its own copy); and the
physical floor, one in-process copy of the 32 MiB (``np.concatenate`` of the halves). verl's RayWorkerGroup takes 105-116 ms for this echo on the
2-core development machine.

Run it:

    .venv/bin/python -m pytest benchmarks/bench_echo.py --benchmark-only --benchmark-columns=median,iqr,ops
"""

from __future__ import annotations

import pytest
from workers import Echo, PipeWorkers, RawRayActor, join_parts

import spmdcall as sc

torch = pytest.importorskip("torch")

GROUP = "2. echo 32 MiB, world 2"
WORLD = 2
FLOOR = "memcpy 32 MiB (np.concatenate)"
RAW_RAY = "raw Ray, torch tensors"
PIPE = "raw mp.Pipe, torch shared-memory tensors"
TARGET_S = {"process": 15e-3, "ray": 30e-3}
ROUNDS = {"process": 60, "ray": 30, "raw Ray torch": 8, "raw Ray numpy": 30, "pipe": 100, "floor": 200}


def _same(out: dict, batch) -> bool:
    return sorted(out) == sorted(batch.batch.keys()) and all(
        torch.equal(v, batch.batch[k]) for k, v in out.items()
    )


@pytest.fixture(scope="module", params=["process", "ray"])
def echo_group(request):
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    with sc.WorkerGroup(sc.ResourcePool([WORLD]), sc.ClassWithInitArgs(Echo), backend=request.param) as wg:
        yield request.param, wg


def test_echo_group(case, echo_group, batch):
    backend, wg = echo_group
    bench = case(
        GROUP,
        f"spmdcall {backend}",
        baseline=RAW_RAY if backend == "ray" else FLOOR,
        target_s=TARGET_S[backend],
    )
    out = bench.pedantic(wg.echo, args=(batch,), rounds=ROUNDS[backend], warmup_rounds=2)
    assert _same(dict(out.batch.items()), batch)


@pytest.fixture(scope="module")
def raw_actors(ray_session):
    actor_cls = ray_session.remote(num_cpus=0)(RawRayActor)
    actors = [actor_cls.remote() for _ in range(WORLD)]
    ray_session.get([a.noop.remote() for a in actors])
    yield actors
    for a in actors:
        ray_session.kill(a)


def _raw_ray_echo(ray, actors, parts):
    refs = [ray.put(part) for part in parts]
    return join_parts(ray.get([actor.echo.remote(ref) for actor, ref in zip(actors, refs)]))


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_echo_raw_ray(case, ray_session, raw_actors, halves, batch, kind):
    parts = halves if kind == "torch" else [{k: v.numpy() for k, v in h.items()} for h in halves]
    label = RAW_RAY if kind == "torch" else "raw Ray, numpy arrays (read-only results)"
    out = case(GROUP, label, baseline=FLOOR).pedantic(
        _raw_ray_echo,
        args=(ray_session, raw_actors, parts),
        rounds=ROUNDS[f"raw Ray {kind}"],
        warmup_rounds=1,
    )
    assert _same(out, batch)


def test_echo_raw_pipe(case, halves, batch):
    halves = [{k: v.clone() for k, v in h.items()} for h in halves]  # torch moves these into shared memory
    workers = PipeWorkers(WORLD)
    try:
        out = case(GROUP, PIPE, baseline=FLOOR).pedantic(
            lambda: join_parts(workers.call(halves)), rounds=ROUNDS["pipe"], warmup_rounds=2
        )
        assert _same(out, batch)
    finally:
        workers.close()


def test_echo_memcpy_floor(case, halves, batch):
    out = case(GROUP, FLOOR).pedantic(join_parts, args=(halves,), rounds=ROUNDS["floor"], warmup_rounds=2)
    assert _same(out, batch)
