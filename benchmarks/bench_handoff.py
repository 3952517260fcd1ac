"""11. What the controller's own CPU pays when one group's result goes into another group's call
(issue 67: the controller should move metadata only, so this should not grow with the bytes).

Each side is one call made with its full payload and with one 1000x smaller, on ``process``,
``ray`` and ``monarch`` (one node; skipped without torchmonarch), timed in interleaved rounds: the wall time, and the controller process's own CPU time for the call
(user + sys of every thread, ``getrusage``), beside a memcpy of the same bytes.

- 11a. A 2-rank group's 48 MiB result (a ``DataProto``) passed as a ``GroupFuture`` into a 2-rank
  group's call, the same split on both sides.
- 11b. Rank 0's 256 MiB dict of tensors (``execute_mode=RANK_ZERO``) passed into every rank of a
  2-rank group (``ONE_TO_ALL``).
- 11c. The 48 MiB result of 11a passed into a 3-rank group: a different split (1024 rows over 3
  ranks, so the consumer pads 2 rows as it would for the batch itself).

Run it:

    .venv/bin/python -m pytest benchmarks/bench_handoff.py --benchmark-only --benchmark-columns=median -s
"""

from __future__ import annotations

import functools
import resource
import statistics
import time
from collections.abc import Callable

import pytest
from workers import ROWS, Consumer, Producer, WeightsOwner, WeightsReader

import spmdcall as sc

torch = pytest.importorskip("torch")
from spmdcall.data import DataProto  # noqa: E402 (needs torch)

MIB = 1 << 20
ROUNDS = 10
CPUS = 0.25  # Ray's logical CPUs a rank reserves: four groups of a case fit the session's 4
GROUPS = {
    "chain": ("11a. a 48 MiB GroupFuture into a 2-rank group, same split", 48 * MIB),
    "weights": ("11b. rank 0's 256 MiB dict into every rank of a 2-rank group", 256 * MIB),
    "resplit": ("11c. a 48 MiB GroupFuture of 2 ranks into a 3-rank group", 48 * MIB),
}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _memcpy(nbytes: int) -> Callable[[], None]:
    # numpy's copy, one thread: torch's would leave its OpenMP threads spinning in this process
    # after it, and their CPU would count as the next side's
    import numpy as np

    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def _measure(bench, sides: dict[str, Callable[[], None]], spec: dict[str, dict]) -> None:
    walls: dict[str, list[float]] = {label: [] for label in sides}
    cpus: dict[str, list[float]] = {label: [] for label in sides}

    def one_round() -> None:
        for label, fn in sides.items():
            cpu, start = _cpu_s(), time.perf_counter()
            fn()
            walls[label].append(time.perf_counter() - start)
            cpus[label].append(_cpu_s() - cpu)

    bench.pedantic(one_round, rounds=ROUNDS, warmup_rounds=2)
    bench.extra_info["sides"] = [
        {
            "label": label,
            "times": walls[label][2:],
            "controller_cpu_s": cpus[label][2:],
            **spec.get(label, {}),
        }
        for label in sides
    ]
    print()
    for label in sides:
        wall, cpu = statistics.median(walls[label][2:]), statistics.median(cpus[label][2:])
        print(f"{label:44s} wall {wall * 1e3:8.1f} ms   controller CPU {cpu * 1e3:7.1f} ms")


def _handoff(
    case,
    group: str,
    call: str,
    make: Callable[[int], tuple[type, tuple, type]],
    run,
    consumer_ranks: int = 2,
    backend: str = "process",
) -> None:
    """The sides of one group: a memcpy of the full payload, then ``run(producer, consumer)`` with
    the full payload and with one 1000x smaller (``make(nbytes)``: the producer's class and
    arguments, the consumer's class); the producer has 2 ranks, the consumer ``consumer_ranks``."""
    title, full = GROUPS[group]
    title = f"{title}, {backend}"
    memcpy = f"memcpy of {full // MIB} MiB"
    sides: dict[str, Callable[[], None]] = {memcpy: _memcpy(full)}
    groups: list[sc.WorkerGroup] = []
    try:
        for name, nbytes in (("full", full), ("1000x smaller", full // 1000)):
            producer_cls, producer_args, consumer_cls = make(nbytes)
            groups.append(
                sc.WorkerGroup(
                    sc.ResourcePool([2], num_cpus_per_worker=CPUS),
                    sc.ClassWithInitArgs(producer_cls, *producer_args),
                    backend=backend,
                )
            )
            groups.append(
                sc.WorkerGroup(
                    sc.ResourcePool([consumer_ranks], num_cpus_per_worker=CPUS),
                    sc.ClassWithInitArgs(consumer_cls),
                    backend=backend,
                )
            )
            sides[f"{call}, {name} ({nbytes / MIB:.3g} MiB)"] = functools.partial(run, *groups[-2:])
        spec = {side: {"baseline": memcpy} for side in sides if side != memcpy}
        _measure(case(title, "one round of every side"), sides, spec)
    finally:
        for g in groups:
            g.shutdown()


@pytest.fixture
def backend(request):
    """The backend of the case; Ray's session (the cases needing it run last), Monarch if installed."""
    name = request.param
    if name == "ray":
        request.getfixturevalue("ray_session")
    if name == "monarch":
        pytest.importorskip("monarch.actor", reason="needs spmdcall[monarch] (torchmonarch)")
    return name


@pytest.mark.parametrize("backend", ["process", "ray", "monarch"], indirect=True)
def test_chain_same_split(case, backend):
    prompts = DataProto.from_dict({"prompt": torch.arange(ROWS, dtype=torch.int64)})
    _handoff(
        case,
        "chain",
        "GroupFuture",
        lambda nbytes: (Producer, (nbytes // ROWS,), Consumer),
        lambda producer, consumer: consumer.consume(producer.produce(prompts)),
        backend=backend,
    )


@pytest.mark.parametrize("backend", ["process", "ray", "monarch"], indirect=True)
def test_rank_zero_to_all(case, backend):
    _handoff(
        case,
        "weights",
        "RANK_ZERO -> ONE_TO_ALL",
        lambda nbytes: (WeightsOwner, (nbytes,), WeightsReader),
        lambda owner, reader: reader.load(owner.export()),
        backend=backend,
    )


@pytest.mark.parametrize("backend", ["process", "ray", "monarch"], indirect=True)
def test_chain_different_split(case, backend):
    prompts = DataProto.from_dict({"prompt": torch.arange(ROWS, dtype=torch.int64)})
    _handoff(
        case,
        "resplit",
        "GroupFuture, 2 -> 3 ranks",
        lambda nbytes: (Producer, (nbytes // ROWS,), Consumer),
        lambda producer, consumer: consumer.consume(producer.produce(prompts)),
        consumer_ranks=3,
        backend=backend,
    )
