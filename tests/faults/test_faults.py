"""Fault injection: every fault becomes a prompt, precise error; nothing is lost or left running.

Parametrized over the backends where the fault makes sense: ``backend`` is inline/process/ray,
``process_backend`` only those whose ranks are real processes.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from procs import alive, run_controller, wait_gone

import spmdcall as sc
from spmdcall import DataProto

pytestmark = pytest.mark.timeout(180)

# How fast a killed worker must be reported, per backend.
DEATH_DEADLINE_S = {"process": 5.0, "ray": 30.0}


class Faulty(sc.Worker):
    def __init__(self, value=0):
        self.value = value
        self.calls = 0

    def fail_on(self, rank):
        self.calls += 1
        if self.rank == rank:
            raise ValueError(f"rank {self.rank} refuses")
        return self.rank

    @sc.register(dispatch_mode=sc.Dispatch.ALL_TO_ALL)
    def set_each(self, values):
        self.value = values

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def echo(self, batch):
        return batch

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, timeout=1.0)
    def hang(self, seconds):
        time.sleep(seconds)
        return seconds

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    def pid(self):
        return os.getpid()

    def get(self):
        return self.value

    def unpicklable(self):
        return threading.Lock()


def batch_of(n):
    return DataProto.from_dict({"x": torch.arange(float(n))})


@pytest.fixture(scope="module")
def shared_group(module_backend):
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Faulty, value=1), backend=module_backend
    ) as wg:
        yield wg


@pytest.fixture
def group(shared_group):
    """A 2-rank Faulty(value=1) group, one per backend for the module; each test finds value 1."""
    shared_group.set_each([1, 1])
    assert shared_group.get() == [1, 1]
    return shared_group


# -- an exception in one rank ------------------------------------------------------------------


def test_exception_in_one_rank_names_rank_method_and_traceback(group):
    with pytest.raises(sc.WorkerError) as info:
        group.fail_on(1)
    err = info.value
    assert (err.rank, err.method, err.exc_type) == (1, "fail_on", "ValueError")
    assert "rank 1 refuses" in err.remote_traceback and "test_faults.py" in err.remote_traceback
    assert str(err).startswith("rank 1 raised in fail_on(): ValueError: rank 1 refuses")
    # no partial result was returned, and the group stays usable
    assert group.fail_on(7) == [0, 1]
    assert group.get() == [1, 1]


def test_traceback_names_the_line_in_a_class_sent_by_value(backend):
    """A class the workers cannot import (defined in a script run as __main__, or in a function as
    here) travels pickled by value; its worker traceback still names this file and the line."""

    class Local(sc.Worker):
        def divide(self, x):
            return 1 / x

    line = Local.divide.__code__.co_firstlineno + 1
    with sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Local), backend=backend) as wg:
        with pytest.raises(sc.WorkerError) as info:
            wg.divide(0)
        assert wg.divide(4) == [0.25]
    assert f'test_faults.py", line {line}, in divide' in info.value.remote_traceback


# -- bad input fails before anything is sent -----------------------------------------------------


def test_bad_input_raises_before_anything_is_sent(group):
    with pytest.raises(
        ValueError, match=r"ALL_TO_ALL: argument 0 must be a list with one entry per rank \(2 entries\)"
    ):
        group.set_each([1, 2, 3])
    with pytest.raises(ValueError, match="empty DataProto"):
        group.echo(batch_of(0))
    with pytest.raises(TypeError, match="argument 0 of type list cannot be split"):
        group.echo([1, 2, 3])
    with pytest.raises(ValueError, match="same number of rows"):
        group.echo(batch_of(3), batch_of(4))
    with pytest.raises(ValueError, match="x=3, y=2"):
        DataProto.from_dict({"x": torch.zeros(3), "y": torch.zeros(2)})
    assert group.get() == [1, 1]  # nothing reached the workers


def test_unpicklable_argument_and_result_are_type_errors(group):
    with pytest.raises(TypeError, match=r"argument 0 \(lock\)"):
        group.sleep(threading.Lock())
    with pytest.raises(TypeError, match=r"result of unpicklable\(\) on rank [01] cannot be pickled"):
        group.unpicklable()
    assert group.get() == [1, 1]


# -- timeouts ----------------------------------------------------------------------------------


def test_hanging_method_with_timeout_raises_call_timeout_error(process_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Faulty), backend=process_backend) as wg:
        start = time.monotonic()
        with pytest.raises(sc.CallTimeoutError) as info:
            wg.hang(3.0)  # @register(timeout=1.0)
        assert 0.9 < time.monotonic() - start < 2.5
        assert info.value.method == "hang" and info.value.pending_ranks == [0, 1]


def test_group_default_timeout(process_backend):
    with sc.WorkerGroup(
        sc.ResourcePool([1]), sc.ClassWithInitArgs(Faulty), backend=process_backend, default_timeout=0.5
    ) as wg:
        with pytest.raises(sc.CallTimeoutError, match="within 0.5 s"):
            wg.sleep(2)
        fut = wg.execute_all_async("sleep", 0)
        assert fut.get(timeout=10) == [0]


# -- a worker killed mid-call --------------------------------------------------------------------


def test_killed_worker_raises_worker_died_error_then_restart(process_backend):
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Faulty, value=7), backend=process_backend
    ) as wg:
        pids = wg.pid()
        fut = wg.execute_all_async("sleep", 1)
        time.sleep(0.3)
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(sc.WorkerDiedError) as info:
            fut.get()
        assert time.monotonic() - start < DEATH_DEADLINE_S[process_backend]
        assert info.value.rank == 1 and "rank 1" in str(info.value)
        start = time.monotonic()
        for _ in range(2):  # fails fast, with the same error, until restart
            with pytest.raises(sc.WorkerDiedError, match="rank 1"):
                wg.get()
        assert time.monotonic() - start < 2
        wg.restart()  # restarts the dead ranks only
        new_pids = wg.pid()
        assert new_pids[0] == pids[0] and new_pids[1] != pids[1]
        assert wg.get() == [7, 7]


class Trainer(sc.Worker):
    """A tiny stateful 'trainer': its state is the running sum of the rows it has seen."""

    def __init__(self):
        self.total = torch.zeros(())

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_METRIC)
    def step(self, batch):
        time.sleep(0.05)
        self.total += batch.batch["x"].sum()
        return float(self.total)

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def save(self, directory):
        torch.save(self.total, os.path.join(directory, f"rank{self.rank}.pt"))

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def load(self, directory):
        self.total = torch.load(os.path.join(directory, f"rank{self.rank}.pt"))

    def pid(self):
        return os.getpid()


def test_recovery_catch_restart_reload_and_go_on(process_backend, tmp_path):
    batches = [batch_of(4) for _ in range(8)]
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Trainer), backend="inline") as wg:
        reference = [wg.step(b) for b in batches][-1]  # a run without faults (the same on any backend)
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Trainer), backend=process_backend) as wg:
        wg.save(str(tmp_path))
        step, saved_at, restarts, replayed = 0, 0, 0, []
        while step < len(batches):
            try:
                if step == 5 and restarts == 0:
                    os.kill(wg.pid()[0], signal.SIGKILL)
                last = wg.step(batches[step])
                step += 1
                if step % 2 == 0:  # checkpoint every 2 steps
                    wg.save(str(tmp_path))
                    saved_at = step
            except sc.WorkerDiedError:
                restarts += 1
                wg.restart()
                wg.load(str(tmp_path))
                replayed.append((saved_at, step))
                step = saved_at  # replay from the checkpoint
        assert restarts == 1 and replayed == [(4, 5)]
        # the same final state as the run without faults: nothing lost, nothing counted twice
        assert last == reference


# -- the controller dies -------------------------------------------------------------------------


def test_workers_exit_when_the_controller_is_killed():
    proc = run_controller("""
        import spmdcall as sc, time
        from test_faults import Faulty
        wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Faulty))
        fut = wg.execute_all_async("sleep", 60)   # busy workers must notice too
        print(*[i["pid"] for i in wg.worker_info()], flush=True)
        time.sleep(60)
    """)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_gone(pids, 10) == []


def test_ctrl_c_reaches_the_controller_and_workers_are_cleaned_up():
    proc = run_controller("""
        import signal, sys
        # A program inherits an ignored or blocked SIGINT from its parent (a shell without job
        # control ignores it for what it starts in the background; a library in the test runner
        # may block it), and Python then never raises KeyboardInterrupt. A terminal's program
        # starts with the default handler; so does this one, saying on stderr if it inherited else.
        inherited = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
        if inherited[0] is not signal.default_int_handler or signal.SIGINT in inherited[1]:
            print(f"SIGINT inherited as {inherited[0]}, blocked: {signal.SIGINT in inherited[1]}", file=sys.stderr)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        import spmdcall as sc
        from test_faults import Faulty
        wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Faulty))
        try:  # from the moment the test has the pids, however late this process gets to the call
            print(*[i["pid"] for i in wg.worker_info()], flush=True)
            wg.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise
    """)
    pids = [int(p) for p in proc.stdout.readline().split()]
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "interrupted"
    assert proc.wait(timeout=15) != 0
    assert wait_gone(pids, 10) == []


def test_group_never_shut_down_is_cleaned_up_at_exit():
    proc = run_controller("""
        import spmdcall as sc
        from test_faults import Faulty
        wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Faulty))
        print(*[i["pid"] for i in wg.worker_info()], flush=True)
    """)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert proc.wait(timeout=30) == 0
    assert wait_gone(pids, 5) == []
