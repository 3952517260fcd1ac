"""A group is shared freely: threads and event loops call it at once, each call gets its own
result and its own deadline; futures are awaitable; ``async def`` methods overlap on a rank while
calls to one rank start in the order they were made."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time

import pytest

import spmdcall as sc
from spmdcall.testing.plugin import runs_calls_in_submit
from spmdcall.testing.workers import Counter, Recorder, Sleeper

pytestmark = pytest.mark.timeout(180)


def run_threads(target, num_threads: int, join_s: float = 90.0) -> list:
    """Run ``target(t)`` in ``num_threads`` threads; their exceptions, after all have finished."""
    errors: list = []

    def body(t: int) -> None:
        try:
            target(t)
        except BaseException as exc:  # reported below, with the thread's number
            errors.append((t, exc))

    threads = [threading.Thread(target=body, args=(t,), daemon=True) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + join_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t for t, thread in enumerate(threads) if thread.is_alive()]
    assert not stuck, f"threads {stuck} still waiting after {join_s:g} s: a lost wake-up"
    return errors


@pytest.fixture(scope="module")
def on_loop(spmd_backend):
    """A group whose ranks serve calls on an event loop (its class has ``async def`` methods)."""
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Sleeper), backend=spmd_backend) as wg:
        yield wg


@pytest.fixture(scope="module")
def plain_pair(spmd_backend):
    """Two groups of plain workers (no async methods), for calls between groups."""
    pool = sc.ResourcePool([2])
    with (
        sc.WorkerGroup(pool, sc.ClassWithInitArgs(Counter), backend=spmd_backend) as first,
        sc.WorkerGroup(pool, sc.ClassWithInitArgs(Counter), backend=spmd_backend) as second,
    ):
        yield first, second


def test_non_blocking_call_returns_group_future(plain_pair):
    first, _ = plain_pair
    first.set_each([1, 1])
    future = first.slow_add(2, delay=0.3)  # registered blocking=False
    assert isinstance(future, sc.GroupFuture)
    assert future.get() == [3, 3]
    assert future.done() and future.get() == [3, 3]
    assert first.add.submit(1).get(timeout=60) == [4, 4]  # any method, with .submit


def test_gather_of_200_calls_each_get_their_own_result(on_loop):
    async def main():
        return await asyncio.gather(*(on_loop.add.submit(0, i) for i in range(200)))

    assert asyncio.run(main()) == [[(0, i, 0), (0, i, 1)] for i in range(200)]


def test_200_async_calls_overlap_on_every_rank(on_loop):
    on_loop.reset()

    async def main():
        start = time.monotonic()
        out = await asyncio.gather(*(on_loop.nap.submit(1.0, i) for i in range(200)))
        return out, time.monotonic() - start

    out, elapsed = asyncio.run(main())
    assert out == [[(i, 0), (i, 1)] for i in range(200)]
    assert elapsed < 20.0  # one after another: 200 s
    assert min(on_loop.peak()) >= 50  # many ran at once on each rank (all 200 on a quiet machine)


def test_max_concurrency_one_runs_calls_one_at_a_time(on_loop):
    async def main():
        await asyncio.gather(*(on_loop.nap_in_turn.submit(0.05) for _ in range(6)))

    on_loop.reset()
    asyncio.run(main())
    assert on_loop.peak() == [1, 1]


def test_plain_and_async_calls_start_in_the_order_they_were_made(on_loop):
    on_loop.reset()
    futures = []
    for i in range(30):
        futures.append(on_loop.nap.submit(0.01, tag=i) if i % 3 == 0 else on_loop.add.submit(0, i))
    for f in futures:
        f.get(timeout=60)
    for log in on_loop.order():
        assert [entry[1] for entry in log] == list(range(30))


def test_awaiting_never_blocks_the_event_loop(on_loop):
    """While a 1 s call runs, a task on the same loop keeps ticking every 10 ms."""

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        out = await on_loop.sleep.submit(1.0)
        ticker.cancel()
        return out, ticks

    out, ticks = asyncio.run(main())
    assert out == [0, 1] and ticks > 40


def test_await_a_non_blocking_method_and_a_data_proto_call(plain_pair):
    if not _have_data_proto():
        pytest.skip("DataProto needs torch and tensordict: pip install 'spmdcall[torch]'")
    first, _ = plain_pair

    async def main():
        done = await first.double_async(_rows_of(1.0))  # registered blocking=False: a GroupFuture
        submitted = await first.plus_one.submit(_rows_of(2.0))
        return done, submitted

    done, submitted = asyncio.run(main())
    assert bool((done.batch["x"] == 2.0).all()) and bool((submitted.batch["x"] == 3.0).all())


def test_the_call_timeout_applies_to_an_await(on_loop):
    async def main():
        start = time.monotonic()
        with pytest.raises(sc.CallTimeoutError, match=r"hang\(\) did not finish within 1 s"):
            await on_loop.hang.submit(1.5)  # register(timeout=1.0)
        return time.monotonic() - start

    assert 0.9 < asyncio.run(main()) < 2.0


def test_wait_for_and_cancellation_leave_the_group_usable(on_loop):
    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(on_loop.sleep.submit(0.6), 0.1)
        task = asyncio.create_task(_await())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await on_loop.add.submit(1, 2)

    async def _await():
        return await on_loop.sleep.submit(0.3)

    assert asyncio.run(main()) == [(1, 2, 0), (1, 2, 1)]
    assert on_loop.add(3, 4) == [(3, 4, 0), (3, 4, 1)]


def test_threads_mixing_modes_each_get_their_own_result(plain_pair):
    """8 threads x 12 calls in ONE_TO_ALL, ALL_TO_ALL/DP_COMPUTE and RANK_ZERO on two groups; with
    torch, DP_COMPUTE_PROTO with 1 MiB batches and a future of one group passed into the other's call."""
    first, second = plain_pair
    with_data = _have_data_proto()

    def calls(t: int) -> None:
        for i in range(12):
            key = t * 1000 + i
            kind = i % 4
            if kind == 0:
                assert first.append_to([key]) == [[key, 0], [key, 1]]
            elif kind == 1:
                assert second.scaled([key, key + 1]) == [key * second_n[0], (key + 1) * second_n[1]]
            elif kind == 2 and with_data:
                out = first.double(_rows_of(key))
                assert len(out) == 64 and bool((out.batch["x"] == 2 * key).all())
                assert list(out.non_tensor_batch["seen_by"]) == [0] * 32 + [1] * 32
            elif kind == 3 and with_data:  # rank i's output goes to rank i of the other group
                out = second.plus_one(first.double_async(_rows_of(key)))
                assert bool((out.batch["x"] == 2 * key + 1).all())
            else:
                assert first.only_zero(key) == (0, key + first_n[0])
                assert second.execute_rank_zero("get") == second_n[0]

    first_n, second_n = first.set_each([3, 4]), second.set_each([5, 6])
    assert run_threads(calls, 8) == []


def _have_data_proto() -> bool:
    return all(importlib.util.find_spec(package) for package in ("torch", "tensordict"))


def _rows_of(value: float):
    """64 rows of 4096 float32 (1 MiB), all ``value``."""
    import torch

    from spmdcall import DataProto

    return DataProto.from_dict({"x": torch.full((64, 4096), float(value))})


def test_event_loops_and_blocking_threads_share_one_group(on_loop):
    async def gathered(t: int) -> list:
        return await asyncio.gather(*(on_loop.add.submit(t, i) for i in range(60)))

    def calls(t: int) -> None:
        if t < 2:
            assert asyncio.run(gathered(t)) == [[(t, i, 0), (t, i, 1)] for i in range(60)]
        else:
            assert [on_loop.add(t, i) for i in range(30)] == [[(t, i, 0), (t, i, 1)] for i in range(30)]

    assert run_threads(calls, 6) == []


def test_futures_made_in_one_thread_are_collected_in_another(on_loop):
    futures = [on_loop.add.submit(0, i) for i in range(40)]
    results: dict = {}

    def collect(t: int) -> None:
        for i in range(t, len(futures), 4):
            results[i] = futures[i].get(timeout=60)

    assert run_threads(collect, 4) == []
    assert [results[i] for i in range(40)] == [[(0, i, 0), (0, i, 1)] for i in range(40)]


def test_one_future_waited_on_by_many_threads_is_collected_once(plain_pair):
    first, _ = plain_pair
    future = first.append_to.submit([1])
    seen: list = []
    assert run_threads(lambda t: seen.append(future.get(timeout=60)), 6) == []
    assert all(out is seen[0] for out in seen)  # the same collected result, not six
    assert seen[0] == [[1, 0], [1, 1]]


@pytest.mark.parametrize("event_loop", [False, True], ids=["plain", "event-loop"])
def test_calls_to_one_rank_run_in_the_order_they_were_made(spmd_backend, event_loop):
    worker = Sleeper if event_loop else Recorder
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(worker), backend=spmd_backend) as wg:
        payload = bytearray(1 << 20)

        def calls(t: int) -> None:
            for i in range(25):  # every third call carries 1 MiB
                if i % 3 == 2:
                    wg.execute_all_async("add_with", t, i, payload)
                else:
                    wg.execute_all_async("add", t, i)
            wg.execute_all("add", t, 25)

        assert run_threads(calls, 4) == []
        for log in wg.order():
            for t in range(4):  # each thread's calls, in its order, interleaved with the others'
                assert [i for (u, i) in log if u == t] == list(range(26))


def test_each_thread_waits_with_its_own_timeout(spmd_backend):
    """Calls queued behind a long one: each thread's timeout runs from its own call."""
    with sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Recorder), backend=spmd_backend) as wg:
        if runs_calls_in_submit(wg):
            pytest.skip(
                "a plain call has finished when the call returns (as on inline): no deadline can apply"
            )
        wg.execute_all_async("sleep", 1.5)  # occupies the rank
        outcomes: dict = {}

        def call(t: int) -> None:
            start = time.monotonic()
            try:
                outcomes[t] = wg.execute_all_async("sleep", 0.0).get(timeout=0.3 if t % 2 else 5.0)
            except sc.CallTimeoutError:
                outcomes[t] = ("timeout", time.monotonic() - start)

        assert run_threads(call, 6) == []
        for t, outcome in outcomes.items():
            if t % 2:
                assert outcome[0] == "timeout" and outcome[1] < 1.0, outcome
            else:
                assert outcome == [0]
