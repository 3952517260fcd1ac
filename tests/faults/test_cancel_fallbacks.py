"""What ``on_timeout`` falls back to: an interrupt that a rank blocked in C cannot take in time
restarts it after the grace; a backend that does not declare ``Capabilities.cancel`` restarts the
ranks for ``"interrupt"`` and leaves async calls running.

What every backend must do with a deadline's policy is the shipped suite's
spmdcall/testing/test_cancel.py; these need ranks in processes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

import pytest

import spmdcall as sc
from spmdcall.backends.process.backend import ProcessBackend
from spmdcall.group import supervision

pytestmark = pytest.mark.timeout(60)


class Blocked(sc.Worker):
    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, timeout=0.5, on_timeout="interrupt")
    def doze(self, seconds):
        time.sleep(seconds)  # blocked in C: the interrupt waits for the sleep to end
        return self.rank

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, timeout=0.5)
    async def nap(self, seconds):
        await asyncio.sleep(seconds)
        return self.rank

    def pid(self):
        return os.getpid()


class NoCancelBackend(ProcessBackend):
    """The process backend, declaring no ``cancel``: what a third-party backend without it gets."""

    capabilities = dataclasses.replace(ProcessBackend.capabilities, cancel=False)


def test_interrupt_restarts_a_rank_blocked_in_c_after_the_grace(monkeypatch, caplog):
    monkeypatch.setattr(supervision, "INTERRUPT_GRACE_S", 1.0)
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Blocked), shutdown_grace=0.1) as wg:
        pids = wg.pid()
        with caplog.at_level(logging.WARNING, logger="spmdcall"), pytest.raises(sc.CallTimeoutError) as info:
            wg.doze(3600)
        assert "interrupted" in info.value.stopped  # sent; the sleep has not taken it
        end = time.monotonic() + 20
        while time.monotonic() < end and "restarting them" not in caplog.text:
            time.sleep(0.05)
        assert "still runs on ranks [0, 1]" in caplog.text
        new = None
        while time.monotonic() < end:
            try:
                new = wg.pid()
                break
            except sc.WorkerDiedError:  # the restart is under way
                time.sleep(0.1)
        assert new is not None and all(a != b for a, b in zip(new, pids))


def test_a_backend_without_cancel_restarts_for_interrupt_and_leaves_async_calls():
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Blocked), backend=NoCancelBackend(shutdown_grace=0.1)
    ) as wg:
        pids = wg.pid()
        with pytest.raises(sc.CallTimeoutError) as info:
            wg.doze(3600)
        assert "cannot interrupt" in info.value.stopped and "restarted" in info.value.stopped
        assert all(a != b for a, b in zip(wg.pid(), pids))
        with pytest.raises(sc.CallTimeoutError) as info:
            wg.nap(1.0)
        assert info.value.stopped == ""
        assert all([m for m, _ in r.calls] == ["nap"] for r in wg.status().values())  # left running
