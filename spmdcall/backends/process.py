"""The ``process`` backend: one local process per rank, no cluster needed (the default).

Workers are started with ``subprocess`` (a fresh interpreter, like ``spawn``, so a script needs no
``if __name__ == "__main__"`` guard) in their own session, so Ctrl-C reaches only the controller.
Each is connected by a Unix socket; tensors cross in shared memory (see ``channel.py``).

A worker exits when its controller goes away: the socket reaches EOF, and a watchdog thread notices
the parent's death even while a method is running.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from spmdcall import serialize
from spmdcall.backends import Call
from spmdcall.backends.channel import Channel, encode, spin_until_readable
from spmdcall.backends.channel import pool as channel_pool
from spmdcall.errors import CallTimeoutError, WorkerDiedError, WorkerError, format_user_traceback
from spmdcall.resource_pool import ResourcePool
from spmdcall.worker import ClassWithInitArgs, SPMDContext

_SHUTDOWN = "__spmdcall_shutdown__"
_WATCHDOG_INTERVAL_S = 0.2


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class _ProcessFuture:
    """The pending result of one call on one worker process."""

    __slots__ = ("rank", "method", "started_ns", "finished_ns", "_backend", "_state", "_value", "__weakref__")

    def __init__(self, backend: ProcessBackend, rank: int, method: str):
        self.rank, self.method, self._backend = rank, method, backend
        self.started_ns = self.finished_ns = 0
        self._state = "pending"  # -> "ok" | "error"
        self._value: Any = None

    def done(self) -> bool:
        if self._state == "pending":
            self._backend._poll(self.rank)
        return self._state != "pending"

    def result(self, timeout: float | None = None) -> Any:
        return self._backend.wait([self], timeout)[0]

    def _settle(self, state: str, value: Any, started_ns: int = 0, finished_ns: int = 0) -> None:
        self._state, self._value, self.started_ns, self.finished_ns = state, value, started_ns, finished_ns


class _WorkerHandle:
    """Controller-side state of one worker process."""

    def __init__(self, ctx: SPMDContext, popen: subprocess.Popen, channel: Channel):
        self.ctx, self.popen, self.channel = ctx, popen, channel
        self.next_id = 1
        self.pending: dict[int, _ProcessFuture] = {}
        self.frames_read = 0  # replies read so far: tells a reader whether another read first
        self.died: WorkerDiedError | None = None
        self.send_lock = threading.Lock()


def _kill(handles: list[_WorkerHandle], grace_s: float) -> None:
    """Ask every worker to exit, then kill the ones still there after ``grace_s``. Used at exit too."""
    for h in handles:
        if h.popen.poll() is None and h.died is None:
            try:
                with h.send_lock:
                    h.channel.send(_SHUTDOWN)
            except OSError:
                pass
    deadline = time.monotonic() + grace_s
    for h in handles:
        try:
            h.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            h.popen.kill()
            h.popen.wait()
        h.channel.close()


class ProcessBackend:
    """Workers as local processes. ``start_timeout`` bounds process start plus the constructor;
    ``spin_us`` is how long each side polls for the other's next message before it sleeps."""

    name = "process"
    accepts_rank_futures = False

    def __init__(
        self,
        start_timeout: float = 300.0,
        shutdown_grace: float = 3.0,
        env: dict[str, str] | None = None,
        spin_us: float = 300.0,
    ):
        if not spin_us >= 0:
            raise ValueError(f"spin_us must be a number of microseconds >= 0, got {spin_us!r}")
        self.start_timeout = start_timeout
        self.shutdown_grace = shutdown_grace
        self.extra_env = dict(env or {})
        self.spin_s = spin_us * 1e-6
        self._handles: list[_WorkerHandle] = []
        self._read_lock = threading.RLock()
        self._finalizer: weakref.finalize | None = None
        self._keep_core = False

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, pool: ResourcePool, cls_with_init: ClassWithInitArgs, *, group_name: str) -> None:
        try:
            self._payload = serialize.dumps_inline(cls_with_init)
        except Exception as exc:
            raise TypeError(
                f"{cls_with_init!r} (its class or init arguments) cannot be pickled: {exc}"
            ) from exc
        self._group_name = group_name
        contexts = pool.contexts("127.0.0.1", free_port())
        self._handles = [self._spawn(ctx) for ctx in contexts]
        # The controller polls for replies without yielding its core only when every worker can
        # have a core beside it. With more processes than cores, a worker that shares the
        # controller's core would wait out the whole spin window before it could reply: on 2
        # cores, world 2, such phases ran 370-570 us a call for hundreds of calls (33 us
        # otherwise): mean 127 us, p99 655 us; yielding: mean 51 us, p99 85 us (docs/benchmarks.md).
        self._keep_core = len(contexts) < _usable_cores()
        # Kill the workers if the group is garbage-collected or the interpreter exits without shutdown().
        self._finalizer = weakref.finalize(self, _kill, self._handles, 1.0)
        try:
            self._wait_ready(self._handles)
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, ctx: SPMDContext) -> _WorkerHandle:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, **self.extra_env, **ctx.env()}
        # Like torchrun: ranks sharing a machine split its cores, instead of each starting a thread
        # per core and all of them fighting over the same cores (collectives then crawl).
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ctx.local_world_size)))
        try:
            popen = subprocess.Popen(
                [sys.executable, "-m", "spmdcall.backends.process", str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=env,
                start_new_session=True,  # Ctrl-C in the terminal goes to the controller only
            )
        finally:
            child.close()
        handle = _WorkerHandle(ctx, popen, Channel(parent, keep_descriptors=True))
        handle.channel.send(
            {
                "sys_path": list(sys.path),
                "payload": self._payload,
                "controller_pid": os.getpid(),
                "group": self._group_name,
                "spin_s": self.spin_s,
            }
        )
        return handle

    def _wait_ready(self, handles: list[_WorkerHandle]) -> None:
        deadline = time.monotonic() + self.start_timeout
        waiting = {h.channel.fileno(): h for h in handles}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"workers {sorted(h.ctx.rank for h in waiting.values())} did not start within {self.start_timeout:g} s"
                )
            ready = [fd for fd, h in waiting.items() if h.channel.buffered()]
            ready = ready or select.select(list(waiting), [], [], remaining)[0]
            for fd in ready:
                h = waiting.pop(fd)
                try:
                    _, (status, detail) = h.channel.recv()
                except (EOFError, OSError):
                    raise WorkerDiedError(h.ctx.rank, "__init__", self._exit_detail(h)) from None
                if status != "ready":
                    raise WorkerError(h.ctx.rank, "__init__", detail[1], detail[0])

    def restart(self, ranks: list[int] | None) -> None:
        if ranks is None:
            ranks = [h.ctx.rank for h in self._handles if h.died is not None or h.popen.poll() is not None]
        for rank in ranks:
            old = self._handles[rank]
            _kill([old], 0.0)
            for fut in old.pending.values():
                fut._settle("error", WorkerDiedError(rank, fut.method, "the rank was restarted"))
            self._handles[rank] = self._spawn(old.ctx)
        self._wait_ready([self._handles[r] for r in ranks])

    def shutdown(self) -> None:
        if self._finalizer is not None and self._finalizer.alive:
            self._finalizer.detach()
            _kill(self._handles, self.shutdown_grace)

    def worker_info(self) -> list[dict[str, Any]]:
        return [{"rank": h.ctx.rank, "pid": h.popen.pid, "host": socket.gethostname()} for h in self._handles]

    # -- calls -------------------------------------------------------------------------------

    def submit(self, calls: list[Call]) -> list[_ProcessFuture]:
        for c in calls:
            died = self._handles[c.rank].died
            if died is not None:
                raise WorkerDiedError(c.rank, c.method, f"{died.detail}; call restart() to bring it back")
        frames = self._encode_all(calls)
        futures = []
        try:
            for c, frame in zip(calls, frames):
                h = self._handles[c.rank]
                fut = _ProcessFuture(self, c.rank, c.method)
                with h.send_lock:
                    call_id = h.next_id
                    h.next_id += 1
                    h.pending[call_id] = fut
                    try:
                        h.channel.send_frame(frame, call_id)
                    except OSError:
                        self._mark_dead(h)
                futures.append(fut)
        finally:
            for frame in {id(f): f for f in frames}.values():
                frame.discard()  # leases of frames that could not be sent
        return futures

    def _encode_all(self, calls: list[Call]) -> list:
        # Serialise everything before sending anything. Calls with the very same argument objects
        # (ONE_TO_ALL, or tensor-parallel replicas of one data chunk) share one encoded frame and
        # one shared-memory file.
        keys = [
            (c.role, c.method, tuple(map(id, c.args)), tuple((k, id(v)) for k, v in c.kwargs.items()))
            for c in calls
        ]
        receivers = {k: keys.count(k) for k in keys}
        encoded: dict = {}
        try:
            for c, key in zip(calls, keys):
                if key not in encoded:
                    encoded[key] = self._encode(c, receivers[key])
        except BaseException:
            for frame in encoded.values():
                frame.discard()
            raise
        return [encoded[k] for k in keys]

    @staticmethod
    def _encode(c: Call, receivers: int):
        try:
            # Rank outputs handed from rank to rank: the workers' segments are passed on, not copied.
            return encode((c.role, c.method, c.args, c.kwargs), receivers=receivers, forward=c.handed_off)
        except Exception as exc:
            values = {f"argument {i}": a for i, a in enumerate(c.args)} | {
                f"argument {k!r}": v for k, v in c.kwargs.items()
            }
            culprit = serialize.describe_unpicklable(values) or str(exc)
            raise TypeError(f"cannot send {c.method}() to rank {c.rank}: {culprit}") from exc

    def wait(self, futures: list[_ProcessFuture], timeout: float | None = None) -> list[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pending = []
            for f in futures:
                if f._state == "pending":
                    pending.append(f)
                elif f._state == "error":
                    raise f._value
            if not pending:
                return [f._value for f in futures]
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                assert timeout is not None  # there is a deadline only when there is a timeout
                raise CallTimeoutError(pending[0].method, timeout, sorted({f.rank for f in pending}))
            handles = {}
            for f in pending:
                h = self._handles[f.rank]
                handles[h.channel.fileno()] = (h, h.frames_read)
            # Replies read already (with an earlier one), else those that come within the spin
            # window, read without the cost of a wake-up, else the first to come.
            ready = [fd for fd, (h, _) in handles.items() if h.channel.buffered()] or (
                spin_until_readable(list(handles), self.spin_s, yield_core=not self._keep_core)
                or select.select(list(handles), [], [], remaining)[0]
            )
            for fd in ready:
                self._read_one(*handles[fd])

    def concat_results(self, futures: list[_ProcessFuture], timeout: float | None = None) -> Any:
        """The DataProto results of ``futures`` concatenated (as ``DataProto.concat``), each large
        column joined into a free shared-memory segment of this process rather than new memory
        (measured for a 16 MiB column: 2.2 ms against 3.9-4.5 ms, most of it page faults); None
        when they are not all DataProtos (the caller then collects as usual)."""
        outputs = self.wait(futures, timeout)
        from spmdcall.data import DataProto

        if not outputs or not all(isinstance(o, DataProto) for o in outputs):
            return None
        return DataProto._concat(outputs, alloc=channel_pool().lend_out)

    def _poll(self, rank: int) -> None:
        h = self._handles[rank]
        while h.died is None and h.channel.readable():
            self._read_one(h)

    def _read_one(self, h: _WorkerHandle, seen_readable_after: int = -1) -> None:
        """Read one reply of ``h``. ``seen_readable_after``: the number of replies read when the
        caller saw its socket readable; if still so, no other thread read in between."""
        with self._read_lock:
            if h.died is not None or (h.frames_read != seen_readable_after and not h.channel.readable()):
                return  # another thread read it first
            try:
                call_id, (status, value, started_ns, finished_ns) = h.channel.recv()
            except (EOFError, OSError):
                self._mark_dead(h)
                return
            h.frames_read += 1
            fut = h.pending.pop(call_id, None)
            if fut is None:
                return  # a call whose future was dropped
            if status == "ok":
                fut._settle("ok", value, started_ns, finished_ns)
            elif status == "unpicklable":
                fut._settle(
                    "error",
                    TypeError(
                        f"the result of {fut.method}() on rank {h.ctx.rank} cannot be pickled: {value}"
                    ),
                )
            else:
                exc_type, tb = value
                fut._settle(
                    "error", WorkerError(h.ctx.rank, fut.method, tb, exc_type), started_ns, finished_ns
                )

    def _mark_dead(self, h: _WorkerHandle) -> None:
        detail = self._exit_detail(h)
        first = next(iter(h.pending.values()), None)
        h.died = WorkerDiedError(h.ctx.rank, first.method if first else None, detail)
        for fut in h.pending.values():
            fut._settle("error", WorkerDiedError(h.ctx.rank, fut.method, detail))
        h.pending.clear()

    @staticmethod
    def _exit_detail(h: _WorkerHandle) -> str:
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


# -- the worker side ---------------------------------------------------------------------------


def _watch_parent(controller_pid: int) -> None:
    while True:
        time.sleep(_WATCHDOG_INTERVAL_S)
        if os.getppid() != controller_pid:
            os._exit(1)  # the controller is gone: never linger as an orphan


def _error_payload() -> tuple[str, str]:
    exc_type = sys.exc_info()[0]
    return (exc_type.__name__ if exc_type else "Exception", format_user_traceback())


def _worker_main(fd: int) -> None:
    channel = Channel(socket.socket(fileno=fd))
    _, init = channel.recv()
    sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
    threading.Thread(
        target=_watch_parent, args=(init["controller_pid"],), daemon=True, name="spmdcall-watchdog"
    ).start()
    try:
        instance = serialize.loads(init["payload"])()
    except BaseException:
        channel.send(("error", _error_payload()))
        return
    channel.send(("ready", os.getpid()))
    serve(channel, instance, init["spin_s"])


def serve(channel: Channel, instance: Any, spin_s: float = 0.0) -> None:
    """Run calls from the controller on ``instance`` until told to stop or the controller is gone.
    After each reply, poll ``spin_s`` seconds for the next call before sleeping in ``recv``."""

    # Set to None once the reply is encoded (see below), hence Optional.
    payload: memoryview | None
    buffers: list[Any] | None
    reply: tuple[str, Any] | None
    while True:
        try:
            call_id, payload, buffers = channel.recv_raw()
        except (EOFError, OSError):
            return
        started = time.time_ns()
        try:
            message = serialize.loads(payload, buffers)
            if message == _SHUTDOWN:
                return
            role, method, args, kwargs = message
            target = instance if role is None else instance.role(role)
            reply = ("ok", getattr(target, method)(*args, **kwargs))
        except BaseException:
            reply = ("error", _error_payload())
        finished = time.time_ns()
        try:
            frame = channel.encode_reply((*reply, started, finished))
        except Exception as exc:
            frame = encode(("unpicklable", f"{type(exc).__name__}: {exc}", started, finished))
        # Drop this call's arguments and result before replying, so the reply already tells the
        # controller which of its segments are free, an idle worker pins no memory, and returned
        # views of a received segment nothing else here uses go back by reference (channel.py).
        message = reply = args = kwargs = payload = buffers = None
        try:
            channel.send_frame(frame, call_id)
        except (BrokenPipeError, ConnectionError):
            return
        finally:
            frame.discard()
        if not channel.buffered():
            spin_until_readable([channel.fileno()], spin_s)


if __name__ == "__main__":
    try:
        _worker_main(int(sys.argv[1]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown: library threads must not keep a finished worker alive
