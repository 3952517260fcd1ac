"""Many threads driving groups at once: every call gets its own result, in every dispatch mode."""

from __future__ import annotations

import asyncio
import select
import threading
import time

import numpy as np
import pytest
import torch
from concurrency_workers import AsyncBusy, Busy, rows

import spmdcall as sc

pytestmark = pytest.mark.timeout(180)

NUM_THREADS = 8
CALLS_PER_THREAD = 12


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
def groups(module_backend):
    """Two groups of Busy and one of AsyncBusy, shared by the module's tests on one backend."""
    pool = sc.ResourcePool([2])
    with (
        sc.WorkerGroup(pool, sc.ClassWithInitArgs(Busy), backend=module_backend) as first,
        sc.WorkerGroup(pool, sc.ClassWithInitArgs(Busy), backend=module_backend) as second,
        sc.WorkerGroup(pool, sc.ClassWithInitArgs(AsyncBusy), backend=module_backend) as on_loop,
    ):
        yield first, second, on_loop


def test_threads_mixing_every_mode_each_get_their_own_result(groups):
    """8 threads x 12 calls: ONE_TO_ALL, ALL_TO_ALL, DP_COMPUTE_PROTO with 1 MiB tensors, and a
    future of one group passed into a second group's call, all on the same two groups."""
    first, second, _ = groups

    def calls(t: int) -> None:
        for i in range(CALLS_PER_THREAD):
            key = t * 1000 + i
            kind = i % 4
            if kind == 0:
                assert first.add(t, i) == [(t, i, 0), (t, i, 1)]
            elif kind == 1:
                assert second.each([key, key + 1]) == [key * 10, (key + 1) * 10 + 1]
            elif kind == 2:
                out = first.scale(rows(key))
                assert len(out) == 64 and torch.all(out.batch["x"] == 2 * key)
                assert out.batch["rank"].tolist() == [0] * 32 + [1] * 32
            else:  # rank i's output goes to rank i of the other group
                out = second.scale(first.plus_one(rows(key)))
                assert torch.all(out.batch["x"] == 2 * (key + 1))

    assert run_threads(calls, NUM_THREADS) == []


def test_event_loops_and_blocking_threads_share_one_group(groups):
    """Two threads each run an event loop gathering calls while four threads make blocking calls
    of the same group: whoever reads the replies, every call gets its own."""
    wg = groups[0]

    async def gathered(t: int) -> list:
        return await asyncio.gather(*(wg.add.submit(t, i) for i in range(60)))

    def calls(t: int) -> None:
        if t < 2:
            assert asyncio.run(gathered(t)) == [[(t, i, 0), (t, i, 1)] for i in range(60)]
        else:
            assert [wg.add(t, i) for i in range(30)] == [[(t, i, 0), (t, i, 1)] for i in range(30)]

    assert run_threads(calls, 6) == []


def test_futures_made_in_one_thread_are_collected_in_another(groups):
    wg = groups[0]
    futures = [wg.add.submit(0, i) for i in range(40)]
    results: dict = {}

    def collect(t: int) -> None:
        for i in range(t, len(futures), 4):
            results[i] = futures[i].get(timeout=60)

    assert run_threads(collect, 4) == []
    assert [results[i] for i in range(40)] == [[(0, i, 0), (0, i, 1)] for i in range(40)]


def test_one_future_waited_on_by_many_threads_is_collected_once(groups):
    wg = groups[0]
    future = wg.scale.submit(rows(3.0))
    seen: list = []
    assert run_threads(lambda t: seen.append(future.get(timeout=60)), 6) == []
    assert all(out is seen[0] for out in seen)  # the same collected result, not six
    assert torch.all(seen[0].batch["x"] == 6.0)


@pytest.mark.parametrize("which", [0, 2], ids=["plain", "event-loop"])
def test_calls_to_one_rank_run_in_the_order_they_were_made(groups, which):
    """Every third call carries 1 MiB: on process it is written by its own thread, with the
    descriptor of its shared memory, while the small calls of other threads wait to go out together."""
    wg = groups[which]
    wg.reset()
    payload = np.ones(1 << 18, dtype=np.float32)

    def calls(t: int) -> None:
        for i in range(25):
            if i % 3 == 2:
                wg.add_with.submit(t, i, payload)
            else:
                wg.add.submit(t, i)
        wg.add(t, 25)

    assert run_threads(calls, 4) == []
    for log in wg.order():
        for t in range(4):  # each thread's calls, in its order, interleaved with the others'
            assert [i for (u, i) in log if u == t] == list(range(26))


def test_thousands_of_calls_made_before_any_is_waited_for(groups, module_backend):
    """One thread makes 3000 calls, then collects them: on process, the workers' replies fill the
    sockets long before the last call goes out (at about 1000), so the controller reads them while
    it writes, else each side would wait for the other for ever. Two threads then do it at once."""
    wg = groups[0]
    count = 1000 if module_backend == "ray" else 3000  # Ray is slower per call, and has no sockets of ours

    def flood(t: int) -> None:
        futures = [wg.add.submit(t, i) for i in range(count)]
        assert [f.get(timeout=60) for f in futures] == [[(t, i, 0), (t, i, 1)] for i in range(count)]

    assert run_threads(flood, 1, join_s=60) == []
    assert run_threads(flood, 2, join_s=60) == []


def test_timeout_counts_from_the_call_not_from_the_wait(groups):
    """``slow`` has register(timeout=1.0): waiting for it 0.8 s after the call leaves 0.2 s."""
    wg = groups[1]
    if wg._backend.name == "inline":
        pytest.skip("an inline call runs inside the call itself: there is no waiting after it")
    future = wg.slow.submit(1.5)
    time.sleep(0.8)
    start = time.monotonic()
    with pytest.raises(sc.CallTimeoutError, match=r"slow\(\) did not finish within 1 s"):
        future.get()
    assert time.monotonic() - start < 0.7


def test_each_thread_waits_with_its_own_timeout(process_backend):
    """Calls queued behind a long one: each thread's timeout runs from its own call."""
    with sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Busy), backend=process_backend) as wg:
        wg.sleep.submit(1.5)  # occupies the rank
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


def test_a_thread_waiting_for_two_ranks_is_woken_once_both_replied_or_one_failed():
    from spmdcall.backends.futures import RankFutureBase, Waiter

    first, second = RankFutureBase(0, "ping"), RankFutureBase(1, "ping")
    waiter = Waiter(2)
    assert first._add_waiter(waiter) and second._add_waiter(waiter)
    first._settle("ok", 1)
    assert not waiter.wait(0), "woken by the first reply while the second is pending"
    second._settle("ok", 2)
    assert waiter.wait(0)

    first, second = RankFutureBase(0, "ping"), RankFutureBase(1, "ping")
    waiter = Waiter(2)
    assert first._add_waiter(waiter) and second._add_waiter(waiter)
    first._settle("error", sc.WorkerDiedError(0, "ping", "killed"))
    assert waiter.wait(0), "a failure must wake the thread at once: its wait raises it"


@pytest.mark.parametrize("leave_to_writer", [True, False], ids=["go-on", "wait-until-written"])
def test_threads_whose_calls_another_thread_writes(leave_to_writer):
    """On process, a thread that finds another writing to a worker leaves its call to that writer
    and goes on (where the workers share the controller's cores), or waits until it is written
    (where the controller has cores to spare). Both ways, 8 threads of small calls, calls with
    1 MiB of shared memory among them, and floods of calls made before any is waited for each
    get their own results."""
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Busy), backend="process") as wg:
        for handle in wg._backend._handles:
            handle.leave_to_writer = leave_to_writer
        payload = np.ones(1 << 18, dtype=np.float32)

        def calls(t: int) -> None:
            for i in range(30):
                if i % 10 == 9:
                    assert wg.add_with(t, i, payload) == [(t, i, 0), (t, i, 1)]
                else:
                    assert wg.add(t, i) == [(t, i, 0), (t, i, 1)]
            futures = [wg.add.submit(t, i) for i in range(600)]
            assert [f.get(timeout=60) for f in futures] == [[(t, i, 0), (t, i, 1)] for i in range(600)]

        assert run_threads(calls, NUM_THREADS, join_s=60) == []


@pytest.mark.parametrize("leave_to_writer", [True, False], ids=["go-on", "wait-until-written"])
def test_a_call_held_as_the_writer_lets_go_is_written_all_the_same(leave_to_writer):
    """The writer to a worker lets go, then looks for frames held meanwhile. A thread that found it
    writing, but holds its frame only after that look, must write the frame itself, not leave it
    held with nobody to write it (the call would never run)."""
    import socket

    from spmdcall.backends.futures import RankFutureBase
    from spmdcall.backends.process_handles import WorkerHandle
    from spmdcall.transport import frames
    from spmdcall.transport.channel import Channel

    ours, theirs = socket.socketpair()
    sender, receiver = Channel(ours), Channel(theirs)
    handle = WorkerHandle(None, None, sender, leave_to_writer=leave_to_writer)
    hold_frame = sender.hold_frame

    def writer_lets_go_first(frame, call_id):
        handle.writing = False  # the writer, done, lets go and looks: nothing held yet
        assert not sender.holding()
        hold_frame(frame, call_id)

    try:
        handle.writing = True  # another thread writes
        sender.hold_frame = writer_lets_go_first
        handle.send(RankFutureBase(0, "ping"), frames.encode(("ping", 1)))
        assert select.select([theirs], [], [], 5.0)[0], "the call was left held, never written"
        assert receiver.recv() == (1, ("ping", 1))
        assert not handle.writing and not sender.holding()
    finally:
        sender.close()
        receiver.close()
