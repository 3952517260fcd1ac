"""The pending result of one call on one rank, safe to share between threads and event loops.

A backend's rank futures are settled once, by whichever thread reads the reply (or learns that the
rank died). Two things may wait on a future without holding a thread per call:

- a thread blocked in a backend's ``wait``: it parks on a :class:`Waiter` that the settling thread
  fires;
- an event loop: ``add_done_callback`` runs a function in the settling thread, which hands the
  news to the loop (``call_soon_threadsafe``); the loop thread is never blocked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from spmdcall.errors import CallTimeoutError


class Waiter:
    """A one-shot wake-up for a parked thread: ``fire()`` from any thread, any number of times.

    A thread that waits for ``count`` futures registers one waiter on each; it fires once all of
    them are settled or one of them failed, not at each settle (a call to two ranks whose replies
    come one after the other would otherwise wake its thread twice)."""

    __slots__ = ("_lock", "_fired", "_left")

    def __init__(self, count: int = 1) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._fired = False
        self._left = count

    def fire(self) -> None:
        # Only the first fire releases; a guard makes concurrent fires harmless.
        if not self._fired:
            self._fired = True
            try:
                self._lock.release()
            except RuntimeError:
                pass  # a concurrent fire released it first

    @property
    def fired(self) -> bool:
        return self._fired

    def _settled(self, failed: bool) -> bool:
        """One of the futures it waits for settled (under ``RankFutureBase._lock``): whether to fire."""
        self._left -= 1
        return failed or self._left <= 0

    def wait(self, timeout: float | None) -> bool:
        """Park until fired or ``timeout`` seconds (None: no limit); whether it was fired."""
        if self._fired:
            return True
        return self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout))


class RankFutureBase:
    """State shared by the rank futures of the built-in backends: pending, then ok or error once.

    The contract a backend uses (docs/backends/writing-a-backend.md): ``settle`` records the
    outcome, from any thread (it wakes the waiters and runs the done-callbacks there); ``state``
    and ``value`` read it; ``add_waiter``/``remove_waiter`` park a thread on several futures at
    once (:func:`wait_settled` does it for you).
    """

    __slots__ = ("rank", "method", "started_ns", "finished_ns", "state", "value", "_waiters", "_callbacks")

    # One lock for every future's bookkeeping: registering a waiter or callback and settling must
    # not interleave (else a waiter registered just after the settle check is never fired).
    _lock = threading.Lock()

    def __init__(self, rank: int, method: str):
        self.rank, self.method = rank, method
        self.started_ns = self.finished_ns = 0
        # Read them freely (plain attributes: the wait loops read them often); only ``settle`` writes them.
        self.state = "pending"  # "pending", then "ok" or "error" once settled
        self.value: Any = None  # the result when "ok", the error when "error" (None while pending)
        self._waiters: list[Waiter] | None = None
        self._callbacks: list[Callable[[Any], None]] | None = None

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(self)`` once the future is done, in the thread that settles it (at once if it is
        done already). ``fn`` must be quick and must not raise."""
        with RankFutureBase._lock:
            if self.state == "pending":
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def exception(self) -> BaseException | None:
        return self.value if self.state == "error" else None

    def add_waiter(self, waiter: Waiter) -> bool:
        """Fire ``waiter`` when settled; False (nothing registered) when settled already."""
        with RankFutureBase._lock:
            if self.state != "pending":
                return False
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(waiter)
            return True

    def remove_waiter(self, waiter: Waiter) -> None:
        with RankFutureBase._lock:
            if self._waiters is not None and waiter in self._waiters:
                self._waiters.remove(waiter)

    def settle(self, state: str, value: Any, started_ns: int = 0, finished_ns: int = 0) -> bool:
        """Record the outcome, ``"ok"`` and the result or ``"error"`` and the exception, with the
        worker's clock times of the call (the first outcome wins); whether this call settled it."""
        with RankFutureBase._lock:
            if self.state != "pending":
                return False
            self.started_ns, self.finished_ns = started_ns, finished_ns
            self.value = value
            self.state = state
            waiters, callbacks = self._waiters, self._callbacks
            self._waiters = self._callbacks = None
            if waiters:
                waiters = [w for w in waiters if w._settled(state == "error")]
        for waiter in waiters or ():
            waiter.fire()
        for fn in callbacks or ():
            fn(self)
        return True


def first_failure(futures: list[Any]) -> BaseException | None:
    """The error of the first failed future in ``futures`` (in their order), or None."""
    for f in futures:
        if f.state == "error":
            return f.value
    return None


def wait_settled(futures: list[Any], timeout: float | None) -> list[Any]:
    """The values of ``futures`` (settled by other threads), in order; raises the first failure
    as soon as it is known, or ``CallTimeoutError`` after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        failure = first_failure(futures)
        if failure is not None:
            raise failure
        pending = [f for f in futures if f.state == "pending"]
        if not pending:
            return [f.value for f in futures]
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            assert timeout is not None
            raise CallTimeoutError(pending[0].method, timeout, sorted({f.rank for f in pending}))
        waiter = Waiter(len(pending))
        try:
            if all(f.add_waiter(waiter) for f in pending):
                waiter.wait(remaining)
        finally:
            for f in pending:
                f.remove_waiter(waiter)
