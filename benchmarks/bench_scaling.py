"""Echo (``DP_COMPUTE_PROTO``) of 1, 16, 64 and 256 MiB through groups of 1, 2 and 4 ranks.

One float32 column of 1024 rows; every rank gets ``1024 / world`` rows and returns them. Each
payload size is a group of its own, with one in-process copy of the same bytes as the floor
(``np.concatenate`` of two halves: one single-threaded memcpy). Big
payloads run few rounds (``ROUNDS``) so that the whole file stays around a minute.

Run it:

    .venv/bin/python -m pytest benchmarks/bench_scaling.py --benchmark-only --benchmark-columns=median,iqr,ops
"""

from __future__ import annotations

import numpy as np
import pytest
from workers import MIB, Echo, make_batch

import spmdcall as sc

torch = pytest.importorskip("torch")

SIZES_MIB = [1, 16, 64, 256]
WORLDS = [1, 2, 4]
ROUNDS = {1: 40, 16: 15, 64: 6, 256: 4}
_batches: dict[int, object] = {}


def _group_name(size_mib: int) -> str:
    return f"4{'abcd'[SIZES_MIB.index(size_mib)]}. echo {size_mib} MiB, world 1/2/4"


def _batch(size_mib: int):
    if size_mib not in _batches:
        _batches.clear()  # keep one payload alive at a time
        _batches[size_mib] = make_batch(size_mib * MIB, seed=size_mib)
    return _batches[size_mib]


@pytest.fixture(
    scope="module",
    params=[(b, w) for b in ("process", "ray") for w in WORLDS],
    ids=lambda p: f"{p[0]}-w{p[1]}",
)
def scaling_group(request):
    backend, world = request.param
    if backend == "ray":
        request.getfixturevalue("ray_session")
    with sc.WorkerGroup(sc.ResourcePool([world]), sc.ClassWithInitArgs(Echo), backend=backend) as wg:
        yield backend, world, wg


@pytest.mark.parametrize("size_mib", SIZES_MIB)
def test_scaling_group(case, scaling_group, size_mib):
    backend, world, wg = scaling_group
    batch = _batch(size_mib)
    bench = case(_group_name(size_mib), f"{backend}, world {world}", baseline=f"memcpy {size_mib} MiB")
    # Two warm-up calls: the first result is still held while the second is made, so the steady
    # state (every segment in the pools already) starts with the third.
    out = bench.pedantic(wg.echo, args=(batch,), rounds=ROUNDS[size_mib], warmup_rounds=2)
    assert torch.equal(out.batch["c0"], batch.batch["c0"])


@pytest.mark.parametrize("size_mib", SIZES_MIB)
def test_scaling_memcpy_floor(case, size_mib):
    halves = [part.batch["c0"].numpy() for part in _batch(size_mib).chunk(2)]
    bench = case(_group_name(size_mib), f"memcpy {size_mib} MiB")
    out = bench.pedantic(np.concatenate, args=(halves,), rounds=ROUNDS[size_mib] * 2, warmup_rounds=1)
    assert out.shape[0] == sum(h.shape[0] for h in halves)
