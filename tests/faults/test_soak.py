"""Soak: thousands of mixed calls; memory, shared memory and processes must not leak."""

from __future__ import annotations

import os

import psutil
import pytest
import torch
from procs import live_ranks

import spmdcall as sc
from spmdcall import DataProto

NUM_CALLS = 3000
BIG_EVERY = 25  # every 25th call moves an 8 MiB DataProto (120 of them)
USS_GROWTH_BOUND_MIB = 64


class Soak(sc.Worker):
    def __init__(self):
        self.n = 0

    def tick(self, k):
        self.n += k
        return self.n

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def echo(self, batch):
        batch.batch["x"] += 1
        return batch

    def pid(self):
        return os.getpid()


def _memfd_count(pid: int) -> int:
    """Shared-memory files a process still holds open or mapped."""
    with open(f"/proc/{pid}/maps") as f:
        mapped = sum("memfd:spmdcall" in line for line in f)
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds += "memfd:spmdcall" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return mapped + fds


def _uss_mib(pids: list[int]) -> float:
    # Unique memory (USS): shared-memory pages, like Ray's object store, are not the processes' own.
    return sum(psutil.Process(p).memory_full_info().uss for p in pids) / 2**20


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_mixed_calls_do_not_leak(process_backend):
    shm_before = set(os.listdir("/dev/shm"))
    big = DataProto.from_dict({"x": torch.zeros(1024, 2048)})  # 8 MiB
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Soak), backend=process_backend) as wg:
        pids = [os.getpid(), *wg.pid()]
        for _ in range(20):  # let the allocators reach their plateau before measuring
            out = wg.echo(big)  # held while the next is made, as below
        wg.tick(-wg.tick(0)[0])
        uss_start = _uss_mib(pids)
        memfds_start = [_memfd_count(p) for p in pids]
        for i in range(1, NUM_CALLS + 1):
            if i % BIG_EVERY == 0:
                out = wg.echo(big)
                assert len(out) == 1024 and float(out.batch["x"][0, 0]) == 1.0
            else:
                assert wg.tick(1) == [i - i // BIG_EVERY] * 2
        del out
        uss_end = _uss_mib(pids)
        growth = uss_end - uss_start
        print(
            f"\n{process_backend}: USS controller+workers {uss_start:.0f} -> {uss_end:.0f} MiB over {NUM_CALLS} calls"
        )
        assert growth < USS_GROWTH_BOUND_MIB, f"memory grew by {growth:.0f} MiB over {NUM_CALLS} calls"
        if process_backend == "process":
            # segments are pooled for reuse: a bounded, steady number, not one per call
            assert [_memfd_count(p) for p in pids] == memfds_start
    assert set(os.listdir("/dev/shm")) - shm_before == set()
    assert live_ranks() == []
