"""Worker classes for the concurrency tests (a module of their own, so every backend imports them).
What every backend must do with threads and event loops is the shipped suite's
(spmdcall/testing/test_concurrency.py); these serve the tests that go beyond it."""

from __future__ import annotations

import asyncio
import os
import time

import spmdcall as sc


class Busy(sc.Worker):
    """Plain methods: calls to log, to sleep in, and to wait for each other through a file."""

    def add(self, t, i):
        return (t, i, self.rank)

    def add_with(self, t, i, payload):
        """``add``, carrying ``payload`` (an array of 1 MiB crosses in shared memory on process)."""
        return self.add(t, i)

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

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


class AsyncBusy(Busy):
    """Busy with an async method: its ranks serve every call on an event loop."""

    async def nap(self, seconds):
        await asyncio.sleep(seconds)
        return self.rank
