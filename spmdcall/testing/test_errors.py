"""Failures become prompt, precise errors: a worker's exception, bad input, a deadline passed, a
dead rank; and the group goes on (or restarts) afterwards."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import spmdcall as sc
from spmdcall.testing.plugin import own_processes, runs_calls_in_submit
from spmdcall.testing.workers import Counter, Sleeper

pytestmark = pytest.mark.timeout(180)

# How soon a killed rank must fail the calls pending on it (the built-in backends: 5 s on
# process, about 10 s on Ray; a backend that polls its workers has this long).
DEATH_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def sleepers(spmd_backend):
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Sleeper, value=1), backend=spmd_backend
    ) as wg:
        yield wg


@pytest.fixture(scope="module")
def deadlines_apply(sleepers):
    if runs_calls_in_submit(sleepers):
        pytest.skip("a plain call has finished when the call returns (as on inline): no deadline can apply")


def test_exception_in_one_rank_names_rank_method_and_traceback(spmd_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter), backend=spmd_backend) as wg:
        with pytest.raises(sc.WorkerError) as info:
            wg.fail_on(1)
        err = info.value
        assert (err.rank, err.method, err.exc_type) == (1, "fail_on", "ValueError")
        assert "rank 1 refuses" in err.remote_traceback and "workers.py" in err.remote_traceback
        assert str(err).startswith("rank 1 raised in fail_on(): ValueError: rank 1 refuses")
        # no partial result was returned, and the group stays usable
        assert wg.fail_on(7) == [0, 1]


def test_traceback_names_the_line_in_a_class_sent_by_value(spmd_backend):
    """A class the workers cannot import (defined in a function, as here, or in a script run as
    __main__) travels pickled by value; its worker traceback still names this file and the line."""

    class Local(sc.Worker):
        def divide(self, x):
            return 1 / x

    line = Local.divide.__code__.co_firstlineno + 1
    with sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Local), backend=spmd_backend) as wg:
        with pytest.raises(sc.WorkerError) as info:
            wg.divide(0)
        assert wg.divide(4) == [0.25]
    assert f'test_errors.py", line {line}, in divide' in info.value.remote_traceback
    assert info.value.exc_type == "ZeroDivisionError"


def test_an_async_method_that_raises_names_rank_method_and_line(sleepers):
    with pytest.raises(
        sc.WorkerError, match=r"rank [01] raised in broken\(\): ValueError: cannot fly"
    ) as info:
        sleepers.broken("fly")
    assert "workers.py" in info.value.remote_traceback
    assert sleepers.add(0, 1) == [(0, 1, 0), (0, 1, 1)]  # and the group goes on


def test_bad_input_raises_before_anything_is_sent(sleepers):
    with pytest.raises(
        ValueError, match=r"ALL_TO_ALL: argument 0 must be a list with one entry per rank \(2 entries\)"
    ):
        sleepers.each([1, 2, 3])
    assert sleepers.get() == [1, 1]


def test_unpicklable_argument_and_result_are_type_errors(sleepers):
    sleepers.reset()
    with pytest.raises(TypeError, match=r"argument 0 \(lock\)"):
        sleepers.add(threading.Lock(), 0)
    assert sleepers.order() == [[], []]  # nothing was sent
    with pytest.raises(TypeError, match=r"result of unpicklable\(\) on rank [01] cannot be pickled"):
        sleepers.unpicklable()
    assert sleepers.get() == [1, 1]


def test_hanging_method_with_timeout_raises_call_timeout_error(sleepers, deadlines_apply):
    start = time.monotonic()
    with pytest.raises(sc.CallTimeoutError) as info:
        sleepers.hang(3.0)  # @register(timeout=1.0)
    assert 0.9 < time.monotonic() - start < 2.5
    assert info.value.method == "hang" and info.value.pending_ranks == [0, 1]
    assert sleepers.get() == [1, 1]  # behind the hung call, the next one runs


def test_timeout_counts_from_the_call_not_from_the_wait(sleepers, deadlines_apply):
    future = sleepers.hang.submit(1.5)  # register(timeout=1.0): waiting 0.8 s after the call leaves 0.2 s
    time.sleep(0.8)
    start = time.monotonic()
    with pytest.raises(sc.CallTimeoutError, match=r"hang\(\) did not finish within 1 s"):
        future.get()
    assert time.monotonic() - start < 0.7


def test_group_default_timeout(spmd_backend):
    with sc.WorkerGroup(
        sc.ResourcePool([1]), sc.ClassWithInitArgs(Sleeper), backend=spmd_backend, default_timeout=0.5
    ) as wg:
        if runs_calls_in_submit(wg):
            pytest.skip(
                "a plain call has finished when the call returns (as on inline): no deadline can apply"
            )
        with pytest.raises(sc.CallTimeoutError, match="within 0.5 s"):
            wg.sleep(2)
        assert wg.execute_all_async("sleep", 0).get(timeout=10) == [0]


def test_the_call_timeout_applies_to_an_async_method(sleepers):
    """An ``async def`` call runs on the rank's event loop, never inside the call: its deadline
    applies on every backend."""
    start = time.monotonic()
    with pytest.raises(sc.CallTimeoutError, match=r"nap\(\) did not finish within 0.5 s"):
        sleepers.nap.submit(2.0).get(timeout=0.5)
    assert time.monotonic() - start < 1.5


def test_killed_rank_raises_worker_died_error_then_restart(spmd_backend):
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Sleeper, value=7), backend=spmd_backend
    ) as wg:
        pids = wg.pid()
        if not own_processes(wg, pids):
            pytest.skip(
                "the ranks are not processes of their own on this machine (worker_info): none to kill"
            )
        future = wg.execute_all_async("sleep", 1)
        time.sleep(0.3)
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(sc.WorkerDiedError) as info:
            future.get()
        assert time.monotonic() - start < DEATH_DEADLINE_S
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


def test_restart_of_a_given_rank_builds_it_again(spmd_backend):
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter, start=3), backend=spmd_backend
    ) as wg:
        assert wg.add(10) == [13, 13]
        wg.restart([1])  # the constructor runs again on rank 1, in the same SPMD context
        assert wg.get() == [13, 3]
        assert [i["context"]["rank"] for i in wg.identity()] == [0, 1]
        with pytest.raises(ValueError, match=r"ranks \[5\] are not in this group"):
            wg.restart([5])


def test_shutdown_fails_async_calls_still_running(spmd_backend):
    wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Sleeper), backend=spmd_backend)
    future = wg.execute_all_async("nap", 30.0)
    time.sleep(0.3)
    start = time.monotonic()
    wg.shutdown()
    with pytest.raises(sc.WorkerDiedError):
        future.get(timeout=20)
    assert time.monotonic() - start < 20
