"""Where every rank is: a call past its deadline, ``group.status()`` and a slow call report the
calls each rank runs, their ages and the Python stack of each of its threads, taken while the
ranks are blocked in C (asleep, on a lock); a rank that cannot answer does not hold them up.

A backend that does not declare ``Capabilities.reports`` gives reports without stacks: the tests
then check that much."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

import spmdcall as sc
from spmdcall.testing.plugin import own_processes, runs_calls_in_submit
from spmdcall.testing.workers import Stuck

pytestmark = pytest.mark.timeout(60)

# How soon after its deadline a call's error, report included, must be raised.
REPORT_DEADLINE_S = 2.0
# A rank counts a call's age from when it started it, a moment after the controller made it.
AGE_SLACK_S = 0.05


@pytest.fixture(scope="module")
def stuck(spmd_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Stuck), backend=spmd_backend) as wg:
        yield wg


@pytest.fixture(scope="module")
def deadlines_apply(stuck):
    if runs_calls_in_submit(stuck):
        pytest.skip("a plain call has finished when the call returns (as on inline): no deadline can apply")


def _shows(report: sc.RankReport, line: str, reports_stacks: bool) -> bool:
    """Whether some thread of ``report`` is at ``line`` (or, for a backend without stacks, the
    report says why it has none)."""
    if not reports_stacks:
        return not report.threads and "reports no stacks" in report.note
    return any(line in stack for stack in report.threads.values())


def test_a_call_past_its_deadline_reports_where_each_rank_sleeps(stuck, deadlines_apply):
    start = time.monotonic()
    with pytest.raises(sc.CallTimeoutError) as info:
        stuck.doze_past_deadline(1.5)  # register(timeout=0.5)
    assert time.monotonic() - start < 0.5 + REPORT_DEADLINE_S
    err = info.value
    assert sorted(err.reports) == err.pending_ranks == [0, 1]
    for rank, report in err.reports.items():
        assert report.rank == rank
        (method, age), *_ = report.calls
        assert method == "doze_past_deadline" and age >= 0.5 - AGE_SLACK_S
        assert _shows(report, "time.sleep(seconds)  # doze_past_deadline", stuck.capabilities.reports)
    assert "rank 1" in str(err) and "doze_past_deadline() for" in str(err)
    assert stuck.get() == [0, 0]  # behind the call that ran on, the next one runs


def test_a_deadlock_on_a_lock_is_reported_at_the_lock(stuck, deadlines_apply):
    future = stuck.deadlock.submit(1.5)
    start = time.monotonic()
    with pytest.raises(sc.CallTimeoutError) as info:
        future.get(timeout=0.5)
    assert time.monotonic() - start < 0.5 + REPORT_DEADLINE_S
    for report in info.value.reports.values():
        assert report.calls[0][0] == "deadlock" and report.calls[0][1] >= 0.5 - AGE_SLACK_S
        assert _shows(report, "self.lock.acquire(timeout=seconds)", stuck.capabilities.reports)
    assert future.get(timeout=30) == [0, 1]


def test_status_reports_a_call_in_flight(stuck):
    """The call is made from a thread of its own: on a backend that runs calls inside the call
    (inline), that thread is where it runs."""
    if not stuck.capabilities.reports:  # the controller knows no calls of its own to report here
        assert all("reports no stacks" in r.note for r in stuck.status().values())
        return
    caller = threading.Thread(target=stuck.doze, args=(1.0,))
    caller.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            report = stuck.status()[0]
            if report.calls or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert [m for m, _ in report.calls] == ["doze"] and report.calls[0][1] > 0
        assert _shows(report, "time.sleep(seconds)  # doze", True)
    finally:
        caller.join(30)
    assert [r.calls for r in stuck.status().values()] == [[], []]  # nothing runs any more


def test_a_slow_call_logs_its_report_once_and_goes_on(stuck, deadlines_apply, caplog):
    with caplog.at_level(logging.WARNING, logger="spmdcall"):
        assert stuck.doze_slowly(1.0) == [0, 1]  # register(warn_after=0.3)
        time.sleep(0.2)
    warnings = [r for r in caplog.records if "doze_slowly() has run for more than 0.3 s" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    if stuck.capabilities.reports:
        assert "time.sleep(seconds)  # doze_slowly" in warnings[0].getMessage()


def test_a_rank_that_cannot_answer_does_not_hold_up_the_report(stuck, deadlines_apply):
    pids = stuck.pid()
    if not own_processes(stuck, pids) or not stuck.capabilities.reports:
        pytest.skip("needs ranks in processes of their own on this machine (to stop one) that report stacks")
    future = stuck.doze.submit(1.0)
    time.sleep(0.2)
    os.kill(pids[1], signal.SIGSTOP)  # rank 1 can answer nothing, not even from a side thread
    try:
        start = time.monotonic()
        with pytest.raises(sc.CallTimeoutError) as info:
            future.get(timeout=0.3)
        assert time.monotonic() - start < 0.3 + REPORT_DEADLINE_S
    finally:
        os.kill(pids[1], signal.SIGCONT)
    reports = info.value.reports
    assert "did not answer" in reports[1].note and not reports[1].threads
    assert reports[1].calls[0][0] == "doze"  # the controller's view: the call it waits for
    assert _shows(reports[0], "time.sleep(seconds)  # doze", True)
    assert future.get(timeout=30) == [0, 1]
