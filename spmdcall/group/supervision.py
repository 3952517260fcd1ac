"""Where the ranks of a group are, for a call past its deadline, a slow call, or on demand.

A backend that declares ``Capabilities.reports`` answers for each rank with the calls it runs and
the stack of each of its threads (``runtime/reports.py``); for the others, or for a rank that
cannot answer, the report falls back to what the controller knows: the method and age of the
calls it is waiting for. Reports are taken only when asked: a call pays nothing for them.

After a deadline (:func:`stop_late_call`): the call's ``on_timeout`` policy stops it on the ranks
still running it, or leaves it there.

Slow calls: a call whose method or group sets ``warn_after`` is watched by the group's
:class:`SlowCallWatch`, one thread that sleeps until the next call's threshold; a call still
running then has its report logged once (``logging.getLogger("spmdcall")``, WARNING).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from spmdcall.errors import format_reports
from spmdcall.runtime.reports import RankReport

if TYPE_CHECKING:
    from spmdcall.backends import Backend, RankFuture

logger = logging.getLogger("spmdcall")

# Seconds a report may take: a rank that has not answered by then is reported as not answering.
# Well within the 2 s a deadline's report must come in.
REPORT_BUDGET_S = 1.5
# Seconds an interrupted call has to end before its ranks are restarted: a thread blocked in C
# gets the interrupt only when the C call returns, and a lock.acquire() without a timeout never does.
INTERRUPT_GRACE_S = 5.0
# A rank counts a call's age from a moment after the controller made it, and hears of the request
# to stop it a moment after the controller asks: the slack covers the second.
_AGE_SLACK_S = 0.25
# A slow-call watcher with nothing to watch for this long ends its thread (a group dropped
# without shutdown() leaves none behind for good).
_IDLE_EXIT_S = 30.0


def gather_reports(
    backend: Backend, ranks: list[int], known: dict[int, list[tuple[str, float]]] | None = None
) -> dict[int, RankReport]:
    """The report of each of ``ranks``, within :data:`REPORT_BUDGET_S`. ``known``: the calls the
    controller waits for on each rank, ``(method, age_s)``, for ranks that say nothing of theirs."""
    known = known or {}
    if not ranks:
        return {}
    if backend.capabilities.reports:
        try:
            reports = backend.report(ranks, REPORT_BUDGET_S)  # type: ignore[attr-defined]  # declared by capabilities.reports
        except Exception as exc:  # a report must never hide the error it is attached to
            note = f"the backend's report failed: {type(exc).__name__}: {exc}"
            reports = {r: RankReport(r, note=note) for r in ranks}
    else:
        note = f"the {backend.name} backend reports no stacks (its capabilities.reports is False)"
        reports = {r: RankReport(r, note=note) for r in ranks}
    out = {}
    for r in ranks:
        report = reports.get(r) or RankReport(r, note="the backend gave no report for this rank")
        if not report.calls and known.get(r):  # what the controller knows, rather than nothing
            report = RankReport(r, known[r], report.threads, report.pid, report.note)
        out[r] = report
    return out


def stop_late_call(group: Any, method: str, futures: list[RankFuture], made: float, policy: str) -> str:
    """Apply ``policy`` (``register(on_timeout=...)``) to the ranks of ``futures`` still running a
    call of ``method`` made at ``made`` (``time.monotonic()``), past its deadline (their reports
    are taken already). ``group`` is the ``WorkerGroup``: its ``backend`` and ``restart``.
    Returns what was done, for the error's message.

    ``"restart"`` restarts the ranks now; without ``Capabilities.cancel``, so does
    ``"interrupt"`` (if the ranks have processes of their own to replace; else the call is left
    running: restarting a rank inside the controller cannot stop it). Otherwise the call is
    stopped on each rank (an ``async def`` call's task cancelled under any policy; a plain call
    interrupted under ``"interrupt"``), and a watcher thread (:func:`_follow_up`) stops it on the
    ranks where it had not started yet, queued behind another call, and under ``"interrupt"``
    restarts the ranks still running it after :data:`INTERRUPT_GRACE_S` (a thread blocked in C
    takes an interrupt only when the C call returns)."""
    ranks = sorted(f.rank for f in futures if not f.done())
    backend = group.backend
    if not ranks:
        return ""
    caps = backend.capabilities
    if policy == "restart" or (policy == "interrupt" and not caps.cancel and caps.ranks_in_own_processes):
        why = "" if policy == "restart" else f" (the {backend.name} backend cannot interrupt a call)"
        group.restart(ranks)
        return f'on_timeout="{policy}": ranks {ranks} were restarted{why}'
    if not caps.cancel:  # and for "interrupt", no process of a rank's own to replace either
        return (
            "" if policy == "leave" else f"left running: the {backend.name} backend cannot interrupt a call"
        )
    interrupt = policy == "interrupt"
    done = backend.cancel(ranks, method, time.monotonic() - made + _AGE_SLACK_S, interrupt, REPORT_BUDGET_S)
    late = [f for f in futures if f.rank in ranks]
    if interrupt or not all(done.values()):
        threading.Thread(
            target=_follow_up,
            args=(group, method, late, made, interrupt, done),
            name="spmdcall-stop",
            daemon=True,
        ).start()
    said = [
        f"ranks {sorted(r for r, d in done.items() if d == how)} {how} the call"
        for how in ("cancelled", "interrupted")
    ]
    return "; ".join(s for s in said if "[]" not in s)


def _follow_up(
    group: Any,
    method: str,
    futures: list[RankFuture],
    made: float,
    interrupt: bool,
    done: dict[int, str | None],
) -> None:
    """For :data:`INTERRUPT_GRACE_S`: stop the call on the ranks where it had not started (or did
    not answer); then, with ``interrupt``, restart the ranks still running it. Ends at once when
    the group is shut down (which stops every rank anyway)."""
    end = time.monotonic() + INTERRUPT_GRACE_S
    try:
        while time.monotonic() < end and not all(f.done() for f in futures):
            if group.closed:
                return
            waiting = [f.rank for f in futures if not f.done() and not done.get(f.rank)]
            if waiting:
                age = time.monotonic() - made + _AGE_SLACK_S
                done.update(group.backend.cancel(waiting, method, age, interrupt, REPORT_BUDGET_S))
            time.sleep(0.05)
        ranks = sorted(f.rank for f in futures if not f.done())
        if interrupt and ranks and not group.closed:
            logger.warning(
                "spmdcall: %s() still runs on ranks %s %g s after it was interrupted past its deadline "
                "(blocked in C?): restarting them",
                method,
                ranks,
                INTERRUPT_GRACE_S,
            )
            group.restart(ranks)
    except Exception:  # the restart failed (or the group was shut down meanwhile): say so
        if not group.closed:
            logger.exception("spmdcall: stopping %s() past its deadline failed", method)


class SlowCallWatch:
    """Logs the report of each watched call still running past its threshold, once. One daemon
    thread per group, started on the first call watched; it holds the calls weakly, so a call
    dropped unwaited is forgotten. ``watch`` may be called from any thread."""

    def __init__(self, name: str):
        self._name = name
        self._heap: list[tuple[float, int, weakref.ref]] = []
        self._seq = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, future: Any, after_s: float) -> None:
        """Log ``future``'s report if it is still running ``after_s`` seconds from now. The future
        has ``done()`` and ``slow_report() -> str``."""
        with self._wake:
            if self._closed:
                return
            heapq.heappush(self._heap, (time.monotonic() + after_s, next(self._seq), weakref.ref(future)))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"spmdcall-slow-{self._name}", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._heap.clear()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    if not self._heap and not self._wake.wait(_IDLE_EXIT_S) and not self._heap:
                        self._thread = None  # idle: the next watched call starts another
                        return
                    if self._heap:
                        self._wake.wait(self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, _, ref = heapq.heappop(self._heap)
            future = ref()
            if future is not None and not future.done():
                try:
                    logger.warning("%s", future.slow_report())
                except Exception:  # the watch outlives one bad report
                    logger.exception("spmdcall: the report of a slow call failed")
            del future


def slow_call_message(method: str, after_s: float, reports: dict[int, RankReport]) -> str:
    """The warning logged for a call still running after ``after_s`` seconds."""
    return (
        f"{method}() has run for more than {after_s:g} s (warn_after) on ranks {sorted(reports)}; "
        f"it goes on:\n{format_reports(reports)}"
    )
