"""Two groups in a chain, producer -> consumer: through a GroupFuture vs through the controller.

The producer (2 ranks, like a rollout) turns a small prompt batch (1024 rows, 8 KiB) into 32 MiB
(two float32 (1024, 4096) columns, cached on the workers so only the transport is measured); the
consumer (2 ranks, like a reward model) reads it and returns one small column. Through the
controller, the caller waits for the producer (``.get()``) and passes the DataProto on; through
a future, it passes the ``GroupFuture`` of a ``blocking=False`` method straight into the
consumer's call, so a backend that can hand rank i's output to rank i skips the controller.

Run it:

    .venv/bin/python -m pytest benchmarks/bench_chain.py --benchmark-only --benchmark-columns=median,iqr,ops
"""

from __future__ import annotations

import pytest
from workers import ROWS, Consumer, Producer

import spmdcall as sc

torch = pytest.importorskip("torch")
from spmdcall.data import DataProto  # noqa: E402 (needs torch)

WORLD = 2
OUT_BYTES_PER_ROW = 32 * 1024  # 32 MiB for 1024 rows
VIA_CONTROLLER = "through the controller (.get())"
ROUNDS = {"process": 40, "ray": 25}


@pytest.fixture(scope="module", params=["process", "ray"])
def chain(request):
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    with (
        sc.WorkerGroup(
            sc.ResourcePool([WORLD]), sc.ClassWithInitArgs(Producer, OUT_BYTES_PER_ROW), backend=request.param
        ) as producer,
        sc.WorkerGroup(
            sc.ResourcePool([WORLD]), sc.ClassWithInitArgs(Consumer), backend=request.param
        ) as consumer,
    ):
        yield request.param, producer, consumer


@pytest.fixture(scope="module")
def prompts():
    return DataProto.from_dict({"prompt": torch.arange(ROWS, dtype=torch.int64)})


def _through_future(producer, consumer, prompts):
    return consumer.consume(producer.produce(prompts))


def _through_controller(producer, consumer, prompts):
    return consumer.consume(producer.produce(prompts).get())


@pytest.mark.parametrize("path", ["future", "controller"])
def test_chain(case, chain, prompts, path):
    backend, producer, consumer = chain
    group = f"3{'ab'[backend == 'ray']}. chain producer -> consumer, 32 MiB, {backend}"
    expected = _through_controller(producer, consumer, prompts)  # also warms both groups
    if path == "future":
        bench = case(
            group,
            f"{backend}: through a GroupFuture",
            baseline=f"{backend}: {VIA_CONTROLLER}",
            target_ratio=1.0,
        )
    else:
        bench = case(group, f"{backend}: {VIA_CONTROLLER}")
    run = _through_future if path == "future" else _through_controller
    out = bench.pedantic(run, args=(producer, consumer, prompts), rounds=ROUNDS[backend], warmup_rounds=2)
    assert len(out) == ROWS and torch.equal(out.batch["score"], expected.batch["score"])
