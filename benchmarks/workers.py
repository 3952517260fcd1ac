"""The worker classes and raw baselines the benchmarks drive (importable by worker processes).

Not a benchmark itself: ``bench_*.py`` import it. Worker processes of the ``process`` backend get
the controller's ``sys.path``; Ray workers get this folder on ``PYTHONPATH`` from ``conftest.py``.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import spmdcall as sc

ROWS = 1024
MIB = 1 << 20


def make_batch(num_bytes: int, num_columns: int = 1, rows: int = ROWS, seed: int = 0):
    """A DataProto of ``rows`` rows and ``num_columns`` float32 columns, ``num_bytes`` in all."""
    import torch

    from spmdcall.data import DataProto

    cols = num_bytes // (rows * 4 * num_columns)
    assert cols * rows * 4 * num_columns == num_bytes, (num_bytes, rows, num_columns)
    gen = torch.Generator().manual_seed(seed)
    return DataProto.from_dict({f"c{i}": torch.randn(rows, cols, generator=gen) for i in range(num_columns)})


class Noop:
    """A method that does nothing: what is left is the cost of driving the group."""

    def noop(self) -> None:  # unregistered public method: ONE_TO_ALL, Execute.ALL
        return None


class Echo:
    """Returns its chunk of the batch: 1x the payload goes out, 1x comes back."""

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def echo(self, batch):
        return batch


class Producer:
    """Stands for a rollout: a small prompt batch in, a large batch out (cached, so that the
    benchmark measures moving the data, not making it)."""

    def __init__(self, out_bytes_per_row: int, num_columns: int = 2):
        import torch

        cols = out_bytes_per_row // (4 * num_columns)
        gen = torch.Generator().manual_seed(1)
        self.columns = {f"c{i}": torch.randn(ROWS, cols, generator=gen) for i in range(num_columns)}

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, prompts):
        from spmdcall.data import DataProto

        n = len(prompts)
        return DataProto.from_dict({k: v[:n] for k, v in self.columns.items()})


class Consumer:
    """Stands for a reward model: a large batch in, one small column out."""

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def consume(self, batch):
        from spmdcall.data import DataProto

        return DataProto.from_dict({"score": batch.batch["c0"][:, 0].clone()})


class WeightsOwner:
    """Stands for an actor whose rank 0 hands a dict of tensors (its weights) to another group."""

    def __init__(self, total_bytes: int, num_tensors: int = 16):
        import torch

        gen = torch.Generator().manual_seed(1)
        self.weights = {
            f"w{i}": torch.randn(total_bytes // 4 // num_tensors, generator=gen) for i in range(num_tensors)
        }

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, execute_mode=sc.Execute.RANK_ZERO, blocking=False)
    def export(self):
        return self.weights


class WeightsReader:
    """Takes such a dict on every rank and reads one number of each tensor."""

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def load(self, weights):
        return sum(float(v[0]) for v in weights.values())


# -- raw baselines -------------------------------------------------------------------------------


class RawRayActor:
    """A plain Ray actor (wrapped with ``ray.remote`` by the benchmarks, so Ray is only imported there)."""

    def noop(self) -> None:
        return None

    def echo(self, value: Any) -> Any:
        return value


class RawAsyncRayActor:
    """A Ray actor with an ``async def`` method, which Ray makes an async actor: the kind of actor a
    group gets for a worker class with an ``async def`` method (``Pinger``)."""

    async def echo(self, value: Any) -> Any:
        return value


def pipe_server(conn) -> None:
    """A process that sends back every message on its end of a ``multiprocessing.Pipe`` until None."""
    while True:
        message = conn.recv()
        if message is None:
            return
        conn.send(message)


class PipeWorkers:
    """``num_workers`` spawned processes, each answering over its own ``multiprocessing.Pipe``."""

    def __init__(self, num_workers: int):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(num_workers):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=pipe_server, args=(theirs,), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    def call(self, messages: list | None = None) -> list:
        """One fan-out: a message to every process (a small one by default), then every answer."""
        for conn, message in zip(self.conns, messages or [("noop", (), {})] * len(self.conns)):
            conn.send(message)
        return [conn.recv() for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


class Pinger:
    """Small calls: a tiny argument out and back (``ping``), or an async method that sleeps (``nap``)."""

    def ping(self, x: int) -> int:  # unregistered public method: ONE_TO_ALL, Execute.ALL
        return x

    async def nap(self, seconds: float) -> float:
        import asyncio

        await asyncio.sleep(seconds)
        return seconds


class HandOff:
    """The least a blocking call from a thread can cost in this interpreter: ``call(i)`` queues a
    lock for a server thread, which releases it at once. No sockets, pickling or other processes:
    what is left is the caller's thread parking and being woken, and the GIL passing between
    threads."""

    def __init__(self) -> None:
        import collections
        import threading

        self._queue: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self._server = threading.Thread(target=self._serve, daemon=True)
        self._server.start()

    def _serve(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                locks = list(self._queue)
                self._queue.clear()
            for lock in locks:
                lock.release()

    def call(self, i: int) -> int:
        import threading

        lock = threading.Lock()
        lock.acquire()
        with self._ready:
            self._queue.append(lock)
            self._ready.notify()
        lock.acquire()  # until the server releases it
        return i

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._server.join()


class ThreadDriver:
    """``num_threads`` threads kept for the whole benchmark; ``run(fn, count)`` has them call
    ``fn(i)`` ``count`` times in all, each thread one call after another (so ``num_threads`` calls
    are in flight at once), and returns when all are done."""

    def __init__(self, num_threads: int):
        import threading

        self.num_threads = num_threads
        self._start = threading.Barrier(num_threads + 1)
        self._end = threading.Barrier(num_threads + 1)
        self._job: tuple | None = None
        self._errors: list = []
        self._threads = [
            threading.Thread(target=self._work, args=(t,), daemon=True) for t in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self, t: int) -> None:
        while True:
            self._start.wait()
            if self._job is None:
                return
            fn, count = self._job
            try:
                for i in range(t, count, self.num_threads):
                    fn(i)
            except BaseException as exc:  # raised in run()
                self._errors.append(exc)
            self._end.wait()

    def run(self, fn: Any, count: int) -> None:
        self._job = (fn, count)
        self._start.wait()
        self._end.wait()
        if self._errors:
            raise self._errors.pop()

    def close(self) -> None:
        self._job = None
        self._start.wait()
        for thread in self._threads:
            thread.join()


def join_parts(parts: list[dict]) -> dict:
    """One tensor per column from the per-rank parts, joined by one single-threaded memcpy each
    (``np.concatenate``, as spmdcall's collect does: torch.cat's thread pool stalls on a busy machine)."""
    import numpy as np
    import torch

    return {k: torch.from_numpy(np.concatenate([np.asarray(p[k]) for p in parts])) for k in parts[0]}
