"""Groups driven from asyncio: futures are awaitable, never block the loop, and cancel cleanly."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from concurrency_workers import AsyncBusy, Busy, rows

import spmdcall as sc

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def group(module_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(AsyncBusy), backend=module_backend) as wg:
        yield wg


def test_gather_of_200_calls_each_get_their_own_result(group):
    async def main():
        return await asyncio.gather(*(group.add.submit(0, i) for i in range(200)))

    assert asyncio.run(main()) == [[(0, i, 0), (0, i, 1)] for i in range(200)]


def test_gather_of_thousands_of_calls_made_in_one_step(group, module_backend):
    """The loop makes every call before it reads a reply: on process, the controller reads the
    replies while its writes wait for the workers to read (they stop reading while they cannot
    reply; 5000 calls hung before)."""
    count = 1000 if module_backend == "ray" else 8000  # Ray is slower per call, and has no sockets of ours

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(group.add.submit(1, i) for i in range(count))), 60)

    assert asyncio.run(main()) == [[(1, i, 0), (1, i, 1)] for i in range(count)]


def test_await_a_non_blocking_method_and_a_data_proto_call(group):
    async def main():
        first = await group.plus_one(rows(1.0))  # registered blocking=False: a GroupFuture
        second = await group.scale.submit(rows(2.0))
        return first, second

    first, second = asyncio.run(main())
    assert torch.all(first.batch["x"] == 2.0) and torch.all(second.batch["x"] == 4.0)


def test_200_async_calls_overlap_on_every_rank(group):
    group.reset()

    async def main():
        start = time.monotonic()
        out = await asyncio.gather(*(group.nap.submit(1.0, i) for i in range(200)))
        return out, time.monotonic() - start

    out, elapsed = asyncio.run(main())
    assert out == [[(i, 0), (i, 1)] for i in range(200)]
    assert elapsed < 20.0  # one after another: 200 s (the benchmark measures the real figure)
    assert min(group.peak()) >= 50  # many ran at once on each rank (all 200 on a quiet machine)


def test_max_concurrency_one_runs_calls_one_at_a_time(group):
    async def main():
        await asyncio.gather(*(group.nap_in_turn.submit(0.05) for _ in range(6)))

    group.reset()
    asyncio.run(main())
    assert group.peak() == [1, 1]


def test_plain_and_async_calls_start_in_the_order_they_were_made(group):
    group.reset()
    futures = []
    for i in range(30):
        futures.append(group.nap.submit(0.01, tag=i) if i % 3 == 0 else group.add.submit(0, i))
    for f in futures:
        f.get(timeout=60)
    for log in group.order():
        assert [entry[1] for entry in log] == list(range(30))


def test_an_async_method_that_raises_names_rank_method_and_line(group):
    async def main():
        await group.broken.submit("fly")

    with pytest.raises(
        sc.WorkerError, match=r"rank [01] raised in broken\(\): ValueError: cannot fly"
    ) as info:
        asyncio.run(main())
    assert "concurrency_workers.py" in info.value.remote_traceback
    assert group.add(0, 1) == [(0, 1, 0), (0, 1, 1)]  # and the group goes on


@pytest.fixture(scope="module")
def busy(module_process_backend):
    """A group of plain workers on each backend whose ranks are processes."""
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Busy), backend=module_process_backend
    ) as wg:
        yield wg


def test_awaiting_never_blocks_the_event_loop(busy):
    """While a 1 s call runs, a task on the same loop keeps ticking every 10 ms."""
    wg = busy

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        out = await wg.sleep.submit(1.0)
        ticker.cancel()
        return out, ticks

    out, ticks = asyncio.run(main())
    assert out == [0, 1] and ticks > 40


def test_wait_for_and_cancellation_leave_the_group_usable(busy):
    wg = busy

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(wg.sleep.submit(0.6), 0.1)
        task = asyncio.create_task(_await(wg))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await wg.add.submit(1, 2)

    async def _await(group):
        return await group.sleep.submit(0.3)

    assert asyncio.run(main()) == [(1, 2, 0), (1, 2, 1)]
    assert wg.add(3, 4) == [(3, 4, 0), (3, 4, 1)]
    if wg._backend.name == "process":  # the cancelled calls' replies were read and let go of
        deadline = time.monotonic() + 5
        while any(h.pending for h in wg._backend._handles) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(h.pending for h in wg._backend._handles)


def test_the_call_timeout_applies_to_an_await(busy):
    wg = busy

    async def main():
        start = time.monotonic()
        with pytest.raises(sc.CallTimeoutError, match=r"slow\(\) did not finish within 1 s"):
            await wg.slow.submit(1.5)
        return time.monotonic() - start

    assert 0.9 < asyncio.run(main()) < 2.0


def test_one_loop_keeps_two_groups_busy_at_once(process_backend, tmp_path):
    pool = sc.ResourcePool([1])
    with (
        sc.WorkerGroup(pool, sc.ClassWithInitArgs(Busy), backend=process_backend) as a,
        sc.WorkerGroup(pool, sc.ClassWithInitArgs(Busy), backend=process_backend) as b,
    ):

        async def main():
            start = time.monotonic()
            await asyncio.gather(*(g.sleep.submit(0.5) for g in (a, b, a, b)))
            return time.monotonic() - start

        assert asyncio.run(main()) < 1.8  # in turn: 2 s

        # A call made on a loop goes out when the loop's step ends, or when any thread waits first:
        # here the loop itself blocks on b's call, which can only finish once a's call has run.
        async def blocks_on_the_other_group():
            a.mark.submit(str(tmp_path / "mark"))
            return b.wait_for_mark(str(tmp_path / "mark"), 5.0)

        assert asyncio.run(blocks_on_the_other_group()) == [True]
