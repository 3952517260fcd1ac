"""Groups driven from asyncio, beyond what the shipped suite checks on every backend
(spmdcall/testing/test_concurrency.py): floods of calls in one step, a loop keeping two groups
busy, and what cancelled awaits leave behind on process."""

from __future__ import annotations

import asyncio
import time

import pytest
from concurrency_workers import AsyncBusy, Busy

import spmdcall as sc

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def group(module_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(AsyncBusy), backend=module_backend) as wg:
        yield wg


def test_gather_of_thousands_of_calls_made_in_one_step(group, module_backend):
    """The loop makes every call before it reads a reply: on process, the controller reads the
    replies while its writes wait for the workers to read (they stop reading while they cannot
    reply; 5000 calls hung before)."""
    count = 1000 if module_backend == "ray" else 8000  # Ray is slower per call, and has no sockets of ours

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(group.add.submit(1, i) for i in range(count))), 60)

    assert asyncio.run(main()) == [[(1, i, 0), (1, i, 1)] for i in range(count)]


def test_cancelled_awaits_leave_no_call_pending_on_process():
    """The suite's test_wait_for_and_cancellation_leave_the_group_usable, and on process: the
    cancelled calls' replies were read and let go of."""
    wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Busy), backend="process")

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
    deadline = time.monotonic() + 5
    while any(h.pending for h in wg._backend._handles) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(h.pending for h in wg._backend._handles)
    wg.shutdown()


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
