"""A complete backend in one small class: every rank is an object in this process with a thread of its own.

What it shows (docs/backends/writing-a-backend.md walks through it):

- the whole ``sc.Backend`` protocol: ``name``, ``capabilities``, ``start``, ``submit``,
  ``wait``, ``worker_info``, ``restart`` and ``shutdown``; nothing else is asked of a backend;
- rank futures built on ``spmdcall.backends.futures.RankFutureBase``, which gives waiting from many
  threads, asyncio (``add_done_callback``) and settling once for free;
- results handed back sealed (``Opened(value)``): the group opens and collects them, so the
  backend never knows what a DataProto is;
- registering it by name (``sc.register_backend``) and running the same calls on it as on a
  built-in backend (``--backend``), with the same results.

Calls to one rank start in the order they were made, on that rank's thread; ``async def`` methods
overlap there on the thread's event loop; different ranks run at once. Ranks share this process, as
on ``inline`` (one environment, no collectives between ranks), and so never die on their own.

It passes spmdcall's conformance suite:

    python -m spmdcall.testing examples.thread_backend:ThreadBackend    # from the repository root

Run it:

    python examples/thread_backend.py [--backend process|inline|ray]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import threading
import time
from typing import Any

import spmdcall as sc
from spmdcall import serialize
from spmdcall.backends.futures import RankFutureBase, wait_settled
from spmdcall.errors import WorkerDiedError, WorkerError, format_user_traceback
from spmdcall.rendezvous import PortReservation
from spmdcall.runtime.calls import CallRunner
from spmdcall.transport.envelope import Opened
from spmdcall.worker import active_context


class _Future(RankFutureBase):
    """A call queued on a rank's thread; that thread settles it."""

    def done(self) -> bool:
        return self.state != "pending"

    def result(self, timeout: float | None = None) -> Any:
        return wait_settled([self], timeout)[0]


class _Rank:
    """One rank: its object, and the thread whose event loop runs its calls. Plain methods run one
    at a time, in the order they were made; ``async def`` methods start in that order too and then
    overlap, as tasks (``CallRunner`` keeps each method within its ``max_concurrency``)."""

    def __init__(self, rank: int, instance: Any):
        self.rank = rank
        self.runner = CallRunner(instance)
        self.loop = asyncio.new_event_loop()
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.serve(),), daemon=True)
        self.thread.name = f"rank-{rank}"
        self.thread.start()

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.inbox.put_nowait, item)

    async def serve(self) -> None:
        tasks: set[asyncio.Task] = set()
        while (item := await self.inbox.get()) is not None:
            call, args, kwargs, future = item
            if self.runner.is_async(call.role, call.method):
                task = asyncio.create_task(self.run_async(call, args, kwargs, future))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(0)  # it starts before the next call does
            else:
                self.run(call, args, kwargs, future)
        for task in list(tasks):  # shut down: what still runs fails with WorkerDiedError
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while not self.inbox.empty():  # calls made after the stop was queued
            _, _, _, future = self.inbox.get_nowait()
            future.settle("error", WorkerDiedError(self.rank, future.method, "the group was shut down"))

    def run(self, call: sc.Call, args: tuple, kwargs: dict, future: _Future) -> None:
        started = time.time_ns()
        try:
            value = getattr(self.runner.target(call.role), call.method)(*args, **kwargs)
        except Exception as exc:
            error = WorkerError(self.rank, call.method, format_user_traceback(), type(exc).__name__)
            future.settle("error", error, started, time.time_ns())
            return
        self.settle(call, value, future, started)

    async def run_async(self, call: sc.Call, args: tuple, kwargs: dict, future: _Future) -> None:
        started = time.time_ns()
        try:
            value = await self.runner.run_async(call.role, call.method, args, kwargs)
        except asyncio.CancelledError:
            future.settle("error", WorkerDiedError(self.rank, call.method, "the group was shut down"))
            raise
        except Exception as exc:
            error = WorkerError(self.rank, call.method, format_user_traceback(2), type(exc).__name__)
            future.settle("error", error, started, time.time_ns())
            return
        self.settle(call, value, future, started)

    def settle(self, call: sc.Call, value: Any, future: _Future, started: int) -> None:
        try:
            value = serialize.copy(value)  # the caller's own, as if it had crossed a process boundary
        except Exception as exc:
            error = TypeError(f"the result of {call.method}() on rank {self.rank} cannot be pickled: {exc}")
            future.settle("error", error, started, time.time_ns())
            return
        future.settle("ok", value, started, time.time_ns())

    def stop(self) -> None:
        self.put(None)
        self.thread.join()
        self.loop.close()


class ThreadBackend:
    """Every rank an object of this process, served by a thread of its own."""

    name = "threads"
    # Ranks are threads of the controller; rank futures passed into a call are resolved by the group.
    capabilities = sc.Capabilities(ranks_in_own_processes=False)

    def __init__(self) -> None:
        self._ranks: list[_Rank] = []
        self._lock = threading.Lock()  # restart and shutdown replace ranks while others call

    def start(self, pool: sc.ResourcePool, cls_with_init: sc.ClassWithInitArgs, *, group_name: str) -> None:
        self._cls_with_init = cls_with_init
        # MASTER_PORT stays reserved until shutdown, so nothing else on the machine is given it
        # before rank 0's init_process_group binds it.
        self._port = PortReservation("127.0.0.1")
        self._contexts = pool.contexts("127.0.0.1", self._port.port)
        try:
            self._ranks = [self._build(ctx) for ctx in self._contexts]
        except BaseException:
            self.shutdown()
            raise

    def _build(self, ctx: sc.SPMDContext) -> _Rank:
        # The ranks share this process: build them one after another, each in its SPMD context.
        with active_context(ctx):
            try:
                instance = self._cls_with_init()
            except Exception as exc:
                raise WorkerError(ctx.rank, "__init__", format_user_traceback(), type(exc).__name__) from exc
        return _Rank(ctx.rank, instance)

    def submit(self, calls: list[sc.Call]) -> list[_Future]:
        try:  # copy (and so check) every argument before anything runs
            copies = [serialize.copy((c.args, c.kwargs)) for c in calls]
        except Exception as exc:
            values = {f"argument {i}": a for c in calls for i, a in enumerate(c.args)}
            culprit = serialize.describe_unpicklable(values) or str(exc)
            raise TypeError(f"cannot send {calls[0].method}() to the workers: {culprit}") from exc
        futures = []
        with self._lock:
            for c, (args, kwargs) in zip(calls, copies):
                future = _Future(c.rank, c.method)
                self._ranks[c.rank].put((c, args, kwargs, future))
                futures.append(future)
        return futures

    def wait(self, futures: list[_Future], timeout: float | None = None) -> list[Opened]:
        return [Opened(value) for value in wait_settled(futures, timeout)]

    def worker_info(self) -> list[dict[str, Any]]:
        return [{"rank": r.rank, "pid": os.getpid(), "host": socket.gethostname()} for r in self._ranks]

    def restart(self, ranks: list[int] | None) -> None:
        with self._lock:
            for rank in ranks or []:  # threads do not die: None restarts nothing
                self._ranks[rank].stop()
                self._ranks[rank] = self._build(self._contexts[rank])

    def shutdown(self) -> None:
        with self._lock:
            for r in self._ranks:
                r.stop()
            self._ranks = []
            self._port.close()


class Tally(sc.Worker):
    def __init__(self, start: int):
        self.total = start

    @sc.register(dispatch_mode=sc.Dispatch.ALL_TO_ALL)
    def add(self, k: int) -> int:
        time.sleep(0.05)  # the ranks sleep at the same time on their threads
        self.total += k
        return self.total

    def whoami(self) -> str:
        return f"rank {self.rank} of {self.world_size} in thread {threading.current_thread().name}"


def run(backend: str | sc.Backend) -> list:
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Tally, start=10), backend=backend) as wg:
        print(f"  {wg.whoami()}")
        return [wg.add([1, 2]), wg.add([3, 4])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="process", help="the built-in backend to compare with")
    args = parser.parse_args()

    sc.register_backend("threads", ThreadBackend, overwrite=True)
    print("threads:")
    ours = run("threads")
    print(f"{args.backend}:")
    theirs = run(args.backend)
    print(f"threads: {ours}; {args.backend}: {theirs}")
    assert ours == theirs == [[11, 12], [14, 16]], (ours, theirs)
    print("thread_backend: OK")


if __name__ == "__main__":
    main()
