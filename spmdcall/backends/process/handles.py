"""Controller-side state of the ``process`` backend's worker processes: how calls are written to
them, and how they end."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import weakref

from spmdcall import serialize
from spmdcall.backends import Call
from spmdcall.backends.futures import RankFutureBase
from spmdcall.backends.process.start import RankProcess
from spmdcall.backends.process.worker import SHUTDOWN
from spmdcall.errors import WorkerDiedError, WorkerError
from spmdcall.runtime.reports import ReportClient
from spmdcall.transport.channel import Channel, small
from spmdcall.transport.frames import Frame, KeptSegments, encode
from spmdcall.worker import SPMDContext


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class WorkerHandle:
    """Controller-side state of one worker process.

    ``send_lock`` gives each call its id, guards ``pending`` against a death being recorded at the
    same time, and orders the frames: a small frame is prepared and held in the channel under it,
    a frame with shared memory is prepared under it and written right after the held ones.
    ``write_lock`` orders the writes on the socket; ``writing`` is set while a thread writes the
    held frames, and it writes those that other threads hold meanwhile too: many calls then go
    out in one write and wake the worker once. ``leave_to_writer``: a thread whose frame the
    writer takes goes on at once instead of waiting until it is written. That saves a switch of
    threads where the workers share the controller's cores, and costs time where the controller
    has cores to spare: its frame waits for the writer to get the GIL back (docs/concurrency.md)."""

    def __init__(
        self,
        ctx: SPMDContext,
        process: RankProcess,
        channel: Channel,
        *,
        leave_to_writer: bool,
        reports: ReportClient | None = None,
    ):
        self.ctx, self.process, self.channel = ctx, process, channel
        self.reports = reports  # the worker's reporter socket (runtime/reports.py)
        self.leave_to_writer = leave_to_writer
        self.next_id = 1
        self.pending: dict[int, RankFutureBase] = {}  # by call id
        self.died: WorkerDiedError | None = None
        self.send_lock = threading.Lock()
        self.write_lock = threading.Lock()
        self.writing = False
        self.ready = threading.Event()  # set once the worker built its class

    def close(self) -> None:
        """Close the sockets to the worker, and let go of its process."""
        self.channel.close()
        if self.reports is not None:
            self.reports.close()
        self.process.close()

    def send(self, fut: RankFutureBase, frame: Frame, *, hold: bool = False) -> None:
        """Give ``fut`` its call id and send its frame: write it, with the frames other threads
        left, unless another thread is writing; that thread then writes this one too, and this
        one goes on at once if ``leave_to_writer``, else when it is written. With ``hold`` (an
        event loop's calls), leave it for :meth:`flush` at the end of the loop's step unless the
        frames held fill a read. A frame with shared memory is written at once, by this thread
        (its descriptor must go before ``frame.discard()``). Raises ``OSError`` if the socket broke."""
        if not small(frame):
            self._send_with_descriptors(fut, frame)
            return
        wait = False
        with self.send_lock:
            call_id = self._register(fut)
            if not call_id:
                return
            if self.writing:  # the thread writing writes this one too, if it is still writing
                self.channel.hold_frame(frame, call_id)
                # Looked at again after the hold: the writer lets go before it looks for frames
                # held (_write_held), so one that has not let go yet finds this frame.
                if not self.writing:
                    data = self.channel.take_held()
                elif hold or self.leave_to_writer:
                    return
                else:
                    wait = True
            elif hold:
                self.channel.hold_frame(frame, call_id)
                if not self.channel.holding_enough():
                    return  # it goes when the loop's step ends
                data = self.channel.take_held()
            else:  # after the frames an event loop held, if any
                data = self.channel.take_held_and(frame, call_id)
            if not wait:
                self.writing = True
        if wait:
            with self.write_lock:  # free once the writer is done, with this frame too
                return
        self._write_held(data)

    def flush(self) -> None:
        """Write the frames held, unless another thread is writing them. Raises ``OSError`` if
        the socket broke."""
        with self.send_lock:
            if self.writing or self.died is not None or not self.channel.holding():
                return
            self.writing = True
            data = self.channel.take_held()
        self._write_held(data)

    def _write_held(self, data: bytes) -> None:
        """As the writer (``writing`` just set by this thread): write ``data`` (frames taken from
        the held ones), then those that other threads hold meanwhile, until none are left. On an
        error the role is given up, so that the next thread to send writes."""
        channel = self.channel
        try:
            with self.write_lock:
                while True:
                    channel.write(data)
                    # Let go first, then look: a thread that held a frame before this look leaves
                    # it here; one that holds it after finds no writer when it looks again (send)
                    # and writes it itself.
                    self.writing = False
                    if not channel.holding():
                        return
                    with self.send_lock:
                        if self.writing or self.died is not None:  # a dead worker's calls have failed
                            return
                        self.writing = True
                        data = channel.take_held()
        except BaseException:
            with self.send_lock:
                self.writing = False
            raise

    def _send_with_descriptors(self, fut: RankFutureBase, frame: Frame) -> None:
        with self.write_lock:
            with self.send_lock:
                call_id = self._register(fut)
                if not call_id:
                    return
                held = self.channel.take_held()  # they go first
                data, fds = self.channel.prepare(frame, call_id)
            if held:
                self.channel.write(held)
            self.channel.write(data, fds)

    def _register(self, fut: RankFutureBase) -> int:
        """``fut``'s call id (under ``send_lock``); 0, with ``fut`` failed, if the worker died."""
        if self.died is not None:  # died since the caller looked
            fut.settle("error", WorkerDiedError(fut.rank, fut.method, self.died.detail))
            return 0
        call_id = self.next_id
        self.next_id += 1
        self.pending[call_id] = fut
        return call_id


def encode_calls(calls: list[Call], kept: KeptSegments) -> list[Frame]:
    """The frames of ``calls``, all serialised before any is sent. Calls with the very same
    argument objects (ONE_TO_ALL, or tensor-parallel replicas of one data chunk) share one frame
    and one shared-memory file. ``kept``: the workers' segments a handed-off call may pass on."""
    keys = [
        (c.role, c.method, tuple(map(id, c.args)), tuple((k, id(v)) for k, v in c.kwargs.items()))
        for c in calls
    ]
    receivers = {k: keys.count(k) for k in keys}
    encoded: dict = {}
    try:
        for c, key in zip(calls, keys):
            if key not in encoded:
                frame = encoded[key] = _encode(c, receivers[key], kept)
                c.sent_bytes = len(frame.data) + frame.copied_bytes
                c.handed_on_bytes = frame.forwarded_bytes
    except BaseException:
        for frame in encoded.values():
            frame.discard()
        raise
    return [encoded[k] for k in keys]


def _encode(c: Call, receivers: int, kept: KeptSegments) -> Frame:
    try:
        # Rank outputs handed from rank to rank: the workers' segments are passed on, not copied.
        forward = kept if c.handed_off else None
        return encode((c.role, c.method, c.args, c.kwargs), receivers=receivers, forward=forward)
    except Exception as exc:
        values = {f"argument {i}": a for i, a in enumerate(c.args)} | {
            f"argument {k!r}": v for k, v in c.kwargs.items()
        }
        culprit = serialize.describe_unpicklable(values) or str(exc)
        raise TypeError(f"cannot send {c.method}() to rank {c.rank}: {culprit}") from exc


def end_processes(handles: list[WorkerHandle], grace_s: float) -> None:
    """Ask every worker to exit, then kill the ones still there after ``grace_s``."""
    for h in handles:
        if grace_s > 0 and h.process.alive() and h.died is None:
            # A thread stuck writing to a busy worker holds the lock: then just kill it.
            if h.write_lock.acquire(timeout=min(grace_s, 0.5)):
                try:
                    with h.send_lock:
                        data = h.channel.take_held() + h.channel.prepare(encode(SHUTDOWN))[0]
                    h.channel.write(data)  # outside send_lock: a full socket reads replies
                except OSError:
                    pass
                finally:
                    h.write_lock.release()
    deadline = time.monotonic() + grace_s
    for h in handles:
        if not h.process.wait(max(0.0, deadline - time.monotonic())):
            h.process.kill()
            h.process.wait(None)


def kill(handles: list[WorkerHandle], grace_s: float, wake: tuple[int, ...]) -> None:
    """End the workers and close every descriptor. At exit, for a group never shut down."""
    end_processes(handles, grace_s)
    for h in handles:
        h.close()
    for fd in wake:
        with contextlib.suppress(OSError):
            os.close(fd)


# Where a reply's value is in the tuple a worker replies with: (status, value, started_ns, finished_ns).
REPLY_VALUE = 1


def settle_reply(fut: RankFutureBase | None, rank: int, payload: bytes | memoryview, buffers: list) -> None:
    """Settle ``fut`` (None: a call whose future was dropped) with the reply read for it."""
    try:
        status, value, started_ns, finished_ns = serialize.loads(payload, buffers)
    except Exception as exc:
        if fut is not None:
            error = TypeError(f"the reply of {fut.method}() on rank {rank} cannot be unpickled here: {exc}")
            fut.settle("error", error)
        return
    if fut is None:
        return
    if status == "ok":
        fut.settle("ok", value, started_ns, finished_ns)
    elif status == "unpicklable":
        fut.settle(
            "error", TypeError(f"the result of {fut.method}() on rank {rank} cannot be pickled: {value}")
        )
    else:
        exc_type, tb = value
        fut.settle("error", WorkerError(rank, fut.method, tb, exc_type), started_ns, finished_ns)


def exit_detail(h: WorkerHandle) -> str:
    """How the worker of ``h`` ended (its exit code or signal), for a WorkerDiedError."""
    pid = h.process.pid
    if not h.process.wait(1.0):
        return f"pid {pid} closed its connection"
    code = h.process.exit_code()
    if code is None:
        return f"pid {pid} has ended (how is not known: the template that forked it is gone)"
    if code < 0:
        try:
            return f"pid {pid} killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"pid {pid} exited with code {code}"


def read_while_full(backend_ref: weakref.ref, h: WorkerHandle) -> None:
    """``Channel.when_full`` of ``h``'s channel, which must not keep the backend alive (a group
    dropped without ``shutdown()`` is collected, and its finalizer ends the workers)."""
    backend = backend_ref()
    if backend is None:
        raise BrokenPipeError(f"rank {h.ctx.rank} takes no more calls: its group is gone")
    backend.read_while_full(h)
