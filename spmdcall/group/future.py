"""GroupFuture: the pending result of a group call, waited for from threads or asyncio, collected once."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator
from typing import Any, Protocol

from spmdcall import tracing
from spmdcall.backends import Backend, RankFuture
from spmdcall.errors import CallTimeoutError
from spmdcall.group.modes import Dispatch, Execute, is_data_proto
from spmdcall.group.register import ResolvedSpec
from spmdcall.group.stats import StatsCounter
from spmdcall.group.supervision import gather_reports, slow_call_message, stop_late_call
from spmdcall.runtime.reports import RankReport
from spmdcall.transport.envelope import Sealed


class CallingGroup(Protocol):
    """What a future needs of the group that made it (a ``WorkerGroup``): its name, its default
    timeout, slow-call threshold and deadline policy, its backend to wait with, whether it is shut
    down, and its restart (for ``on_timeout="restart"``)."""

    name: str
    default_timeout: float | None
    warn_after: float | None
    on_timeout: str

    def restart(self, ranks: list[int] | None = None) -> None: ...

    @property
    def backend(self) -> Backend: ...

    @property
    def closed(self) -> bool: ...

    @property
    def world_size(self) -> int: ...


class GroupFuture:
    """The pending result of a group call made with ``blocking=False`` (or ``method.submit(...)``).

    ``get()`` waits for every rank and returns the collected result; ``await future`` does the same
    from asyncio without blocking the event loop. A GroupFuture can be passed straight into another
    group's call (it is resolved there, padding included). Any thread may ``get()`` it and any
    event loop may await it, at the same time; the result is collected once. The method's timeout
    (``register(timeout=...)``, else the group's ``default_timeout``) counts from the call; once
    it has passed, the call's ``on_timeout`` policy stops it on its ranks (once, whoever waits).
    A shorter ``get(timeout=...)`` only stops waiting: the call goes on.
    """

    def __init__(
        self,
        group: CallingGroup,
        method: str,
        spec: ResolvedSpec,
        futures: list[RankFuture],
        pad_size: int = 0,
        padded_rows: int = 0,
        *,
        stats: StatsCounter | None = None,
    ):
        self.group, self.method, self.spec = group, method, spec
        self._stats = stats  # where the bytes a collect brings to the controller are counted
        self.rank_futures = futures
        self.pad_size, self.padded_rows = pad_size, padded_rows
        self._made = time.monotonic()
        self._timeout_s = spec.timeout or group.default_timeout
        self._deadline = None if self._timeout_s is None else self._made + self._timeout_s
        # Seconds after which the call, still running, logs where its ranks are (None: never); the
        # group watches it (``SlowCallWatch``), which calls ``slow_report``.
        self.warn_after = spec.warn_after or group.warn_after
        self._lock = threading.Lock()
        # Taken for good by the waiter that applies on_timeout (a call without a deadline has none).
        self._stopping = None if self._deadline is None else threading.Lock()
        self._done = False
        self._result: Any = None

    def done(self) -> bool:
        return self._done or all(f.done() for f in self.rank_futures)

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every rank (at most ``timeout`` seconds, else until the method's timeout runs
        out) and collect. Raises the first rank's failure as soon as it is known."""
        if self._done:
            return self._result
        remaining = self._remaining(timeout)
        if not self._lock.acquire(timeout=-1 if remaining is None else max(0.0, remaining)):
            limit = timeout if timeout is not None else self._timeout_s
            raise self._timeout_error(limit or 0.0, sorted(f.rank for f in self.rank_futures))
        try:
            if not self._done:
                self._result = self._collect(timeout)
                self._done = True
            return self._result
        finally:
            self._lock.release()

    result = get  # concurrent.futures spelling

    def __await__(self) -> Generator[Any, None, Any]:
        return self._wait_async().__await__()

    async def _wait_async(self) -> Any:
        """Wait on the running loop for every rank (or the first failure); the backend's reader
        wakes the loop, so no thread is parked for this call."""
        if not self._done:
            loop = asyncio.get_running_loop()
            settled = loop.create_future()
            unfinished = len(self.rank_futures)

            def rank_done(f: RankFuture) -> None:  # on the loop
                nonlocal unfinished
                unfinished -= 1
                if not settled.done() and (unfinished == 0 or f.exception() is not None):
                    settled.set_result("settled")

            waker = _LoopWaker.of(loop)
            for f in self.rank_futures:
                f.add_done_callback(functools.partial(waker.push, rank_done))
            timer = None
            if self._deadline is not None:
                timer = loop.call_later(max(0.0, self._deadline - time.monotonic()), _set, settled, "late")
            try:
                late = await settled == "late"
            finally:
                if timer is not None:
                    timer.cancel()
            if late:  # the ranks' report takes a moment: taken in a thread, the loop goes on
                pending = sorted(f.rank for f in self.rank_futures if not f.done())
                raise await loop.run_in_executor(None, self._timeout_error, self._timeout_s or 0.0, pending)
        return self.get()  # every rank is done (or one failed): nothing is waited for

    def _timeout_error(self, limit: float, pending: list[int]) -> CallTimeoutError:
        """The error for this call past its deadline, with where each rank still running is."""
        pending, reports = self._pending_reports(pending)
        return CallTimeoutError(self.method, limit, pending, reports, self._stop_late())

    def _pending_reports(self, pending: list[int]) -> tuple[list[int], dict[int, RankReport]]:
        """The ranks of ``pending`` still running this call now, and where each is. A rank whose
        result comes while the reports are taken, having finished before now, is left out (a
        backend whose ranks' results of one call come together, as a call ``monarch`` casts to its
        mesh, reads the finished ranks' own before it reports); one that finished after now stays."""
        now_ns = time.time_ns()
        known = {r: [(self.method, time.monotonic() - self._made)] for r in pending}
        reports = gather_reports(self.group.backend, pending, known)
        held = {f.rank for f in self.rank_futures if f.done() and 0 < f.finished_ns <= now_ns}
        return [r for r in pending if r not in held], {r: v for r, v in reports.items() if r not in held}

    def _stop_late(self) -> str:
        """Once the call's own deadline has passed, apply its ``on_timeout`` policy (the first
        waiter to get here does); what was done."""
        if self._stopping is None or self._deadline is None or time.monotonic() < self._deadline:
            return ""  # a get(timeout=...) shorter than the call's deadline: the call goes on
        if not self._stopping.acquire(blocking=False):
            return ""
        policy = self.spec.on_timeout or self.group.on_timeout
        return stop_late_call(self.group, self.method, self.rank_futures, self._made, policy)

    def slow_report(self) -> str:
        """The warning for this call, still running past ``warn_after``: where each of its ranks still
        running is (what ``SlowCallWatch`` in ``supervision.py`` logs)."""
        _, reports = self._pending_reports(sorted(f.rank for f in self.rank_futures if not f.done()))
        return slow_call_message(self.method, self.warn_after or 0.0, reports)

    def _remaining(self, timeout: float | None) -> float | None:
        """Seconds left to wait: ``timeout`` from now if given, else until the call's deadline."""
        if timeout is not None:
            return timeout
        return None if self._deadline is None else self._deadline - time.monotonic()

    def sealed_outputs(self, timeout: float | None = None) -> list[Sealed]:
        """Every rank's output as the backend hands it (sealed: ``open()`` each), uncollected: what
        a hand-off to another group passes on (``group/handoff.py``). Waits as :meth:`get` does."""
        try:
            return self.group.backend.wait(self.rank_futures, self._remaining(timeout))
        except CallTimeoutError as exc:  # name the call's own timeout, not what was left of it
            limit = timeout or self._timeout_s or 0.0
            raise self._timeout_error(limit, exc.pending_ranks) from None

    def _collect(self, timeout: float | None) -> Any:
        mode = self.spec.dispatch_mode
        rank_zero = self.spec.execute_mode is Execute.RANK_ZERO or mode is Dispatch.RANK_ZERO
        sealed = self.sealed_outputs(timeout)
        start = time.time_ns()
        if rank_zero:
            result = sealed[0].open()
        else:
            result = mode.collect_fn(self.group, _open_all(sealed, shared=mode.copies_data))
        if self.pad_size and not rank_zero:
            result = _unpad(result, self.pad_size, self.padded_rows)
        collected = (
            None if self._stats is None else self._stats.add_collected(sealed[:1] if rank_zero else sealed)
        )
        trace = tracing.active()
        if trace is not None:
            _trace_ranks(trace, self.group, self.method, self.rank_futures)
            args = {"group": self.group.name} | ({} if collected is None else {"collected_bytes": collected})
            trace.controller_span(f"{self.method} collect", start, args)
        return result

    def __repr__(self) -> str:
        return f"GroupFuture({self.group.name}.{self.method}, done={self.done()})"


class _LoopWaker:
    """Hands rank completions to one event loop, from whichever thread settles them. One wake-up
    of the loop (``call_soon_threadsafe`` writes to its self-pipe) serves every completion that
    arrives before the loop gets to them: with many calls in flight, replies come in bursts."""

    _of_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: collections.deque[tuple[Callable, Any]] = collections.deque()
        self.scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _LoopWaker:
        waker = cls._of_loop.get(loop)
        if waker is None:
            with cls._lock:
                waker = cls._of_loop.setdefault(loop, cls(loop))
        return waker

    def push(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Run ``fn(arg)`` on the loop soon; any thread (on the loop's own, at once)."""
        if asyncio._get_running_loop() is self.loop:  # the loop read the reply itself
            fn(arg)
            return
        self.pending.append((fn, arg))
        if not self.scheduled:  # the loop clears it before it runs what is pending
            self.scheduled = True
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits any more
                self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        self.scheduled = False
        while self.pending:
            fn, arg = self.pending.popleft()
            fn(arg)


def _trace_ranks(trace: tracing.Trace, group: CallingGroup, method: str, futures: list[RankFuture]) -> None:
    """A span per rank of a call: where it ran, from its start to its end on the worker's clock."""
    info = {i["rank"]: i for i in group.backend.worker_info()}
    for f in futures:
        pid = info.get(f.rank, {}).get("pid", 0)
        tid = f.rank + 1 if pid == os.getpid() else 0  # inline: every rank lives in this process
        trace.span(
            method,
            f.started_ns,
            f.finished_ns,
            pid=pid,
            tid=tid,
            thread_name=f"{group.name} rank {f.rank}",
            args={"group": group.name, "rank": f.rank},
        )


def _set(settled: asyncio.Future, how: str) -> None:
    if not settled.done():
        settled.set_result(how)


def _open_all(sealed: list[Sealed], *, shared: bool) -> list:
    """The rank outputs. ``shared``: the collect copies what it keeps of DataProto outputs, so
    theirs may stay read-only views of the transport's memory; anything else is opened writable."""
    if not shared:
        return [s.open() for s in sealed]
    outputs = [s.open(shared=True) for s in sealed]
    return [o if is_data_proto(o) else s.open() for s, o in zip(sealed, outputs)]


def _unpad(result: Any, pad_size: int, padded_rows: int) -> Any:
    """Drop the rows computed for padding. A method may return k rows per input row (k samples per
    prompt, interleaved); the last ``k * pad_size`` rows are then the padding's."""
    if not is_data_proto(result) or not padded_rows or len(result) % padded_rows:
        return result
    per_row = len(result) // padded_rows
    return result[: len(result) - pad_size * per_row]
