"""Controller-side state of the ``process`` backend's worker processes, and how they end."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

from spmdcall.backends.futures import RankFutureBase
from spmdcall.backends.process_worker import SHUTDOWN
from spmdcall.errors import WorkerDiedError
from spmdcall.transport.channel import Channel
from spmdcall.worker import SPMDContext


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class WorkerHandle:
    """Controller-side state of one worker process. ``send_lock`` orders the frames on the socket
    and guards ``pending`` against a death being recorded at the same time."""

    def __init__(self, ctx: SPMDContext, popen: subprocess.Popen, channel: Channel):
        self.ctx, self.popen, self.channel = ctx, popen, channel
        self.next_id = 1
        self.pending: dict[int, RankFutureBase] = {}  # by call id
        self.died: WorkerDiedError | None = None
        self.send_lock = threading.Lock()
        self.ready = threading.Event()  # set once the worker built its class


def end_processes(handles: list[WorkerHandle], grace_s: float) -> None:
    """Ask every worker to exit, then kill the ones still there after ``grace_s``."""
    for h in handles:
        if grace_s > 0 and h.popen.poll() is None and h.died is None:
            # A thread stuck sending to a busy worker holds the lock: then just kill it.
            if h.send_lock.acquire(timeout=min(grace_s, 0.5)):
                try:
                    h.channel.send(SHUTDOWN)
                except OSError:
                    pass
                finally:
                    h.send_lock.release()
    deadline = time.monotonic() + grace_s
    for h in handles:
        try:
            h.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            h.popen.kill()
            h.popen.wait()


def kill(handles: list[WorkerHandle], grace_s: float, wake: tuple[int, int]) -> None:
    """End the workers and close every descriptor. At exit, for a group never shut down."""
    end_processes(handles, grace_s)
    for h in handles:
        h.channel.close()
    for fd in wake:
        with contextlib.suppress(OSError):
            os.close(fd)


def exit_detail(h: WorkerHandle) -> str:
    """How the worker of ``h`` ended (its exit code or signal), for a WorkerDiedError."""
    try:
        code = h.popen.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return f"pid {h.popen.pid} closed its connection"
    if code < 0:
        try:
            return f"pid {h.popen.pid} killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"pid {h.popen.pid} exited with code {code}"
