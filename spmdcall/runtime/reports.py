"""Where a rank is: the calls it is running, and the Python stack of each of its threads.

A rank keeps the calls it runs in a :class:`RunningCalls` (its ``CallRunner`` does: a dict entry
per call, no message to anyone). A *reporter* thread beside the calls answers report requests on a
socket of its own (:func:`serve_reports`), so it answers while the thread running a call is
blocked in C (``time.sleep``, a lock, a collective): those release the GIL. A rank that holds the
GIL in C, or is stopped, does not answer; the controller waits for it at most its budget
(:class:`ReportClient`) and says so in the report instead.

The same reporter stops a call past its deadline (:meth:`RunningCalls.stop`): it cancels the
asyncio task of an ``async def`` call, or raises :class:`~spmdcall.CallInterrupted` in the
thread running a plain call (``PyThreadState_SetAsyncExc``: delivered when that thread next runs
Python bytecode, so a thread blocked in C gets it only once the C call returns).

On the wire a request is ``{"seq", "token"}`` (with ``"stop": {"method", "max_age",
"interrupt"}`` to stop a call first) and an answer ``{"seq", "pid", "calls", "threads"}`` (with
``"stopped"``: what it did), each a JSON frame (4-byte length, then the text): nothing is unpickled on either
side of a socket that another process on the network could reach.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import select
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any, Protocol

from spmdcall.errors import CallInterrupted, RankReport

# The name of the reporter's threads (left out of the reports: they are only ever answering).
REPORTER_THREAD = "spmdcall-reporter"
# Innermost frames kept of each stack (a deep recursion would otherwise fill the report).
STACK_LIMIT = 64
_LENGTH = struct.Struct(">I")
_MAX_FRAME = 64 << 20


class RunningCalls:
    """The calls one rank is running now: written by the threads that run them, read by the
    reporter thread (single dict operations, atomic under the GIL: no lock on the call path but
    :meth:`end`'s, which only :meth:`stop` contends for)."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[str, float, int, Any]] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._interrupted: set[int] = set()  # calls sent CallInterrupted, not yet ended

    def begin(self, method: str, task: asyncio.Task | None = None) -> int:
        """Record that ``method`` starts now in this thread (as ``task``, for an ``async def``
        method); the key to :meth:`end` it with."""
        key = next(self._keys)
        self._calls[key] = (method, time.monotonic(), threading.get_ident(), task)
        return key

    def end(self, key: int) -> None:
        """Record that the call ``key`` ended (in the thread that ran it). An interrupt sent to it
        and not delivered yet is withdrawn: it must not land in whatever this thread runs next."""
        with self._lock:
            entry = self._calls.pop(key, None)
            if key in self._interrupted:
                self._interrupted.discard(key)
                if entry is not None:
                    _set_async_exc(entry[2], None)

    def stop(self, method: str, max_age: float, interrupt: bool) -> str:
        """Stop the oldest running call of ``method`` started at most ``max_age`` seconds ago (the
        caller's call: one started before it was made is someone else's). An ``async def`` call's
        task is cancelled; a plain call is interrupted (``CallInterrupted`` raised in its thread)
        only with ``interrupt``. What was done: ``"cancelled"``, ``"interrupted"``, ``"left"``
        (a plain call, without ``interrupt``), or ``""``: no such call runs. Any thread."""
        with self._lock:
            now = time.monotonic()
            mine = [(t, k) for k, (m, t, _, _) in self._calls.items() if m == method and now - t <= max_age]
            if not mine:
                return ""
            key = min(mine)[1]
            _, _, ident, task = self._calls[key]
            if task is not None:
                task.get_loop().call_soon_threadsafe(task.cancel)
                return "cancelled"
            if not interrupt:
                return "left"
            if key not in self._interrupted:
                self._interrupted.add(key)
                _set_async_exc(ident, CallInterrupted)
            return "interrupted"

    def snapshot(self) -> list[tuple[str, float, int, Any]]:
        """``(method, age_s, thread ident, task or None)`` of each running call, oldest first."""
        now = time.monotonic()
        return [(m, now - t, ident, task) for m, t, ident, task in list(self._calls.values())]


def _set_async_exc(ident: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``ident`` when it next runs bytecode (None: withdraw one pending)."""
    import ctypes  # only a call past its deadline with on_timeout="interrupt" gets here

    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), None if exc is None else ctypes.py_object(exc)
    )


def capture(running: RunningCalls, only_threads_running_calls: bool = False) -> dict[str, Any]:
    """This process's report (as :class:`RankReport` fields, less the rank): its running calls
    and the stack of every thread but the reporter's (with ``only_threads_running_calls``: of
    the threads running one of ``running``'s calls, for ranks that share a process)."""
    calls = running.snapshot()
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    keep = {ident for _, _, ident, _ in calls} if only_threads_running_calls else set(frames)
    threads: dict[str, str] = {}
    for ident, frame in frames.items():
        name = names.get(ident, f"thread {ident}")
        if ident not in keep or name.startswith(REPORTER_THREAD):  # the reporter's own threads
            continue
        threads[name if name not in threads else f"{name} ({ident})"] = _format(frame)
    for method, _, _, task in calls:
        if task is not None:
            stack = _task_stack(task)
            name = f"task {method}"
            if stack:
                threads[name if name not in threads else f"{name} ({id(task)})"] = stack
    return {"pid": os.getpid(), "calls": [(m, age) for m, age, _, _ in calls], "threads": threads}


def _format(frame: Any) -> str:
    return "".join(traceback.format_list(traceback.extract_stack(frame, limit=STACK_LIMIT)))


def _task_stack(task: Any) -> str:
    """The stack of a suspended coroutine: its frame, then what it awaits, innermost last."""
    frames: list[tuple[Any, int]] = []
    coro = task.get_coro()
    while coro is not None and len(frames) < STACK_LIMIT:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append((frame, frame.f_lineno))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return "".join(traceback.format_list(traceback.StackSummary.extract(iter(frames))))


# -- the wire --------------------------------------------------------------------------------


def _send_json(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def serve_reports(
    sock: socket.socket, running: RunningCalls, token: str = "", **capture_options: Any
) -> None:
    """As a rank's reporter thread: answer each request on ``sock`` with this process's report,
    until the socket closes (or a request carries the wrong ``token``)."""
    buf = bytearray()
    with sock:
        while True:
            try:
                request = _next_frame(sock, buf, None)
            except (OSError, ValueError):  # the controller's end reset, or a corrupt stream: done
                return
            if request is None or request.get("token", "") != token:
                return
            stop = request.get("stop")
            stopped = {} if stop is None else {"stopped": running.stop(**stop)}
            report = capture(running, **capture_options)
            try:
                _send_json(sock, {"seq": request["seq"], **report, **stopped})
            except OSError:
                return


def listen_for_reports(host: str, running: RunningCalls, token: str) -> tuple[str, int]:
    """Start a reporter on a TCP port of ``host`` (for ranks the controller cannot hand a socket
    to, as Ray actors); each connection is served by a thread of its own. Its ``(host, port)``."""
    listener = socket.create_server((host, 0))

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            serving = threading.Thread(target=serve_reports, args=(conn, running, token), daemon=True)
            serving.name = REPORTER_THREAD
            serving.start()

    threading.Thread(target=accept, name=f"{REPORTER_THREAD}-accept", daemon=True).start()
    return host, listener.getsockname()[1]


def _next_frame(sock: socket.socket, buf: bytearray, deadline: float | None) -> dict[str, Any] | None:
    """The next JSON frame on ``sock`` (bytes read ahead stay in ``buf``); None at EOF, or when
    ``deadline`` (``time.monotonic()``) passes first."""
    while True:
        if len(buf) >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(buf)
            if n > _MAX_FRAME:
                raise ValueError(f"a report frame of {n} bytes: the stream is corrupt")
            if len(buf) >= _LENGTH.size + n:
                data = bytes(buf[_LENGTH.size : _LENGTH.size + n])
                del buf[: _LENGTH.size + n]
                return json.loads(data)
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if not select.select([sock], [], [], max(0.0, remaining))[0]:
                return None
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        buf += chunk


class ReportClient:
    """The controller's end of one rank's reporter: a connected socket, or the ``address`` (and
    ``token``) of a reporter that :func:`listen_for_reports` started, connected on first use.
    Safe from many threads: one request at a time; an answer that comes too late is skipped by
    the next request."""

    def __init__(
        self, sock: socket.socket | None = None, address: tuple[str, int] | None = None, token: str = ""
    ):
        assert (sock is None) != (address is None), "a socket or an address"
        self.sock, self.address, self.token = sock, address, token
        self._buf = bytearray()
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def ask(self, rank: int, deadline: float) -> RankReport:
        """The rank's report, or one whose ``note`` says why there is none by ``deadline``."""
        answer = self._request(rank, deadline, None)
        if isinstance(answer, RankReport):
            return answer
        calls = [(str(m), float(age)) for m, age in answer["calls"]]
        return RankReport(rank, calls, dict(answer["threads"]), answer.get("pid"))

    def stop(self, rank: int, deadline: float, stop: dict[str, Any]) -> str | None:
        """Have the rank stop a call (``stop``: :meth:`RunningCalls.stop`'s arguments); what it
        did (as ``RunningCalls.stop`` says), or None if it did not answer by ``deadline``."""
        answer = self._request(rank, deadline, stop)
        return None if isinstance(answer, RankReport) else str(answer.get("stopped", ""))

    def _request(
        self, rank: int, deadline: float, stop: dict[str, Any] | None
    ) -> dict[str, Any] | RankReport:
        """The rank's answer, or a report whose ``note`` says why there is none by ``deadline``."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return RankReport(rank, note="busy answering another report request")
        try:
            if self.sock is None:
                assert self.address is not None
                timeout = max(0.01, deadline - time.monotonic())
                self.sock = socket.create_connection(self.address, timeout=timeout)
            seq = next(self._seq)
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            _send_json(self.sock, {"seq": seq, "token": self.token, **({"stop": stop} if stop else {})})
            while True:
                answer = _next_frame(self.sock, self._buf, deadline)
                if answer is None:
                    if time.monotonic() < deadline:
                        return RankReport(rank, note="its reporter is gone (the rank died?)")
                    return RankReport(rank, note="did not answer in time (stopped, or holding the GIL in C?)")
                if answer.get("seq") == seq:
                    return answer
        except (OSError, ValueError) as exc:
            return RankReport(rank, note=f"its reporter cannot be reached: {type(exc).__name__}: {exc}")
        finally:
            self._lock.release()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def ask_all(clients: dict[int, ReportClient | str], budget_s: float) -> dict[int, RankReport]:
    """Every rank's report within ``budget_s`` seconds: the requests go out together, so ranks
    that answer do not wait behind one that does not. A rank given a string instead of a client
    (why it cannot be asked: it died, its reporter is not known yet) gets that string as its note."""
    asked = _all(
        _reachable(clients),
        budget_s,
        lambda r, c, deadline: c.ask(r, deadline),
        lambda r: RankReport(r, note="did not answer in time"),
    )
    return {r: asked[r] if r in asked else RankReport(r, note=str(c)) for r, c in clients.items()}


def stop_all(
    clients: dict[int, ReportClient | str], budget_s: float, method: str, max_age_s: float, interrupt: bool
) -> dict[int, str | None]:
    """Have every rank stop its call of ``method`` (:meth:`RunningCalls.stop`) within
    ``budget_s`` seconds: what each did, None for a rank that did not answer or cannot be asked
    (given a string, as for :func:`ask_all`)."""
    stop = {"method": method, "max_age": max_age_s, "interrupt": interrupt}
    done = _all(
        _reachable(clients), budget_s, lambda r, c, deadline: c.stop(r, deadline, stop), lambda r: None
    )
    return {r: done.get(r) for r in clients}


class Reachable(Protocol):
    """A backend's record of a rank, as :func:`reporters` reads it."""

    @property
    def died(self) -> Any:  # why the rank is gone (an error or a message), or None while it lives
        ...

    @property
    def reports(self) -> ReportClient | None:  # None until the rank says where its reporter is
        ...


def reporters(ranks: dict[int, Reachable]) -> dict[int, ReportClient | str]:
    """Each rank's reporter for :func:`ask_all` and :func:`stop_all`, or why it cannot be asked."""
    return {
        r: w.reports
        if w.died is None and w.reports is not None
        else str(w.died or "its reporter is not known yet")
        for r, w in ranks.items()
    }


def _reachable(clients: dict[int, ReportClient | str]) -> dict[int, ReportClient]:
    return {r: c for r, c in clients.items() if not isinstance(c, str)}


def _all(clients: dict[int, ReportClient], budget_s: float, ask: Any, missing: Any) -> dict[int, Any]:
    deadline = time.monotonic() + budget_s
    out: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda r=r, c=c: out.__setitem__(r, ask(r, c, deadline)), daemon=True)
        for r, c in clients.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 0.5)
    return {r: out[r] if r in out else missing(r) for r in clients}
