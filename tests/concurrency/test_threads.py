"""Many threads driving groups at once, beyond what the shipped suite checks on every backend
(spmdcall/testing/test_concurrency.py): floods of calls before any is waited for, the wake-up of a
thread waiting on two ranks, and the process backend's writers."""

from __future__ import annotations

import select

import numpy as np
import pytest
from concurrency_workers import Busy

import spmdcall as sc
from spmdcall.testing.test_concurrency import run_threads

pytestmark = pytest.mark.timeout(180)

NUM_THREADS = 8
CALLS_PER_THREAD = 12


@pytest.fixture(scope="module")
def busy(module_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Busy), backend=module_backend) as wg:
        yield wg


def test_thousands_of_calls_made_before_any_is_waited_for(busy, module_backend):
    """One thread makes 3000 calls, then collects them: on process, the workers' replies fill the
    sockets long before the last call goes out (at about 1000), so the controller reads them while
    it writes, else each side would wait for the other for ever. Two threads then do it at once."""
    wg = busy
    count = 1000 if module_backend == "ray" else 3000  # Ray is slower per call, and has no sockets of ours

    def flood(t: int) -> None:
        futures = [wg.add.submit(t, i) for i in range(count)]
        assert [f.get(timeout=60) for f in futures] == [[(t, i, 0), (t, i, 1)] for i in range(count)]

    assert run_threads(flood, 1, join_s=60) == []
    assert run_threads(flood, 2, join_s=60) == []


def test_a_thread_waiting_for_two_ranks_is_woken_once_both_replied_or_one_failed():
    from spmdcall.backends.futures import RankFutureBase, Waiter

    first, second = RankFutureBase(0, "ping"), RankFutureBase(1, "ping")
    waiter = Waiter(2)
    assert first.add_waiter(waiter) and second.add_waiter(waiter)
    first.settle("ok", 1)
    assert not waiter.wait(0), "woken by the first reply while the second is pending"
    second.settle("ok", 2)
    assert waiter.wait(0)

    first, second = RankFutureBase(0, "ping"), RankFutureBase(1, "ping")
    waiter = Waiter(2)
    assert first.add_waiter(waiter) and second.add_waiter(waiter)
    first.settle("error", sc.WorkerDiedError(0, "ping", "killed"))
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
    from spmdcall.backends.process.handles import WorkerHandle
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
