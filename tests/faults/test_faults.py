"""Fault injection: every fault becomes a prompt, precise error; nothing is lost or left running.

What every backend must do with a fault (a worker's exception, bad input, a deadline, a killed
rank) is the shipped suite's spmdcall/testing/test_errors.py; here, a recovery on the backends
whose ranks are real processes, and the controller's own death.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from procs import alive, run_controller, wait_gone

import spmdcall as sc
from spmdcall import DataProto

pytestmark = pytest.mark.timeout(180)


class Faulty(sc.Worker):
    """What the controller-death tests' groups run: a sleep to be busy in."""

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank


def batch_of(n):
    return DataProto.from_dict({"x": torch.arange(float(n))})


# Errors, deadlines and a killed rank, on every backend: the shipped suite's test_errors.py.


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
