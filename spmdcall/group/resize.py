"""The gate between a group's calls and its resizes: a call's ranks are chosen and its calls sent
under the gate (many calls at once), a resize holds it alone, so that no call is split over ranks
that change under it. Calls sent before a resize keep their rank futures and finish on the ranks
they started on."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class ResizeGate:
    """Many calls at once, or one resize. ``with gate:`` around choosing a call's ranks and sending
    it; ``with gate.resizing():`` around a resize. A call never waits for another call; a resize
    waits until the calls being sent are sent, and calls made meanwhile wait until it is done (a
    call made from an event loop blocks the loop while a resize runs), except a call made while
    its thread is sending another (a dispatch function that calls the group), which goes first.
    ``resizes`` counts the resizes done, for what is cached per size (mesh layouts)."""

    def __init__(self) -> None:
        # A plain lock for the calls' path (``with`` on it is a C call); the condition on the same
        # lock only for the waits, which a call makes only while a resize is under way.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._sending = 0
        self._waiting = 0  # resizes waiting for the calls being sent: new calls let them go first
        self._resizing = False
        self._depth = threading.local()  # calls this thread is sending (nested ones do not wait)
        self.resizes = 0

    def __enter__(self) -> None:
        depth = getattr(self._depth, "n", 0)
        with self._lock:
            if not depth:
                while self._resizing or self._waiting:
                    self._cond.wait()
            self._sending += 1
        self._depth.n = depth + 1

    def __exit__(self, *exc: object) -> None:
        self._depth.n -= 1
        with self._lock:
            self._sending -= 1
            if not self._sending and self._waiting:  # only a resize waits for the calls being sent
                self._cond.notify_all()

    @contextlib.contextmanager
    def resizing(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._resizing or self._sending:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._resizing = True
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self.resizes += 1
                self._cond.notify_all()
