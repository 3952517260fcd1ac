"""Faults while many threads drive a group: a dead rank fails every pending call, whoever made it;
restart and shutdown while others call never hang."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from concurrency_workers import Busy
from procs import alive
from test_threads import run_threads

import spmdcall as sc

pytestmark = pytest.mark.timeout(180)

DEATH_DEADLINE_S = {"process": 5.0, "ray": 30.0}


def test_a_rank_killed_with_50_calls_pending_from_8_threads(process_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Busy), backend=process_backend) as wg:
        pids = wg.pid()
        submitted = threading.Barrier(9)
        outcomes: list = []
        finished_at: list = []

        def calls(t: int) -> None:
            futures = [wg.sleep.submit(0.2) for _ in range(7 if t < 2 else 6)]  # 50 in all
            submitted.wait()
            for f in futures:
                try:
                    outcomes.append(f.get())
                except sc.WorkerDiedError as exc:
                    outcomes.append(exc)
            finished_at.append(time.monotonic())

        thread_errors: list = []
        runner = threading.Thread(target=lambda: thread_errors.extend(run_threads(calls, 8)))
        runner.start()
        submitted.wait()
        time.sleep(0.3)
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        runner.join(DEATH_DEADLINE_S[process_backend] + 30)
        assert not runner.is_alive() and thread_errors == []
        assert len(outcomes) == 50
        died = [o for o in outcomes if isinstance(o, sc.WorkerDiedError)]
        assert all(o == [0, 1] for o in outcomes if not isinstance(o, sc.WorkerDiedError))
        assert len(died) >= 40 and all(e.rank == 1 for e in died)
        assert max(finished_at) - killed_at < DEATH_DEADLINE_S[process_backend]
        wg.restart()
        assert wg.add(1, 2) == [(1, 2, 0), (1, 2, 1)]


def test_a_rank_killed_under_an_event_loop_then_restarted_from_it(process_backend):
    """50 calls awaited on a loop (which reads their replies itself, on process): the kill fails
    every one on the dead rank promptly; a restart made on the loop serves the next awaits."""
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Busy), backend=process_backend) as wg:
        pids = wg.pid()

        async def main():
            futures = [wg.sleep.submit(0.2) for _ in range(50)]
            await asyncio.sleep(0.3)
            os.kill(pids[1], signal.SIGKILL)
            killed_at = time.monotonic()
            outcomes = await asyncio.gather(*futures, return_exceptions=True)
            took = time.monotonic() - killed_at
            wg.restart()
            after = await asyncio.gather(*(wg.add.submit(t, 0) for t in range(20)))
            return outcomes, took, after

        outcomes, took, after = asyncio.run(main())
        died = [o for o in outcomes if isinstance(o, sc.WorkerDiedError)]
        assert len(died) >= 40 and all(e.rank == 1 for e in died)
        assert all(o == [0, 1] for o in outcomes if not isinstance(o, BaseException))
        assert took < DEATH_DEADLINE_S[process_backend]
        assert after == [[(t, 0, 0), (t, 0, 1)] for t in range(20)]


def test_shutdown_from_another_thread_while_a_loop_awaits(process_backend):
    """A loop in its own thread awaits calls while the main thread shuts the group down: the awaits
    fail at once, and the loop lets go of every descriptor it watched (no fd left open)."""
    fds_before = len(os.listdir("/proc/self/fd"))
    wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Busy), backend=process_backend)
    outcome: list = []
    started = threading.Event()

    async def awaits():
        assert await wg.add.submit(0, 0) == [(0, 0, 0), (0, 0, 1)]
        started.set()
        try:
            await asyncio.gather(*(wg.sleep.submit(5.0) for _ in range(8)))
        except (RuntimeError, sc.WorkerDiedError) as exc:
            outcome.append(exc)

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_until_complete, args=(awaits(),))
    runner.start()
    assert started.wait(30)
    time.sleep(0.2)
    start = time.monotonic()
    wg.shutdown()
    runner.join(30)
    assert not runner.is_alive() and time.monotonic() - start < 10
    assert len(outcome) == 1 and isinstance(outcome[0], sc.WorkerDiedError)
    loop.run_until_complete(asyncio.sleep(0))  # what shutdown left for the loop to do, done
    loop.close()
    if process_backend == "process":
        assert len(os.listdir("/proc/self/fd")) <= fds_before


def test_restart_while_other_threads_call(process_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Busy), backend=process_backend) as wg:
        stop = threading.Event()
        results: list = []

        def calls(t: int) -> None:
            i = 0
            while not stop.is_set():
                try:
                    results.append(wg.add(t, i) == [(t, i, 0), (t, i, 1)])
                except sc.WorkerDiedError:
                    results.append("died")  # a call that met the restart
                i += 1

        runner = threading.Thread(target=lambda: results.extend(run_threads(calls, 4)))
        runner.start()
        time.sleep(0.3)
        for _ in range(2):
            wg.restart([0])
            time.sleep(0.3)
        stop.set()
        runner.join(60)
        assert not runner.is_alive()
        assert False not in results and results.count(True) > 10
        assert wg.add(9, 9) == [(9, 9, 0), (9, 9, 1)]


def test_shutdown_while_other_threads_call(process_backend):
    wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Busy), backend=process_backend)
    pids = wg.pid()
    stop = threading.Event()
    errors: list = []

    def calls(t: int) -> None:
        while not stop.is_set():
            try:
                wg.sleep(0.01)
            except (RuntimeError, sc.WorkerDiedError) as exc:  # shut down under it, or before it
                errors.append(exc)
                return

    runner = threading.Thread(target=lambda: run_threads(calls, 4, join_s=30))
    runner.start()
    time.sleep(0.3)
    wg.shutdown()
    runner.join(40)
    stop.set()
    assert not runner.is_alive()
    assert len(errors) == 4
    if process_backend == "process":
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in pids)
