"""The ``process`` backend: one local process per rank, no cluster needed (the default).

Workers are forked from a warm template that has imported what they need (``start.py``),
or, with ``start_method="spawn"``, started as fresh interpreters; either way without re-running
the controller's script (no ``__main__`` guard needed), each in its own session, so Ctrl-C reaches
only the controller. Each is connected by a Unix socket; tensors cross in shared memory
(``channel.py``). Worker side: ``worker.py``.

Many threads may use one backend at once. Replies are read by one thread at a time, the *reader*:
whichever waiting thread finds the role free takes it, reads every worker's replies (its own and
other threads') and settles their futures; the others park until their futures settle or the role
is handed on to them. Futures awaited from asyncio have no thread of their own waiting on them:
the event loop that awaits them reads for them, in its own steps (``loops.py``), and a
reader thread of the backend, started on first use, reads for futures with done-callbacks added
outside any loop. A pipe wakes a reader thread out of ``select`` when ``restart`` or ``shutdown``
needs the sockets. Calls are written to a worker by one thread at a time: a thread that finds
another writing leaves its call to it (``WorkerHandle.send``), and a write that finds the socket
full reads replies meanwhile, since a worker that cannot reply stops reading calls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from spmdcall import serialize
from spmdcall.backends import Call, Capabilities
from spmdcall.backends.futures import RankFutureBase, Waiter, first_failure
from spmdcall.backends.process.handles import (
    REPLY_VALUE,
    WorkerHandle,
    encode_calls,
    end_processes,
    exit_detail,
    kill,
    read_while_full,
    settle_reply,
    usable_cores,
)
from spmdcall.backends.process.loops import (
    BUSY,
    GONE,
    READ,
    LoopReaders,
    hold_back,
    read_for_callbacks,
    running_loop,
    send_held,
)
from spmdcall.backends.process.start import (
    START_METHODS,
    ForkedProcess,
    RankProcess,
    SpawnedProcess,
    Templates,
    modules_of,
)
from spmdcall.errors import CallTimeoutError, WorkerDiedError, WorkerError
from spmdcall.rendezvous import START_ATTEMPTS, PortReservation, log_retry, port_taken
from spmdcall.resource_pool import ResourcePool
from spmdcall.runtime.reports import RankReport, ReportClient, ask_all, reporters, stop_all
from spmdcall.transport.channel import Channel, spin_until_readable
from spmdcall.transport.envelope import Envelope, Opened
from spmdcall.transport.frames import KeptSegments
from spmdcall.transport.segments import lend_out
from spmdcall.worker import ClassWithInitArgs, SPMDContext

# How long a write to a worker that takes no more bytes waits before it looks again (and reads
# replies, if no other thread has started to).
_FULL_WAIT_S = 0.05


class _ProcessFuture(RankFutureBase):
    """The pending result of one call on one worker process."""

    __slots__ = ("_backend", "as_sent", "__weakref__")

    def __init__(self, backend: ProcessBackend, rank: int, method: str):
        super().__init__(rank, method)
        self._backend = backend
        self.as_sent: Envelope | None = None  # the reply as the worker sent it (Opened.as_sent)

    def done(self) -> bool:
        if self.state == "pending":
            self._backend._poll()
        return self.state != "pending"

    def result(self, timeout: float | None = None) -> Any:
        return self._backend.wait([self], timeout)[0].open()

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        super().add_done_callback(fn)
        if self.state == "pending":
            self._backend._watch()  # nobody may be waiting in a thread: the backend's reader reads


class ProcessBackend:
    """Workers as local processes. ``start_timeout`` bounds process start plus the constructor;
    ``spin_us`` is how long each side polls for the other's next message before it sleeps.
    ``start_method``: ``"template"`` forks each rank from a warm template, ``"spawn"`` starts a
    fresh interpreter (for a class whose modules are not safe to fork); ``preload``: modules the
    template imports before it forks this group's ranks, beside the ones the class's pickle names.

    Safe to use from many threads and event loops at once (see the module's docstring)."""

    name = "process"
    _kept = KeptSegments()  # workers' segments to hand on, for every process group here (frames.py)
    _templates = Templates()  # the templates ranks are forked from, for every process group here
    # Results into segments paged in already; a reporter thread in each worker (report()).
    capabilities = Capabilities(
        result_alloc=lend_out, counts_bytes=True, reports=True, cancel=True, env=True, resize=True
    )

    def __init__(
        self,
        start_timeout: float = 300.0,
        shutdown_grace: float = 3.0,
        env: dict[str, str] | None = None,
        spin_us: float = 300.0,
        start_method: str = "template",
        preload: Sequence[str] = (),
    ):
        if not spin_us >= 0:
            raise ValueError(f"spin_us must be a number of microseconds >= 0, got {spin_us!r}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {list(START_METHODS)}, got {start_method!r}")
        if isinstance(preload, str) or not all(isinstance(m, str) and m for m in preload):
            raise TypeError(f"preload must be a list of module names, got {preload!r}")
        self.start_method = start_method
        self.preload = list(preload)
        self.start_timeout = start_timeout
        self.shutdown_grace = shutdown_grace
        self.extra_env = dict(env or {})
        self.spin_s = spin_us * 1e-6
        self._handles: list[WorkerHandle] = []
        self._finalizer: weakref.finalize | None = None
        self._port: PortReservation | None = None  # the rendezvous port, held while the group lives
        self._keep_core = False
        self.stopping = False  # shutdown() has begun (read by the reader thread, loops.py)
        # The reader role: free, or held by the one thread that reads replies. Threads that want it
        # queue in _role_waiters; restart and shutdown queue in front and set _role_wanted, which
        # makes the holder hand the role over at once instead of when its own calls are done.
        self._mutex = threading.Lock()
        self._role_free = True
        self._role_waiters: collections.deque[Waiter] = collections.deque()
        self._role_wanted = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._reader: threading.Thread | None = None
        self.reader_wanted = threading.Event()  # wakes the reader thread (loops.read_for_callbacks)
        # Event loops reading replies for the futures they await; ``_generation`` counts restarts.
        self._loops = LoopReaders(self._read_on_loop)
        self._generation = 0
        # Event loops that will send the frames their calls held back when their current step ends.
        self._flush_loops: set[asyncio.AbstractEventLoop] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, pool: ResourcePool, cls_with_init: ClassWithInitArgs, *, group_name: str) -> None:
        self._payload = serialize.dumps_worker_class(cls_with_init)
        self._modules = modules_of(self._payload, also=self.preload)
        self._title = " ".join(
            [
                "spmdcall",
                "+".join(r.cls.__name__ for r in cls_with_init.roles.values()) or cls_with_init.cls.__name__,
            ]
        )
        self._group_name = group_name
        # The controller polls for replies without yielding its core only when every worker can
        # have a core beside it: with more processes than cores, a worker that shares the
        # controller's core would wait out the whole spin window before it could reply (see
        # docs/benchmarks-log.md, "What bounds the results"). Threads that find another writing
        # their calls wait for it only then too (WorkerHandle).
        self._keep_core = pool.world_size < usable_cores()
        for attempt in range(1, START_ATTEMPTS + 1):
            # Held until shutdown, so rank 0 (and a restarted rank 0) finds it free (rendezvous.py).
            self._port = PortReservation("127.0.0.1")
            self._handles = [self._spawn(ctx) for ctx in pool.contexts("127.0.0.1", self._port.port)]
            # Kill the workers if the group is garbage-collected or the interpreter exits without shutdown().
            self._finalizer = weakref.finalize(self, kill, self._handles, 1.0, (self._wake_r, self._wake_w))
            try:
                self._wait_ready(self._handles)
                return
            except WorkerError as exc:
                if attempt == START_ATTEMPTS or not port_taken(exc, self._port.port):
                    self.shutdown()
                    raise
                log_retry(self._port.port, attempt)
                self._finalizer.detach()
                kill(self._handles, 0.0, ())
                self._port.close()
            except BaseException:
                self.shutdown()
                raise

    def _spawn(self, ctx: SPMDContext) -> WorkerHandle:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        reports, child_reports = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # the reporter's
        try:
            process = self._start_process(ctx, [child.fileno(), child_reports.fileno()])
        finally:
            child.close()
            child_reports.close()
        channel = Channel(parent, keep=self._kept)
        handle = WorkerHandle(
            ctx, process, channel, leave_to_writer=not self._keep_core, reports=ReportClient(reports)
        )
        channel.when_full = functools.partial(read_while_full, weakref.ref(self), handle)
        handle.channel.send(
            {
                "sys_path": list(sys.path),
                "payload": self._payload,
                "controller_pid": os.getpid(),
                "group": self._group_name,
                "spin_s": self.spin_s,
                "title": f"{self._title} {ctx.rank}/{ctx.world_size}",
            }
        )
        return handle

    def _start_process(self, ctx: SPMDContext, fds: list[int]) -> RankProcess:
        """The rank's process, on the sockets ``fds``: forked from the template of its environment,
        or (``start_method="spawn"``, or no template to be had) a fresh interpreter."""
        env = {**os.environ, **self.extra_env}
        rank_env = {**env, **ctx.env()}
        # Like torchrun: ranks sharing a machine split its cores, instead of each starting a thread
        # per core and all of them fighting over the same cores (collectives then crawl).
        rank_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ctx.local_world_size)))
        if self.start_method == "template":
            forked = self._templates.fork(env, rank_env, fds, self._modules, self.start_timeout)
            if forked is not None:
                return forked
        popen = subprocess.Popen(
            [sys.executable, "-m", "spmdcall.backends.process.worker", *(str(fd) for fd in fds)],
            pass_fds=fds,
            env=rank_env,
            start_new_session=True,  # Ctrl-C in the terminal goes to the controller only
        )
        return SpawnedProcess(popen)

    def _wait_ready(self, handles: list[WorkerHandle]) -> None:
        """Read each new worker's first message (no reader touches a handle before it is ready)."""
        deadline = time.monotonic() + self.start_timeout
        waiting = {h.channel.fileno(): h for h in handles}
        try:
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
                        raise WorkerDiedError(h.ctx.rank, "__init__", exit_detail(h)) from None
                    if status != "ready":
                        raise WorkerError(h.ctx.rank, "__init__", detail[1], detail[0])
                    if detail["modules"] and isinstance(h.process, ForkedProcess):
                        self._templates.learn(h.process.template.env, detail["modules"])
                    h.ready.set()
        except BaseException as exc:
            for h in waiting.values():  # calls waiting for these ranks fail instead of hanging
                h.died = WorkerDiedError(h.ctx.rank, "__init__", f"it did not start: {exc}")
                h.ready.set()
            raise

    def restart(self, ranks: list[int] | None) -> None:
        if ranks is None:
            ranks = [h.ctx.rank for h in self._handles if h.died is not None or not h.process.alive()]
        if not ranks:
            return
        with self._holding_role():  # nobody is reading the sockets we are about to close
            for rank in ranks:
                old = self._handles[rank]
                end_processes([old], 0.0)
                self._fail_pending(old, "the rank was restarted")
                old.close()
                self._handles[rank] = self._spawn(old.ctx)
            self._generation += 1
        self._wait_ready([self._handles[r] for r in ranks])

    def resize(self, keep: list[int], num_new: int, *, timeout: float | None) -> list[SPMDContext]:
        """Keep the ranks ``keep`` (renumbered in that order), start ``num_new`` after them, stop the
        others once their calls in flight are done (or ``timeout`` has passed): ``Capabilities.resize``.
        The ranks all live on this machine: one node of ``len(keep) + num_new`` ranks."""
        assert self._port is not None
        contexts = ResourcePool([len(keep) + num_new]).contexts("127.0.0.1", self._port.port)
        joining = [self._spawn(ctx) for ctx in contexts[len(keep) :]]
        try:
            self._wait_ready(joining)
        except BaseException:
            end_processes(joining, 0.0)
            for h in joining:
                h.close()
            raise
        leaving = [h for r, h in enumerate(self._handles) if r not in set(keep)]
        self._finish_calls(leaving, timeout)
        end_processes(leaving, self.shutdown_grace)
        with self._holding_role():  # nobody is reading the sockets we are about to close or renumber
            for h in leaving:
                self._fail_pending(
                    h, "the rank was stopped by a resize of its group before the call finished"
                )
                h.close()
            kept = [self._handles[r] for r in keep]
            for h, ctx in zip(kept, contexts):
                h.ctx = ctx  # its calls in flight settle by call id, whatever its rank now
            self._handles[:] = kept + joining  # the same list: the finalizer kills what it holds
            self._keep_core = len(self._handles) < usable_cores()
            self._generation += 1
        return contexts

    def _finish_calls(self, handles: list[WorkerHandle], timeout: float | None) -> None:
        """Wait until the calls pending on ``handles`` are done (failed ones too), or ``timeout`` passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in handles:
            for fut in [f for f in list(h.pending.values()) if isinstance(f, _ProcessFuture)]:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    self.wait([fut], remaining)
                except CallTimeoutError:
                    return
                except (WorkerError, WorkerDiedError):
                    pass  # done: its caller gets the error

    def shutdown(self) -> None:
        if self._finalizer is None or not self._finalizer.alive:
            return
        self._finalizer.detach()
        self.stopping = True
        self.reader_wanted.set()
        self._poke()
        end_processes(self._handles, self.shutdown_grace)
        with self._holding_role():  # readers have seen the workers' EOF; now close the sockets
            for h in self._handles:
                self._fail_pending(h, "the group was shut down")
                h.close()
        self._loops.close()
        if self._port is not None:
            self._port.close()
        wake, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in wake:
            os.close(fd)

    def worker_info(self) -> list[dict[str, Any]]:
        return [
            {"rank": h.ctx.rank, "pid": h.process.pid, "host": socket.gethostname()} for h in self._handles
        ]

    def report(self, ranks: list[int], budget_s: float) -> dict[int, RankReport]:
        """Where each of ``ranks`` is, asked of its reporter thread (``runtime/reports.py``)."""
        return ask_all(reporters({r: self._handles[r] for r in ranks}), budget_s)

    def cancel(
        self, ranks: list[int], method: str, max_age_s: float, interrupt: bool, budget_s: float
    ) -> dict:
        """Stop a call of ``method`` on each of ``ranks`` through its reporter (``Capabilities.cancel``)."""
        return stop_all(
            reporters({r: self._handles[r] for r in ranks}), budget_s, method, max_age_s, interrupt
        )

    # -- calls -------------------------------------------------------------------------------

    def submit(self, calls: list[Call]) -> list[_ProcessFuture]:
        for c in calls:
            self._live_handle(c.rank, c.method)
        frames = encode_calls(calls, self._kept)
        futures = []
        # Calls made from an event loop go out together when its current step ends: the tasks it
        # runs in one step then cost one write, and one wake-up, per worker (docs/concurrency.md).
        # Calls made from threads go out at once, unless another thread is writing to that worker:
        # it then writes them too (WorkerHandle.send).
        loop = running_loop()
        try:
            for c, frame in zip(calls, frames):
                h = self._handles[c.rank]
                fut = _ProcessFuture(self, c.rank, c.method)
                futures.append(fut)
                try:
                    h.send(fut, frame, hold=loop is not None)
                except OSError:
                    self._mark_dead(h)
        finally:
            for frame in {id(f): f for f in frames}.values():
                frame.discard()  # leases of frames that could not be sent
        if loop is not None:
            self._flush_at_end_of_step(loop)
        return futures

    def _flush_at_end_of_step(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._mutex:
            if loop in self._flush_loops:
                return
            self._flush_loops.add(loop)
        hold_back(self._flush_held)
        loop.call_soon(self._flush_held, loop)

    def _flush_held(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Send the frames held back for the end of an event loop's step (or for a wait)."""
        with self._mutex:
            if loop is None:
                self._flush_loops.clear()
            else:
                self._flush_loops.discard(loop)
        for h in list(self._handles):
            try:
                h.flush()
            except OSError:
                self._mark_dead(h)

    def _live_handle(self, rank: int, method: str) -> WorkerHandle:
        """The rank's worker, once a restart in progress has brought it up; raises if it is dead."""
        h = self._handles[rank]
        if not h.ready.is_set():
            if not h.ready.wait(self.start_timeout):
                raise WorkerDiedError(rank, method, f"it did not come back within {self.start_timeout:g} s")
            h = self._handles[rank]
        if h.died is not None:
            raise WorkerDiedError(rank, method, f"{h.died.detail}; call restart() to bring it back")
        return h

    def wait(self, futures: list[_ProcessFuture], timeout: float | None = None) -> list[Opened]:
        """The results (replies are read as values already: their tensors are views of the shared
        memory the workers wrote them to, writable)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                failure = first_failure(futures)
                if failure is not None:
                    raise failure
                pending = [f for f in futures if f.state == "pending"]
                if not pending:
                    return [Opened(f.value, f.as_sent) for f in futures]
                if self.stopping:
                    raise WorkerDiedError(pending[0].rank, pending[0].method, "the group was shut down")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    assert timeout is not None  # there is a deadline only when there is a timeout
                    raise CallTimeoutError(pending[0].method, timeout, sorted({f.rank for f in pending}))
                send_held()  # calls held back by event loops (the ones awaited may need them to run)
                if self._take_role_or_park(pending, remaining):
                    try:
                        self._read_until(functools.partial(_settled_or_failed, pending), deadline)
                    finally:
                        self._give_role()
        finally:
            if self._role_waiters:
                self._pass_idle_role()

    # -- reading replies ---------------------------------------------------------------------

    def _take_role_or_park(self, pending: list[_ProcessFuture], timeout: float | None) -> bool:
        """True: this thread is now the reader. False: it parked until all of ``pending`` settled
        (or one failed), the role was handed to it, or ``timeout`` passed (the caller looks again)."""
        with self._mutex:
            if self._role_free and not self._role_wanted:
                self._role_free = False
                return True
            waiter = Waiter(len(pending))
            self._role_waiters.append(waiter)
        try:
            if all(f.add_waiter(waiter) for f in pending):
                waiter.wait(timeout)
        finally:
            for f in pending:
                f.remove_waiter(waiter)
            with self._mutex:
                with contextlib.suppress(ValueError):
                    self._role_waiters.remove(waiter)
        return False

    def _take_free_role(self) -> bool:
        """Become the reader if the role is free and restart/shutdown do not want it."""
        with self._mutex:
            if not self._role_free or self._role_wanted:
                return False
            self._role_free = False
            return True

    def _give_role(self) -> None:
        with self._mutex:
            self._role_free = True
            waiter = self._next_in_line()
        if waiter is not None:
            waiter.fire()
        elif self._loops.watching and any(h.channel.buffered() for h in self._handles):
            self._loops.poke()  # replies read ahead: no socket signals them to the loops any more

    def _pass_idle_role(self) -> None:
        """Hand a free role to the next thread in line (a thread it was handed to may have left)."""
        with self._mutex:
            waiter = self._next_in_line() if self._role_free else None
        if waiter is not None:
            waiter.fire()

    def _next_in_line(self) -> Waiter | None:
        """The first parked thread that still waits (under ``_mutex``). A thread whose calls all
        settled was woken already and will not read: handing it the role would leave the replies
        unread until it runs and passes the role on."""
        while self._role_waiters:
            waiter = self._role_waiters.popleft()
            if not waiter.fired:
                return waiter
        return None

    @contextlib.contextmanager
    def _holding_role(self) -> Iterator[None]:
        """Hold the reader role, taking it from the current reader at once (restart, shutdown)."""
        with self._mutex:
            got = self._role_free
            self._role_free = False
            if not got:
                self._role_wanted += 1
                waiter = Waiter()
                self._role_waiters.appendleft(waiter)
        while not got:
            self._poke()
            waiter.wait(None)
            with self._mutex:
                got = self._role_free
                if got:
                    self._role_free = False
                    self._role_wanted -= 1
                else:
                    waiter = Waiter()
                    self._role_waiters.appendleft(waiter)
        try:
            yield
        finally:
            self._give_role()

    def _read_until(self, done: Callable[[], bool], deadline: float | None) -> None:
        """As the reader: read every worker's replies until ``done()``, ``deadline`` passes, or
        restart/shutdown wants the role."""
        while not self._role_wanted and not self.stopping:
            if done():
                return
            handles = {h.channel.fileno(): h for h in self._handles if h.died is None and h.ready.is_set()}
            # Replies read already (with an earlier one), else those that come within the spin
            # window, read without the cost of a wake-up, else the first to come.
            ready = [fd for fd, h in handles.items() if h.channel.buffered()]
            if not ready:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return
                watched = [*handles, self._wake_r]
                ready = spin_until_readable(watched, self.spin_s, yield_core=not self._keep_core)
                ready = ready or select.select(watched, [], [], remaining)[0]
            for fd in ready:
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                else:
                    self._read_one(handles[fd])

    def _poll(self) -> None:
        """Read the replies already there, if no other thread is reading (``done()``)."""
        send_held()  # a call held back for the end of an event loop's step is not done before it runs
        if self.stopping or not self._take_free_role():
            return
        try:
            for h in list(self._handles):
                while h.died is None and h.ready.is_set() and h.channel.readable():
                    self._read_one(h)
        finally:
            self._give_role()

    def _read_one(self, h: WorkerHandle) -> None:
        """Read one reply of ``h`` and settle its future (as the reader)."""
        try:
            call_id, payload, buffers, pass_on = h.channel.recv_sealed()
        except (EOFError, OSError):
            self._mark_dead(h)
            return
        fut = h.pending.pop(call_id, None)
        if isinstance(fut, _ProcessFuture):  # kept sealed too, to be handed on as it came (group/handoff.py)
            passed = None if pass_on is buffers else pass_on
            fut.as_sent = Envelope(bytes(payload), buffers, passed, item=REPLY_VALUE)
        settle_reply(fut, h.ctx.rank, payload, buffers)

    def _mark_dead(self, h: WorkerHandle) -> None:
        self._fail_pending(h, exit_detail(h))

    def _fail_pending(self, h: WorkerHandle, detail: str) -> None:
        """Record ``h`` as dead and fail every call still pending on it, whoever made it."""
        with h.send_lock:
            if h.died is None:
                first = next(iter(h.pending.values()), None)
                h.died = WorkerDiedError(h.ctx.rank, first.method if first else None, detail)
            pending = list(h.pending.values())
            h.pending.clear()
        for fut in pending:
            fut.settle("error", WorkerDiedError(h.ctx.rank, fut.method, detail))

    def _poke(self) -> None:
        """Wake the reader out of ``select``."""
        if self._wake_w >= 0:
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"\0")

    def _watch(self) -> None:
        """A future has a done-callback: make sure a thread reads replies for it (the event loop's,
        when it was added on one)."""
        loop = running_loop()
        if loop is not None:
            if not self.stopping:
                self._loops.watch(loop, self._handles, self._generation)
            return
        if self._reader is None:
            with self._mutex:
                if self._reader is None and not self.stopping:
                    self._reader = threading.Thread(
                        target=read_for_callbacks,
                        args=(weakref.ref(self),),
                        name=f"spmdcall-reader-{self._group_name}",
                        daemon=True,
                    )
                    self._reader.start()
        if not self.reader_wanted.is_set():
            self.reader_wanted.set()

    def read_while_full(self, h: WorkerHandle) -> None:
        """A write to ``h`` found its socket full: the worker is not reading our calls, maybe
        because it waits for us to read its replies (many calls made and none waited for yet).
        Read replies, unless another thread is the reader (it reads them), until the socket may
        take more. Raises ``BrokenPipeError`` once the group is shutting down (the worker is about
        to be ended: nothing written now would run)."""
        if self.stopping:
            raise BrokenPipeError(f"rank {h.ctx.rank} takes no more calls: the group is shutting down")
        reading = self._take_free_role()
        try:
            handles = {
                x.channel.fileno(): x
                for x in self._handles
                if reading and x.died is None and x.ready.is_set()
            }
            ready = [fd for fd, x in handles.items() if x.channel.buffered()]
            if not ready:
                ready = select.select(list(handles), [h.channel.fileno()], [], _FULL_WAIT_S)[0]
            for fd in ready:
                self._read_one(handles[fd])
        finally:
            if reading:
                self._give_role()

    def _read_on_loop(self, h: WorkerHandle) -> int:
        """On an event loop: read the replies of ``h`` that are there, unless another thread is the
        reader (``BUSY``: it reads them); ``GONE`` once ``h`` is no longer a live worker here."""
        if self.stopping or h.died is not None or h not in self._handles:
            return GONE
        if not self._take_free_role():
            return BUSY
        try:
            while h.died is None and h.channel.readable():
                self._read_one(h)
        finally:
            self._give_role()
        return READ if h.died is None else GONE

    def read_while_pending(self) -> None:
        """As the backend's reader thread: read replies while any call is pending (whoever made it),
        taking turns with the threads that wait on their own calls."""
        idle = lambda: not any(h.pending for h in self._handles)  # noqa: E731
        while not idle() and not self.stopping:
            if self._take_role_or_park([], 0.5):  # parked until the role is free (or a while)
                try:
                    self._read_until(idle, None)
                finally:
                    self._give_role()


def _settled_or_failed(futures: list[_ProcessFuture]) -> bool:
    return first_failure(futures) is not None or all(f.state != "pending" for f in futures)
