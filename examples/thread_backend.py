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

Calls to one rank run one at a time, in order, on that rank's thread; different ranks run at
once. Ranks share this process, as on ``inline`` (one environment, no collectives between ranks).

Run it:

    python examples/thread_backend.py [--backend process|inline|ray]
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import threading
import time
from typing import Any

import spmdcall as sc
from spmdcall import serialize
from spmdcall.backends.futures import RankFutureBase, wait_settled
from spmdcall.errors import WorkerError, format_user_traceback
from spmdcall.rendezvous import PortReservation
from spmdcall.transport.envelope import Opened
from spmdcall.worker import active_context


class _Future(RankFutureBase):
    """A call queued on a rank's thread; that thread settles it."""

    def done(self) -> bool:
        return self._state != "pending"

    def result(self, timeout: float | None = None) -> Any:
        return wait_settled([self], timeout)[0]


class _Rank:
    """One rank: its object, the queue of its calls, and the thread that runs them."""

    def __init__(self, rank: int, instance: Any):
        self.rank, self.instance = rank, instance
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self.serve, name=f"rank-{rank}", daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while (item := self.inbox.get()) is not None:
            call, args, kwargs, future = item
            target = self.instance if call.role is None else self.instance.role(call.role)
            started = time.time_ns()
            try:
                value = serialize.copy(getattr(target, call.method)(*args, **kwargs))  # the caller's own
                future._settle("ok", value, started, time.time_ns())
            except Exception as exc:
                error = WorkerError(self.rank, call.method, format_user_traceback(), type(exc).__name__)
                future._settle("error", error, started, time.time_ns())

    def stop(self) -> None:
        self.inbox.put(None)
        self.thread.join()


class ThreadBackend:
    """Every rank an object of this process, served by a thread of its own."""

    name = "threads"
    capabilities = sc.Capabilities()  # the defaults: the group resolves rank futures passed into a call

    def __init__(self) -> None:
        self._ranks: list[_Rank] = []
        self._lock = threading.Lock()  # restart and shutdown replace ranks while others call

    def start(self, pool: sc.ResourcePool, cls_with_init: sc.ClassWithInitArgs, *, group_name: str) -> None:
        self._cls_with_init = cls_with_init
        # MASTER_PORT stays reserved until shutdown, so nothing else on the machine is given it
        # before rank 0's init_process_group binds it.
        self._port = PortReservation("127.0.0.1")
        self._contexts = pool.contexts("127.0.0.1", self._port.port)
        self._ranks = [self._build(ctx) for ctx in self._contexts]

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
            raise TypeError(f"cannot send {calls[0].method}() to the workers: {exc}") from exc
        futures = []
        with self._lock:
            for c, (args, kwargs) in zip(calls, copies):
                future = _Future(c.rank, c.method)
                self._ranks[c.rank].inbox.put((c, args, kwargs, future))
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
