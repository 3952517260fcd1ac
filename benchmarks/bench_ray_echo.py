"""Echo a 32 MiB DataProto through a 2-rank ``ray`` group, beside raw Ray doing the same by hand.

The batch has 1024 rows and two float32 (1024, 4096) tensors. ``DP_COMPUTE_PROTO`` splits it in
two, each rank returns its half, the controller concatenates: 32 MiB out and 32 MiB back. The raw
Ray baselines pass the same row halves to two plain actors and concatenate what comes back, once
with torch tensors (Ray pickles them) and once with numpy arrays (Ray's zero-copy path, whose
results are read-only views of the object store: the floor, without the copy that makes
spmdcall's tensors writable).

Steady state is what is measured: every process writes each page of the object store once
before writes get cheap (first-touch page faults), so the store is kept small (512 MiB) and each
benchmark warms up first.

Run it:

    .venv/bin/python -m pytest benchmarks/bench_ray_echo.py --benchmark-only --benchmark-columns=median,iqr,ops
"""

from __future__ import annotations

import pytest

import spmdcall as sc

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
from spmdcall.data import DataProto  # noqa: E402  (needs torch)

ROWS, COLS = 1024, 4096
OBJECT_STORE_BYTES = 512 << 20
# Enough round trips for every process to have touched the whole object store once.
WARMUP_ROUNDS, ROUNDS = 30, 40


class Echo:
    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def echo(self, batch: DataProto) -> DataProto:
        return batch


@ray.remote
class RawEcho:
    def echo(self, value):
        return value


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    if ray.is_initialized():
        yield
        return
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=OBJECT_STORE_BYTES,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        configure_logging=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def batch() -> DataProto:
    gen = torch.Generator().manual_seed(0)
    return DataProto.from_dict(
        {"a": torch.randn(ROWS, COLS, generator=gen), "b": torch.randn(ROWS, COLS, generator=gen)}
    )


@pytest.fixture(scope="module")
def group(ray_local):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Echo), backend="ray") as wg:
        yield wg


@pytest.fixture(scope="module")
def raw_actors(ray_local):
    actors = [RawEcho.remote() for _ in range(2)]
    ray.get([a.echo.remote(0) for a in actors])
    yield actors
    for a in actors:
        ray.kill(a)


def _raw_round_trip(actors, halves):
    outs = ray.get([actor.echo.remote(half) for actor, half in zip(actors, halves)])
    return {k: torch.cat([torch.as_tensor(o[k]) for o in outs]) for k in ("a", "b")}


def test_spmdcall_ray_group_echo(benchmark, group, batch):
    out = benchmark.pedantic(group.echo, (batch,), rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    assert torch.equal(out.batch["a"], batch.batch["a"]) and torch.equal(out.batch["b"], batch.batch["b"])


def test_raw_ray_torch_echo(benchmark, raw_actors, batch):
    halves = [{k: batch.batch[k][i * ROWS // 2 : (i + 1) * ROWS // 2] for k in ("a", "b")} for i in range(2)]
    out = benchmark.pedantic(
        _raw_round_trip, (raw_actors, halves), rounds=10, warmup_rounds=5
    )  # slow: fewer rounds
    assert torch.equal(out["a"], batch.batch["a"])


def test_raw_ray_numpy_echo(benchmark, raw_actors, batch):
    halves = [
        {k: batch.batch[k][i * ROWS // 2 : (i + 1) * ROWS // 2].numpy() for k in ("a", "b")} for i in range(2)
    ]
    out = benchmark.pedantic(
        _raw_round_trip, (raw_actors, halves), rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS
    )
    assert torch.equal(out["a"], batch.batch["a"])
