"""The worker side of the ``process`` backend: one rank, forked from a template
(``template.py``) or started as ``python -m spmdcall.backends.process.worker FD REPORT_FD``.

The controller sends the class to build, then calls, each a frame on the socket ``FD`` (see
``channel.py``); every call gets one reply frame with the same call id. A worker class without
``async def`` methods is served by a plain loop: calls run one after another, and after each reply
the worker polls briefly for the next call before it sleeps. A class with one is served by an
event loop (``runtime/calls.py``): async calls overlap, and their replies go back as they finish.

A reporter thread answers report requests on the socket ``REPORT_FD`` (``runtime/reports.py``),
even while a call blocks the main thread.

The worker exits when its controller goes away: the socket reaches EOF, and a watchdog thread
notices the controller's death even while a method is running (it waits on a pidfd of the
controller, which wakes it the moment the controller ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from spmdcall import serialize
from spmdcall.errors import format_user_traceback
from spmdcall.runtime.calls import CallRunner, runs_on_event_loop
from spmdcall.runtime.reports import REPORTER_THREAD, serve_reports
from spmdcall.transport.channel import Channel, spin_until_readable
from spmdcall.transport.frames import Frame, encode

SHUTDOWN = "__spmdcall_shutdown__"
_WATCHDOG_INTERVAL_S = 0.2


def controller_pidfd(controller_pid: int) -> int | None:
    """A pidfd of this process's parent, the controller (None where the OS has no pidfds). Opened,
    then the parent checked again: had the controller ended before, its pid could be another's."""
    try:
        pidfd = os.pidfd_open(controller_pid)
    except (AttributeError, OSError):
        return None
    if os.getppid() != controller_pid:
        os._exit(1)  # the controller is gone already
    return pidfd


def _watch_controller(controller_pid: int, pidfd: int | None) -> None:
    """Exit the moment the controller ends: never linger as an orphan."""
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable once the controller has exited
        os._exit(1)
    while True:  # no pidfd here: look at the parent now and then
        time.sleep(_WATCHDOG_INTERVAL_S)
        if os.getppid() != controller_pid:
            os._exit(1)


def set_title(title: str) -> None:
    """Name this process as ``ps`` and ``top`` show it (its command line and its name)."""
    try:
        import setproctitle
    except ImportError:  # the name alone (15 bytes), without the optional package
        with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
            f.write(title[:15])
        return
    # Within the command line's own bytes: by default setproctitle writes over the environment's
    # too, and tools that read a process's environment (psutil's environ()) would find none.
    saved = os.environ.get("SPT_NOENV")
    os.environ["SPT_NOENV"] = "1"
    try:
        setproctitle.setproctitle(title)
    finally:
        if saved is None:
            del os.environ["SPT_NOENV"]
        else:
            os.environ["SPT_NOENV"] = saved


def _error_payload(skip: int = 1) -> tuple[str, str]:
    exc_type = sys.exc_info()[0]
    return (exc_type.__name__ if exc_type else "Exception", format_user_traceback(skip))


def _worker_main(
    fd: int,
    report_fd: int,
    pidfd: int | None = None,
    learned: Callable[[], list[str]] | None = None,
) -> None:
    """Be one rank: build the class the controller sends, then serve its calls. ``pidfd``: the
    controller's (a forked rank gets its template's; a spawned one opens its own). ``learned``:
    the modules this rank imported while it built its object that its template could import
    for the next ranks (sent with "ready"; None for a rank without a template)."""
    channel = Channel(socket.socket(fileno=fd))
    _, init = channel.recv()
    set_title(init["title"])
    sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
    controller_pid = init["controller_pid"]
    if pidfd is None:
        pidfd = controller_pidfd(controller_pid)
    threading.Thread(
        target=_watch_controller, args=(controller_pid, pidfd), daemon=True, name="spmdcall-watchdog"
    ).start()
    try:
        cls_with_init = serialize.loads(init["payload"])
        instance = cls_with_init()
    except BaseException:
        channel.send(("error", _error_payload()))
        return
    runner = CallRunner(instance)
    # The reporter answers "where are you" on a socket of its own, beside the calls (reports.py).
    threading.Thread(
        target=serve_reports,
        args=(socket.socket(fileno=report_fd), runner.running),
        daemon=True,
        name=REPORTER_THREAD,
    ).start()
    channel.send(("ready", {"pid": os.getpid(), "modules": learned() if learned is not None else []}))
    if runs_on_event_loop(cls_with_init):
        asyncio.run(serve_async(channel, runner))
    else:
        serve(channel, runner, init["spin_s"])


def _encode_reply(channel: Channel, reply: tuple) -> Frame:
    try:
        return channel.encode_reply(reply)
    except Exception as exc:
        return encode(("unpicklable", f"{type(exc).__name__}: {exc}", *reply[2:]))


def _send(channel: Channel, frame: Frame, call_id: int) -> bool:
    """Send one reply; False when the controller is gone. Drop the call's arguments and result
    before: the reply then already tells the controller which of its segments are free, an idle
    worker pins no memory, and returned views of a received segment that nothing else here uses
    go back by reference (channel.py)."""
    try:
        channel.send_frame(frame, call_id)
    except (BrokenPipeError, ConnectionError):
        return False
    finally:
        frame.discard()
    return True


class _Unreadable:
    """A call whose message could not be read: the error is its reply."""

    def __init__(self, payload: tuple[str, str]):
        self.payload = payload


def _next_call(channel: Channel) -> tuple[int, int, Any] | None:
    """The next call from the controller: its id, when it started, and its message (``(role,
    method, args, kwargs)``, SHUTDOWN, or ``_Unreadable``); None once the controller is gone. The
    received bytes are referenced by the message alone (see _send)."""
    try:
        call_id, payload, buffers = channel.recv_raw()
    except (EOFError, OSError):
        return None
    started = time.time_ns()
    try:
        return call_id, started, serialize.loads(payload, buffers)
    except BaseException:
        return call_id, started, _Unreadable(_error_payload())


def _run_plain(runner: CallRunner, message: Any) -> tuple[str, Any]:
    try:
        if isinstance(message, _Unreadable):
            return "error", message.payload
        role, method, args, kwargs = message
        return "ok", runner.run(role, method, args, kwargs)
    except BaseException:
        return "error", _error_payload(skip=2)  # this frame and CallRunner.run's


def serve(channel: Channel, runner: CallRunner, spin_s: float = 0.0) -> None:
    """Run calls from the controller on the runner's instance until told to stop or the controller
    is gone. After each reply, poll ``spin_s`` seconds for the next call before sleeping in ``recv``."""
    reply: tuple[str, Any] | None  # set to None once the reply is built (see _send)
    while True:
        call = _next_call(channel)
        if call is None or call[2] == SHUTDOWN:
            return
        call_id, started, message = call
        reply = _run_plain(runner, message)
        frame = _encode_reply(channel, (*reply, started, time.time_ns()))
        call = message = reply = None  # see _send
        if not _send(channel, frame, call_id):
            return
        if not channel.buffered():
            spin_until_readable([channel.fileno()], spin_s)


async def serve_async(channel: Channel, runner: CallRunner) -> None:
    """:func:`serve` on an event loop: calls start in the order they came; a call of an ``async
    def`` method runs as a task, up to its first ``await``, before the next call starts."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()
    reply: tuple[str, Any] | None  # set to None once the reply is built (see _send)
    try:
        while True:
            if not channel.buffered():
                await _readable(loop, channel.fileno())
            call = _next_call(channel)
            if call is None or call[2] == SHUTDOWN:
                return
            call_id, started, message = call
            if not isinstance(message, _Unreadable) and runner.is_async(message[0], message[1]):
                task = loop.create_task(_run_async(channel, runner, call_id, message))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                call = message = None
                await asyncio.sleep(0)  # the task starts before the next call does
                continue
            reply = _run_plain(runner, message)
            frame = _encode_reply(channel, (*reply, started, time.time_ns()))
            call = message = reply = None  # see _send
            if not _send(channel, frame, call_id):
                return
    finally:
        for task in tasks:
            task.cancel()


async def _run_async(channel: Channel, runner: CallRunner, call_id: int, call: tuple) -> None:
    started = time.time_ns()
    reply: tuple[str, Any] | None
    cancelled = False
    try:
        reply = ("ok", await runner.run_async(*call))
    except BaseException as exc:  # cancelled too (past its deadline): the controller hears of it
        cancelled = isinstance(exc, asyncio.CancelledError)
        reply = ("error", _error_payload(skip=2))  # this frame and CallRunner.run_async's
    frame = _encode_reply(channel, (*reply, started, time.time_ns()))
    call, reply = (), None  # see _send
    _send(channel, frame, call_id)
    if cancelled:
        raise asyncio.CancelledError


async def _readable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    """Return when ``fd`` has bytes to read (or has reached EOF)."""
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():  # the loop may call a reader again before the waiter resumes
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def run(
    fd: int, report_fd: int, pidfd: int | None = None, learned: Callable[[], list[str]] | None = None
) -> None:
    """Be one rank until the controller says stop or goes away, then end this process."""
    try:
        _worker_main(fd, report_fd, pidfd, learned)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown: library threads must not keep a finished worker alive


if __name__ == "__main__":
    run(int(sys.argv[1]), int(sys.argv[2]))
