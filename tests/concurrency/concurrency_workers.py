"""Worker classes for the concurrency tests (a module of their own, so every backend imports them)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import spmdcall as sc

# torch and DataProto are imported where they are used: a worker of a test without them starts in
# a fraction of the time.


class Busy(sc.Worker):
    """Plain methods in every dispatch mode the tests mix."""

    def __init__(self):
        self.log: list = []
        self.running = 0
        self.most_running = 0

    def add(self, t, i):
        self.log.append((t, i))
        return (t, i, self.rank)

    def add_with(self, t, i, payload):
        """``add``, carrying ``payload`` (an array of 1 MiB crosses in shared memory on process)."""
        return self.add(t, i)

    @sc.register(dispatch_mode=sc.Dispatch.ALL_TO_ALL)
    def each(self, value):
        return value * 10 + self.rank

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def scale(self, batch):
        import torch

        from spmdcall import DataProto

        x = batch.batch["x"]
        return DataProto.from_dict({"x": x * 2, "rank": torch.full((len(x),), self.rank)})

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def plus_one(self, batch):
        from spmdcall import DataProto

        return DataProto.from_dict({"x": batch.batch["x"] + 1})

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, timeout=1.0)
    def slow(self, seconds):
        time.sleep(seconds)
        return seconds

    def reset(self):
        self.log, self.running, self.most_running = [], 0, 0

    def order(self):
        return self.log

    def peak(self):
        return self.most_running

    def pid(self):
        return os.getpid()

    def mark(self, path):
        with open(path, "w"):
            pass

    def wait_for_mark(self, path, seconds):
        """Whether the file ``path`` appeared within ``seconds``."""
        deadline = time.monotonic() + seconds
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        return os.path.exists(path)

    def threads(self):
        return threading.active_count()


class AsyncBusy(Busy):
    """Busy with async methods: its ranks serve calls on an event loop."""

    async def nap(self, seconds, tag=None):
        self.log.append(("nap", tag))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.running -= 1
        return (tag, self.rank)

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, max_concurrency=1)
    async def nap_in_turn(self, seconds):
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.running -= 1
        return self.rank

    async def broken(self, what):
        await asyncio.sleep(0)
        raise ValueError(f"cannot {what}")


def rows(value: float, num_rows: int = 64, width: int = 4096) -> Any:
    """A DataProto of ``num_rows`` rows of ``width`` float32 values (1 MiB by default)."""
    import torch

    from spmdcall import DataProto

    return DataProto.from_dict({"x": torch.full((num_rows, width), float(value))})
