"""The ``inline`` backend: every rank is an object in the controller's process, called in turn.

Made for debugging: a ``breakpoint()`` inside a worker method stops in your terminal, and a
traceback points at your code. Arguments and results are copied through the same serialisation as
the process backend, so a method that mutates its input behaves the same on every backend, and an
unpicklable argument fails here too. Ranks run one after another, so collectives between ranks
(torch.distributed with world size > 1) need the ``process`` or ``ray`` backend.

Calls made from several threads run one at a time (the ranks share this process and its
environment). A worker class with ``async def`` methods runs its calls on an event loop in a
thread of the backend, as the other backends run them on the worker's loop: async calls overlap.
"""

from __future__ import annotations

import asyncio
import bdb
import os
import threading
import time
import traceback
from typing import Any

from spmdcall import serialize
from spmdcall.backends import Call, Capabilities
from spmdcall.backends.futures import RankFutureBase, wait_settled
from spmdcall.errors import CallInterrupted, WorkerDiedError, WorkerError, format_user_traceback
from spmdcall.lazy import loaded
from spmdcall.rendezvous import START_ATTEMPTS, PortReservation, log_retry, port_taken
from spmdcall.resource_pool import ResourcePool
from spmdcall.runtime.calls import CallRunner, runs_on_event_loop
from spmdcall.runtime.reports import RankReport, capture
from spmdcall.transport.envelope import Opened
from spmdcall.worker import ClassWithInitArgs, SPMDContext, active_context

# Ranks of every inline group run one call at a time: a call sets its rank's variables in the
# environment of this process (reentrant: a worker method may call another inline group).
_RUN_LOCK = threading.RLock()


class _InlineFuture(RankFutureBase):
    """A call that ran already, or that runs on the backend's event loop."""

    __slots__ = ("_backend",)

    def __init__(self, backend: InlineBackend, rank: int, method: str):
        super().__init__(rank, method)
        self._backend = backend

    def done(self) -> bool:
        return self.state != "pending"

    def result(self, timeout: float | None = None) -> Any:
        return wait_settled([self], timeout)[0]


class InlineBackend:
    """Workers as plain objects in this process. ``copy=False`` passes arguments by reference."""

    name = "inline"
    capabilities = Capabilities(ranks_in_own_processes=False, reports=True, cancel=True, resize=True)

    def __init__(self, copy: bool = True):
        self.copy = copy
        self._instances: list[Any] = []
        self._runners: list[CallRunner] = []
        self._contexts: list[SPMDContext] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._port: PortReservation | None = None  # the rendezvous port, held while the group lives

    def start(self, pool: ResourcePool, cls_with_init: ClassWithInitArgs, *, group_name: str) -> None:
        self._cls_with_init = cls_with_init
        self._had_process_group = _process_group_initialized()
        for attempt in range(1, START_ATTEMPTS + 1):  # as the process backend does (rendezvous.py)
            self._port = PortReservation("127.0.0.1")
            self._contexts = pool.contexts("127.0.0.1", self._port.port)
            try:
                with _RUN_LOCK:
                    self._instances = [self._build(ctx) for ctx in self._contexts]
                break
            except WorkerError as exc:
                self._port.close()
                if attempt == START_ATTEMPTS or not port_taken(exc, self._contexts[0].master_port):
                    raise
                log_retry(self._contexts[0].master_port, attempt)
        self._runners = [CallRunner(instance) for instance in self._instances]
        if runs_on_event_loop(cls_with_init):
            self._start_loop(group_name)

    def _build(self, ctx: SPMDContext) -> Any:
        with active_context(ctx):
            cls_with_init = _copy_init_args(self._cls_with_init) if self.copy else self._cls_with_init
            try:
                return cls_with_init()
            except Exception as exc:
                raise WorkerError(ctx.rank, "__init__", traceback.format_exc(), type(exc).__name__) from exc

    def _start_loop(self, group_name: str) -> None:
        started = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop, self._queue = loop, asyncio.Queue()
            started.set()
            loop.run_until_complete(self._serve())
            loop.close()

        threading.Thread(target=run, name=f"spmdcall-inline-{group_name}", daemon=True).start()
        started.wait()

    def submit(self, calls: list[Call]) -> list[_InlineFuture]:
        if self.copy:  # copy (and so check) every argument before running anything
            try:
                copies = [serialize.copy((c.args, c.kwargs)) for c in calls]
                calls = [Call(c.rank, c.method, a, kw, c.role) for c, (a, kw) in zip(calls, copies)]
            except Exception as exc:
                c = calls[0]
                values = {f"argument {i}": a for c in calls for i, a in enumerate(c.args)}
                culprit = serialize.describe_unpicklable(values) or str(exc)
                raise TypeError(f"cannot send {c.method}() to the workers: {culprit}") from exc
        futures = [_InlineFuture(self, c.rank, c.method) for c in calls]
        if self._loop is None:
            with _RUN_LOCK:
                for c, fut in zip(calls, futures):
                    self._run(c, fut, self._runners[c.rank], self._contexts[c.rank])
        else:
            assert self._queue is not None
            for c, fut in zip(
                calls, futures
            ):  # the loop takes them in this order, on the rank they go to now
                item = (c, fut, self._runners[c.rank], self._contexts[c.rank])
                self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        return futures

    def _run(self, c: Call, fut: _InlineFuture, runner: CallRunner, ctx: SPMDContext) -> None:
        started = time.time_ns()
        with active_context(ctx):
            try:
                ok, value = True, runner.run(c.role, c.method, c.args, c.kwargs)
            except bdb.BdbQuit:
                raise  # "q" in the debugger stops the program, as it would outside a group
            except (Exception, CallInterrupted) as exc:  # the traceback starts below CallRunner.run
                ok, value = False, WorkerError(c.rank, c.method, format_user_traceback(2), type(exc).__name__)
        self._settle(c, fut, ok, value, started)

    async def _serve(self) -> None:
        """On the backend's loop: start each call in turn (an async one runs to its first await)."""
        assert self._queue is not None
        tasks: set[asyncio.Task] = set()
        while True:
            item = await self._queue.get()
            if item is None:
                for task in tasks:
                    task.cancel()
                return
            c, fut, runner, ctx = item
            if runner.is_async(c.role, c.method):
                task = asyncio.get_running_loop().create_task(self._run_async(c, fut, runner))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(0)
            else:
                self._run(c, fut, runner, ctx)

    async def _run_async(self, c: Call, fut: _InlineFuture, runner: CallRunner) -> None:
        started = time.time_ns()
        try:
            ok, value = True, await runner.run_async(c.role, c.method, c.args, c.kwargs)
        except asyncio.CancelledError:  # past its deadline, or shutdown() with the call still running
            fut.settle("error", WorkerDiedError(c.rank, c.method, "the call was cancelled"))
            raise
        except Exception as exc:
            ok, value = False, WorkerError(c.rank, c.method, format_user_traceback(2), type(exc).__name__)
        self._settle(c, fut, ok, value, started)

    def _settle(self, c: Call, fut: _InlineFuture, ok: bool, value: Any, started: int) -> None:
        if ok and self.copy:
            try:
                value = serialize.copy(value)
            except Exception as exc:
                ok, value = (
                    False,
                    TypeError(
                        f"the result of {c.method}() on rank {c.rank} cannot be pickled: {type(exc).__name__}: {exc}"
                    ),
                )
        fut.settle("ok" if ok else "error", value, started, time.time_ns())

    def wait(self, futures: list[_InlineFuture], timeout: float | None = None) -> list[Opened]:
        return [Opened(value) for value in wait_settled(futures, timeout)]

    def worker_info(self) -> list[dict[str, Any]]:
        return [{"rank": ctx.rank, "pid": os.getpid(), "host": "localhost"} for ctx in self._contexts]

    def report(self, ranks: list[int], budget_s: float) -> dict[int, RankReport]:
        """Each rank's running calls, with the stacks of the threads running them: the ranks live
        in the controller's process, whose other threads are the controller's, not the rank's."""
        note = "inline: the stacks are of the controller's threads running this rank's calls"
        return {
            r: RankReport(r, **capture(self._runners[r].running, only_threads_running_calls=True), note=note)
            for r in ranks
        }

    def cancel(
        self, ranks: list[int], method: str, max_age_s: float, interrupt: bool, budget_s: float
    ) -> dict[int, str | None]:
        """Stop a call of ``method`` on each of ``ranks`` (``Capabilities.cancel``). Its ranks
        share this process: a plain call runs in the caller's thread (finished before the call
        returns) or on the backend's event loop thread, which ``interrupt`` interrupts."""
        return {r: self._runners[r].running.stop(method, max_age_s, interrupt) for r in ranks}

    def restart(self, ranks: list[int] | None) -> None:
        for rank in ranks or []:  # inline ranks never die; None restarts nothing
            with _RUN_LOCK:
                self._instances[rank] = self._build(self._contexts[rank])
            self._runners[rank] = CallRunner(self._instances[rank])

    def resize(self, keep: list[int], num_new: int, *, timeout: float | None) -> list[SPMDContext]:
        """Keep the ranks ``keep`` (renumbered in that order) and build ``num_new`` after them
        (``Capabilities.resize``). Calls already sent run on the objects they were sent to, a
        rank dropped here included, so ``timeout`` has nothing to wait for."""
        assert self._port is not None
        contexts = ResourcePool([len(keep) + num_new]).contexts("127.0.0.1", self._port.port)
        with _RUN_LOCK:
            joining = [self._build(ctx) for ctx in contexts[len(keep) :]]
            self._instances = [self._instances[r] for r in keep] + joining
            self._runners = [self._runners[r] for r in keep] + [CallRunner(i) for i in joining]
            self._contexts = contexts
        return contexts

    def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, None)  # type: ignore[union-attr]
            self._loop = None
        self._instances = []
        if self._port is not None:
            self._port.close()
        # A worker that called init_distributed() made the process group in this very process: a
        # process-backend worker would take it along when it exits, so the inline one goes here.
        if _process_group_initialized() and not getattr(self, "_had_process_group", True):
            import torch.distributed as dist

            dist.destroy_process_group()


def _process_group_initialized() -> bool:
    """Whether torch.distributed has a default process group here (without importing torch)."""
    dist = loaded("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _copy_init_args(cls_with_init: ClassWithInitArgs) -> ClassWithInitArgs:
    """A copy of the constructor arguments (each rank gets its own), keeping the class itself:
    copying a class defined in __main__ through cloudpickle would reset its attributes."""
    from spmdcall.runtime.roles import ColocatedClassWithInitArgs, colocate

    if isinstance(cls_with_init, ColocatedClassWithInitArgs):
        return colocate({name: _copy_init_args(role) for name, role in cls_with_init.roles.items()})
    args, kwargs = serialize.copy((cls_with_init.args, cls_with_init.kwargs))
    return ClassWithInitArgs(cls_with_init.cls, *args, **kwargs)
