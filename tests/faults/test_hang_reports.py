"""Where a rank hangs in a collective: a gloo all-reduce that one rank never joins. The rank
waiting in it is blocked in C, inside torch; its report still shows the line of the collective
(a side thread answers), and the group's slow-call warning names it first.

What every backend must report (a sleep, a lock, status(), a rank that cannot answer) is the
shipped suite's spmdcall/testing/test_reports.py; this needs torch and ranks in processes."""

from __future__ import annotations

import logging
import time

import pytest

import spmdcall as sc

pytestmark = pytest.mark.timeout(120)


class Lonely(sc.Worker):
    """Rank 0 all-reduces alone: rank 1 never joins."""

    def setup(self):
        sc.init_distributed("gloo", timeout_s=3.0)  # the lone all-reduce fails after 3 s, freeing rank 0

    def all_reduce_alone(self):
        import torch
        import torch.distributed as dist

        value = torch.ones(1)
        if self.rank == 0:
            try:
                dist.all_reduce(value)  # all_reduce_alone: the line its report shows
            except RuntimeError:  # gloo's timeout: the peer never came
                return "timed out"
        return "skipped"


def test_a_rank_waiting_in_a_collective_shows_the_collective(process_backend, caplog):
    with sc.WorkerGroup(
        sc.ResourcePool([2]),
        sc.ClassWithInitArgs(Lonely),
        backend=process_backend,
        warn_after=0.4,
        shutdown_grace=5.0,
    ) as wg:
        wg.setup()
        future = wg.all_reduce_alone.submit()
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="spmdcall"):
            with pytest.raises(sc.CallTimeoutError) as info:
                future.get(timeout=1.0)
        assert time.monotonic() - start < 1.0 + 2.0
        err = info.value
        assert err.pending_ranks == [0] and list(err.reports) == [0]
        report = err.reports[0]
        assert report.calls[0][0] == "all_reduce_alone" and report.calls[0][1] >= 0.95
        waiting = [s for s in report.threads.values() if "dist.all_reduce(value)" in s]
        assert waiting and "test_hang_reports.py" in waiting[0]
        # The slow-call warning came first, once, with the same place.
        warned = [r.getMessage() for r in caplog.records if "all_reduce_alone() has run" in r.getMessage()]
        assert len(warned) == 1 and "dist.all_reduce(value)" in warned[0]
        assert future.get(timeout=30) == ["timed out", "skipped"]  # gloo's own timeout frees rank 0


class Late(sc.Worker):
    """Both ranks all-reduce; rank 1 comes late (it sleeps first)."""

    def setup(self):
        sc.init_distributed("gloo", timeout_s=60.0)

    def step(self, late_s):
        import torch
        import torch.distributed as dist

        if self.rank == 1:
            time.sleep(late_s)  # step: rank 1 is still here
        value = torch.full((1,), float(self.rank + 1))
        dist.all_reduce(value)  # step: rank 0 waits here
        return value.item()


def test_the_rank_missing_from_a_collective_is_named_and_restart_brings_the_group_back(process_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Late), backend=process_backend) as wg:
        wg.setup()
        assert wg.step(0.0) == [3.0, 3.0]
        with pytest.raises(sc.CallTimeoutError) as info:
            wg.step.submit(3600.0).get(timeout=1.0)
        message = str(info.value)
        assert "rank 0: step() at" in message and "dist.all_reduce(value)" in message
        assert "rank 1: step() at" in message and "time.sleep(late_s)" in message
        assert "ranks [0] wait in a torch.distributed collective; ranks [1] are not in it" in message
        # Rank 0's process group waits on rank 1 for good: restart both, form it again, go on.
        start = time.monotonic()
        wg.restart([0, 1])
        wg.setup()
        assert wg.step(0.0) == [3.0, 3.0]
        assert time.monotonic() - start < 30
