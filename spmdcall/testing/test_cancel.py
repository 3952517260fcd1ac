"""What a call's deadline does to the ranks still running it (``on_timeout``): an ``async def``
call's task is cancelled; ``"interrupt"`` stops a plain call running Python code; ``"restart"``
gives a fresh rank in place of one stuck in C; ``"leave"`` lets a plain call run on. After each,
the error still is the ``CallTimeoutError`` with every rank's report, and the group answers.

A backend that does not declare ``Capabilities.cancel`` leaves async calls running and restarts
the ranks for ``"interrupt"`` (leaves the call running, and says so, where ranks have no process
of their own to replace): those tests check that instead."""

from __future__ import annotations

import time

import pytest

import spmdcall as sc
from spmdcall.testing.workers import Late

pytestmark = pytest.mark.timeout(60)

# How soon after its deadline a call's error must be raised (its reports and the policy's stop
# taken); a restart is given longer: it starts processes.
STOP_DEADLINE_S = 2.0
RESTART_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def late(spmd_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Late), backend=spmd_backend) as wg:
        yield wg


def _idle_soon(group, within_s: float = 2.0) -> dict[int, sc.RankReport]:
    """The group's reports once no rank runs a call (or after ``within_s``: then as they are)."""
    end = time.monotonic() + within_s
    while True:
        reports = group.status()
        if all(not r.calls for r in reports.values()) or time.monotonic() > end:
            return reports
        time.sleep(0.05)


def test_an_async_call_past_its_deadline_is_cancelled(late):
    start = time.monotonic()
    with pytest.raises(sc.CallTimeoutError) as info:
        late.nap(60)
    assert time.monotonic() - start < 0.5 + STOP_DEADLINE_S
    err = info.value
    assert err.pending_ranks == [0, 1]
    for report in err.reports.values():  # taken before the task was cancelled
        assert [m for m, _ in report.calls] == ["nap"] or not late.capabilities.reports
    if not late.capabilities.cancel:
        pytest.skip(f"the {late.backend.name} backend does not declare capabilities.cancel")
    assert "cancelled" in err.stopped
    reports = _idle_soon(late)
    assert all(not r.calls for r in reports.values()), {r: v.calls for r, v in reports.items()}
    assert late.sleep(0) == [0, 1]


def test_interrupt_stops_a_busy_loop(late):
    born = late.birth()
    stoppable = late.capabilities.cancel or late.capabilities.ranks_in_own_processes
    with pytest.raises(sc.CallTimeoutError) as info:
        late.spin(10 if stoppable else 1.5)  # what nothing stops, past its 0.5 s, but not for long
    if not late.capabilities.cancel and late.capabilities.ranks_in_own_processes:  # the fallback
        assert "restarted" in info.value.stopped and late.birth() != born
        return
    if not late.capabilities.cancel:  # nothing can stop it: left running, and said so
        assert "left running" in info.value.stopped
        assert late.sleep(0) == [0, 1]  # once it has finished
        pytest.skip(
            f"the {late.backend.name} backend can neither interrupt a call nor replace a rank's process"
        )
    assert "interrupted" in info.value.stopped
    reports = _idle_soon(late)
    assert all(not r.calls for r in reports.values()), {r: v.calls for r, v in reports.items()}
    assert late.interruptions() == [1, 1]  # the ranks caught CallInterrupted: not restarted
    assert late.birth() == born
    assert late.sleep(0) == [0, 1]


def test_restart_replaces_a_rank_stuck_in_c(late):
    if not late.capabilities.ranks_in_own_processes:
        pytest.skip("ranks inside the controller's process: a restart cannot stop a call already running")
    born = late.birth()
    start = time.monotonic()
    with pytest.raises(sc.CallTimeoutError) as info:
        late.stuck(3600)
    assert time.monotonic() - start < 0.5 + RESTART_DEADLINE_S
    err = info.value
    assert "restarted" in err.stopped and err.pending_ranks == [0, 1]
    assert all(any("stuck" in s for s in r.threads.values()) for r in err.reports.values()) or not (
        late.capabilities.reports
    )
    assert late.sleep(0) == [0, 1]  # fresh ranks answer
    assert all(a != b for a, b in zip(late.birth(), born))


def test_leave_lets_a_plain_call_run_on(late):
    with pytest.raises(sc.CallTimeoutError) as info:
        late.spin_on(1.5)
    assert info.value.stopped == ""
    if late.capabilities.reports:  # it runs on (inline: on rank 0, with rank 1's queued behind it)
        calls = [m for r in late.status().values() for m, _ in r.calls]
        assert calls and set(calls) == {"spin_on"}
    assert late.sleep(0) == [0, 1]  # runs once spin_on has finished: the group answers
    assert all(not r.calls for r in late.status().values())


def test_a_group_policy_applies_to_methods_without_their_own():
    with sc.WorkerGroup(
        sc.ResourcePool([1]), sc.ClassWithInitArgs(Late), backend="inline", on_timeout="interrupt"
    ) as wg:
        with pytest.raises(sc.CallTimeoutError) as info:
            wg.spin_on(60)
        assert "interrupted" in info.value.stopped
        assert wg.sleep(0) == [0]


def test_a_bad_policy_is_refused():
    with pytest.raises(
        ValueError, match=r"on_timeout must be 'leave' or 'interrupt' or 'restart' or None, got 'kill'"
    ):
        sc.register(on_timeout="kill")
    with pytest.raises(ValueError, match=r"on_timeout must be 'leave' or 'interrupt' or 'restart', got None"):
        sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Late), backend="inline", on_timeout=None)  # type: ignore[arg-type]
