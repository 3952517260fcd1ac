"""``sc.trace(path)``: record every group call as a Chrome / Perfetto trace.

Open the file at https://ui.perfetto.dev or chrome://tracing. Each group call shows a ``dispatch``
span and a ``collect`` span on the controller, and one span per rank for the method itself
(timed inside the worker). When no trace is active, group calls pay one ``is None`` check.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_active: Trace | None = None


class Trace:
    """The events of one ``sc.trace`` block, written as JSON when the block ends."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.events: list[dict[str, Any]] = []
        self._named: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def span(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        *,
        pid: int,
        tid: int = 0,
        thread_name: str | None = None,
        args: dict[str, Any] | None = None,
    ) -> None:
        event = {
            "name": name,
            "ph": "X",
            "ts": start_ns / 1000,
            "dur": max(end_ns - start_ns, 0) / 1000,
            "pid": pid,
            "tid": tid,
            "args": args or {},
        }
        with self._lock:
            if thread_name is not None and (pid, tid) not in self._named:
                self._named.add((pid, tid))
                self.events.append(
                    {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread_name}}
                )
            self.events.append(event)

    def controller_span(self, name: str, start_ns: int, args: dict[str, Any]) -> None:
        """A span of the controller's own work (a dispatch, a collect) from ``start_ns`` to now."""
        self.span(name, start_ns, time.time_ns(), pid=os.getpid(), tid=0, thread_name="controller", args=args)

    def write(self) -> None:
        with open(self.path, "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, f)


@contextmanager
def trace(path: str | os.PathLike) -> Iterator[Trace]:
    """Record every group call made inside the block into a Chrome/Perfetto trace file.

    Args:
        path: where to write the JSON trace.

    Example:
        >>> with sc.trace("trace.json"):  # doctest: +SKIP
        ...     wg.double(batch)
    """
    global _active
    if _active is not None:
        raise RuntimeError(f"a trace is already being recorded to {_active.path!r}; traces do not nest")
    _active = Trace(path)
    try:
        yield _active
    finally:
        recorded, _active = _active, None
        recorded.write()


def active() -> Trace | None:
    return _active
