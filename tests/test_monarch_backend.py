"""The ``monarch`` backend (PyTorch Monarch actors), where ``spmdcall[monarch]`` is installed.

A smoke test of the path every call takes: start, a split call with its results merged, a rank's
error naming rank and method, and shutdown leaving no process; where each rank's Monarch log goes;
and Ctrl-C in a controller running a monarch group. The whole conformance suite runs
on monarch in tests/conformance (``SUITE_BACKENDS``), as ``python -m spmdcall.testing monarch``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pwd
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

import spmdcall as sc

pytest.importorskip("monarch.actor", reason="needs spmdcall[monarch] (torchmonarch)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Adder:
    def __init__(self, base: int):
        self.base = base

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE)
    def add(self, xs: list[int]) -> list[int]:
        return [x + self.base for x in xs]

    def fail(self) -> None:
        raise ValueError("no good")


def _ours() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.timeout(180)
def test_a_group_on_monarch_splits_merges_names_errors_logs_and_leaves_nothing(tmp_path):
    before = _ours()
    logs = tmp_path / "logs"
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Adder, 10), backend="monarch", log_dir=logs
    ) as wg:
        assert wg.world_size == 2
        assert wg.add([[1, 2], [3]]) == [[11, 12], [13]]
        with pytest.raises(sc.WorkerError) as raised:
            wg.fail()
        message = str(raised.value)
        assert "fail" in message and "no good" in message and "rank" in message
        # Monarch 0.7 writes a process's log to /tmp/<user>/monarch_log_<MONARCH_LOG_SUFFIX>.log:
        # each rank has a file of its own, named after the group and the rank, linked into log_dir.
        linked = [i["monarch_log"] for i in wg.worker_info()]
        user = pwd.getpwuid(os.getuid()).pw_name
        tmp_names = [f"/tmp/{user}/monarch_log_{os.path.basename(p)}" for p in linked]
        assert all(os.path.samefile(p, t) for p, t in zip(linked, tmp_names))  # one file, two names
        stopping = time.monotonic()
    # Monarch stops the processes in a second or two; the loop thread's end must not cost the whole
    # shutdown_timeout (10 s) on top, as it did when the loop stopped before handing back its result.
    assert time.monotonic() - stopping < 8.0
    assert [os.path.dirname(p) for p in linked] == [str(logs)] * 2
    assert [p.endswith(f"-rank{r}.log") for r, p in enumerate(linked)] == [True, True]
    user = pwd.getpwuid(os.getuid()).pw_name
    for path, tmp in zip(linked, tmp_names):
        assert tmp == f"/tmp/{user}/monarch_log_{os.path.basename(path)}"
        assert not os.path.exists(tmp)  # once the rank is gone its log is only in log_dir
        assert "spmdcall-adder" in open(path, errors="replace").read().lower()  # its actors' events
    assert (logs / "monarch-controller.log").exists()
    left = psutil.wait_procs([psutil.Process(p) for p in _ours() - before], timeout=15)[1]
    assert not left, f"processes left after shutdown: {[p.pid for p in left]}"


@pytest.mark.timeout(120)
def test_replies_nobody_waits_for_are_read_and_a_done_callback_comes_without_a_wait():
    import asyncio

    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Adder, 1), backend="monarch") as wg:
        # A call a thread waited for is not kept for the sweep once its result is let go of (first:
        # the futures below stay referenced, and may be in the sweep's list when this looks).
        for i in range(50):
            assert wg.add([[i], [i]]) == [[i + 1], [i + 1]]
        gc.collect()  # a strong reference from the sweep's list would outlive this
        assert all(ref() is None for ref in list(wg._backend._unobserved))
        # Fire and forget: the backend's loop thread reads the replies within watch_interval, so
        # nothing stays pending on the ranks (a waiting thread would read them itself).
        left = [wg.add.submit([[i], [i]]) for i in range(20)]
        states = wg._backend._ranks
        deadline = time.monotonic() + 10
        while any(w.pending for w in states) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(w.pending for w in states)
        assert all(f.done() for f in left) and left[7].get() == [[8], [8]]
        # done() reads a reply that has come, without waiting and without the loop thread
        polled = wg.add.submit([[5], [6]])
        deadline = time.monotonic() + 10
        while not polled.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert polled.done() and polled.get() == [[6], [7]]

        async def main():  # asyncio waits through done-callbacks: no thread waits for the ranks
            return await asyncio.gather(*(wg.add.submit([[i], [2 * i]]) for i in range(5)))

        assert asyncio.run(main()) == [[[i + 1], [2 * i + 1]] for i in range(5)]


class Log:
    def __init__(self):
        self.seen: list = []

    def note(self, x) -> None:  # unregistered: ONE_TO_ALL, the same argument on every rank
        self.seen.append(x)

    @sc.register(dispatch_mode=sc.Dispatch.ALL_TO_ALL)
    def note_each(self, x) -> None:
        self.seen.append(x)

    def size(self, x) -> int:
        return len(x)

    def log(self) -> list:
        return self.seen


@pytest.mark.timeout(180)
def test_a_call_with_the_same_arguments_is_cast_and_each_rank_runs_calls_in_the_order_sent(monkeypatch):
    from spmdcall.backends.monarch.backend import MonarchBackend

    cast = []
    send = MonarchBackend._cast
    monkeypatch.setattr(
        MonarchBackend, "_cast", lambda b, calls, s: cast.append(calls[0].method) or send(b, calls, s)
    )

    def interleaved(n: int) -> list[list]:
        # casts (note) and one message per rank (note_each) sent back to back without waiting
        futures = [wg.note.submit(i) if i % 3 else wg.note_each.submit([i, -1 - i]) for i in range(n)]
        for f in futures:
            f.get()
        return wg.log()

    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Log), backend="monarch") as wg:
        assert interleaved(90) == [list(range(90)), [i if i % 3 else -1 - i for i in range(90)]]
        assert cast.count("note") == 60 and "note_each" not in cast
        big = np.zeros(1 << 18, dtype=np.float32)  # 1 MiB of array: by shared memory, not cast
        assert wg.size(big) == [1 << 18] * 2 and "size" not in cast
        # a rank's actor runs a call only after every call numbered before it: sent out of order
        w = wg._backend._ranks[0]
        with w.lock:
            second = w.actor.run.call_one(w.sent + 1, (None, "note", ("second",), {}))
            first = w.actor.run.call_one(w.sent, (None, "note", ("first",), {}))
            w.sent += 2
        assert second.get(timeout=30)[0] == first.get(timeout=30)[0] == "pickle"  # a small result: its bytes
        assert wg.log()[0][-2:] == ["first", "second"]
        wg.restart([1])  # the group is no longer the mesh it started as: one message per rank
        cast.clear()
        logs = interleaved(30)
        assert logs[0][92:] == list(range(30)) and logs[1] == [i if i % 3 else -1 - i for i in range(30)]
        assert cast == []


class Slow:
    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, timeout=1.0)
    def nap(self, ready_dir: str) -> int:
        rank = int(os.environ["RANK"])
        if rank == 0:
            open(os.path.join(ready_dir, "napping"), "w").close()
            time.sleep(4.0)  # nap: rank 0 is still here
        return rank


@pytest.mark.timeout(180)
@pytest.mark.parametrize("waiter", ["thread", "asyncio"])
def test_a_cast_call_past_its_deadline_names_only_the_rank_still_running_it(tmp_path, waiter):
    """Monarch gathers a cast's replies, so rank 1's result would wait for rank 0's: past the
    call's deadline the backend reads the reply rank 1 kept, and the error names rank 0 alone
    (a thread's get() and an await alike), with where it is."""
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Slow), backend="monarch") as wg:
        future = wg.nap.submit(str(tmp_path))
        with pytest.raises(sc.CallTimeoutError) as info:
            if waiter == "thread":
                future.get()
            else:
                asyncio.run(_awaited(future))
        err = info.value
        assert (tmp_path / "napping").exists()
        assert err.pending_ranks == [0] and list(err.reports) == [0]
        assert any("nap: rank 0 is still here" in t for t in err.reports[0].threads.values())
        assert future.rank_futures[1].done() and not future.rank_futures[0].done()
        assert future.get(timeout=30) == [0, 1]  # rank 0's reply, gathered with rank 1's, still comes


async def _awaited(future):
    return await future


class Pid:
    def pid(self) -> int:
        return os.getpid()


@pytest.mark.timeout(180)
def test_without_log_dir_rank_logs_go_to_the_users_folder_and_a_restarted_rank_gets_its_own(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SPMDCALL_LOG_DIR", str(tmp_path / "state"))
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Pid), backend="monarch") as wg:
        first = [i["monarch_log"] for i in wg.worker_info()]
        before = wg.pid()
        wg.restart([1])  # a restarted rank writes a log of its own
        assert wg.pid()[1] != before[1]
        second = wg.worker_info()[1]["monarch_log"]
    names = sorted(os.listdir(tmp_path / "state"))
    assert [os.path.dirname(p) for p in (*first, second)] == [str(tmp_path / "state")] * 3
    assert names == sorted(os.path.basename(p) for p in (*first, second))  # no controller log here
    user = pwd.getpwuid(os.getuid()).pw_name
    assert not [n for n in names if os.path.exists(f"/tmp/{user}/monarch_log_{n}")]


class Arrays:
    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE)
    def twice(self, xs: list) -> list:
        return [x * 2 for x in xs]

    def echo(self, x):
        return x

    async def later(self, x):  # a class with an async method: its rank runs calls on an event loop
        await asyncio.sleep(0)
        return x + 1


def _counting(monkeypatch) -> tuple[list, list, list]:
    """What this process lends as RDMA buffers, gives back, and reads of what ranks lent."""
    from spmdcall.backends.monarch import rdma as monarch_rdma

    lent, dropped, fetched = [], [], []
    lend, drop, fetch = monarch_rdma.lend, monarch_rdma.Lent.drop, monarch_rdma.Lent.fetch
    monkeypatch.setattr(monarch_rdma, "lend", lambda e, key=0: lent.append(lend(e, key)) or lent[-1])
    monkeypatch.setattr(monarch_rdma.Lent, "drop", lambda self: dropped.append(self) or drop(self))
    monkeypatch.setattr(monarch_rdma.Lent, "fetch", lambda self: fetched.append(self) or fetch(self))
    return lent, dropped, fetched


@pytest.mark.timeout(180)
def test_large_values_to_ranks_on_other_hosts_go_as_rdma_buffers_and_are_given_back(monkeypatch):
    """Two Monarch hosts (``ProcessJob``: a host agent each, on this machine; without shared memory,
    as a second machine would be): large arguments and results cross as RDMA buffers (Monarch's
    TCP fallback here), read by the receiver, each given back once read; small ones in messages.
    The ranks run their calls on an event loop (``Arrays.later``), where a read blocks it."""
    import torch
    from monarch.job import ProcessJob

    from spmdcall.backends.monarch.backend import MonarchBackend

    with pytest.raises(ValueError, match="rdma must be True, False or None"):
        MonarchBackend(rdma="yes")
    before = _ours()
    lent, dropped, fetched = _counting(monkeypatch)
    job = ProcessJob({"hosts": 2})
    try:
        backend = MonarchBackend(host_mesh=job.state(cached_path=None).hosts, shared_memory=False, rdma=True)
        with sc.WorkerGroup(sc.ResourcePool([1, 1]), sc.ClassWithInitArgs(Arrays), backend=backend) as wg:
            assert [(i["shared_memory"], i["rdma"]) for i in wg.worker_info()] == [(False, True)] * 2
            a, b = np.arange(100_000, dtype=np.float64), np.ones((300, 300), dtype=np.float32)
            out = wg.twice([[a], [b]])  # a value per rank: each lent, each result lent back
            assert np.array_equal(out[0][0], 2 * a) and np.array_equal(out[1][0], 2 * b)
            assert (len(lent), len(fetched)) == (2, 2)
            x = torch.randn(1 << 18)
            assert all(torch.equal(y, x) for y in wg.echo(x))  # one value for both: lent once
            assert (len(lent), len(fetched)) == (3, 4)

            async def main():  # replies read on the backend's loop thread (their reads off it)
                return await asyncio.gather(*(wg.echo.submit(x * i) for i in range(3)))

            assert [[torch.equal(y, x * i) for y in ys] for i, ys in enumerate(asyncio.run(main()))] == [
                [True, True]
            ] * 3
            assert (len(lent), len(fetched)) == (6, 10)
            assert all(torch.equal(y, x + 1) for y in wg.later(x)) and (len(lent), len(fetched)) == (7, 12)
            assert wg.twice([[1], [2]]) == [[2], [4]] and (len(lent), len(fetched)) == (7, 12)
            # each argument given back once its calls were answered; the three submitted together
            # are answered, so given back, in whichever order their replies come
            assert sorted(map(id, dropped)) == sorted(map(id, lent))
            deadline = time.monotonic() + 10  # the ranks are told to give back what was read
            while (
                any(w.actor.num_lent.call_one().get() for w in backend._ranks) and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            assert [w.actor.num_lent.call_one().get() for w in backend._ranks] == [0, 0]
        # without RDMA hardware (ibverbs), rdma=None keeps large values in Monarch's messages,
        # which are faster than its TCP fallback
        with sc.WorkerGroup(
            sc.ResourcePool([2]), sc.ClassWithInitArgs(Arrays), backend="monarch", shared_memory=False
        ) as wg:
            assert [i["rdma"] for i in wg.worker_info()] == [False, False]
            assert all(torch.equal(y, x) for y in wg.echo(x)) and (len(lent), len(fetched)) == (7, 12)
    finally:
        job.kill()
    left = psutil.wait_procs(
        [psutil.Process(p) for p in _ours() - before if psutil.pid_exists(p)], timeout=15
    )[1]
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], f"left running: {left}"


CTRL_C = """
import os, signal, sys, time
# A program inherits an ignored or blocked SIGINT from the test runner; a terminal's starts with the
# default handler, as this one does (see tests/faults/test_faults.py).
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
import spmdcall as sc

class Sleeper:
    def sleep(self, ready_dir, seconds):
        open(os.path.join(ready_dir, os.environ["RANK"]), "w").close()
        time.sleep(seconds)

with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Sleeper), backend="monarch") as wg:
    wg.sleep(sys.argv[1], 60)
"""


@pytest.mark.timeout(60)
def test_ctrl_c_stops_the_controller_with_a_clear_message_and_leaves_no_process(tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", CTRL_C, str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        deadline = time.monotonic() + 45
        while len(os.listdir(ready)) < 2:  # both ranks are in the call: the controller waits on it
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert err.rstrip().splitlines()[-1] == "KeyboardInterrupt", err
    assert started and not psutil.wait_procs(started, timeout=10)[1], "processes left after Ctrl-C"


def test_shutdown_grace_is_the_name_process_and_ray_give_the_shutdown_wait():
    from spmdcall.backends.monarch.backend import MonarchBackend

    assert MonarchBackend(shutdown_grace=2.5).shutdown_timeout == 2.5  # as on process and ray
    assert MonarchBackend().shutdown_timeout == 10.0
    with pytest.raises(ValueError, match=r"shutdown_grace must be a positive number of seconds, got -1"):
        MonarchBackend(shutdown_grace=-1)
    with pytest.raises(ValueError, match=r"shutdown_timeout must be a positive number of seconds, got 0"):
        MonarchBackend(shutdown_timeout=0)
