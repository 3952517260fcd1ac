"""The worker classes the conformance suite drives. A module of its own, importable by name, so a
backend whose workers live elsewhere (processes, actors) imports them there as it would any class.

torch and DataProto are imported inside the methods that use them: the suite runs without torch,
and skips only the tests that move DataProtos.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from typing import Any

import spmdcall as sc

SPMD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Counter(sc.Worker):
    """A counter per rank, with a method in every built-in dispatch mode."""

    def __init__(self, start: int = 0):
        self.n = start

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def add(self, k):
        """Add k on every rank."""
        self.n += k
        return self.n

    @sc.register(dispatch_mode=sc.Dispatch.ALL_TO_ALL)
    def set_each(self, values):
        self.n = values
        return self.n

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE)
    def scaled(self, factor):
        return self.n * factor

    @sc.register(dispatch_mode=sc.Dispatch.RANK_ZERO)
    def only_zero(self, k):
        return (self.rank, self.n + k)

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, execute_mode=sc.Execute.RANK_ZERO)
    def zero_executes(self):
        return self.rank

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def double(self, batch):
        batch.batch["x"] = batch.batch["x"] * 2
        batch.non_tensor_batch["seen_by"] = [self.rank] * len(batch)
        return batch

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def plus_one(self, batch):
        from spmdcall import DataProto

        return DataProto.from_dict({"x": batch.batch["x"] + 1})

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def sample(self, batch):
        """n outputs per input row, interleaved (like n rollouts per prompt)."""
        import torch

        n = batch.meta_info["n"]
        out = batch.repeat(n, interleave=True)
        out.batch["sample"] = torch.arange(n).repeat(len(batch))
        return out

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, batch):
        from spmdcall import DataProto

        return DataProto.from_dict({"x": fn(batch.batch["x"])})

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_METRIC)
    def metrics(self, batch):
        return {"rank": self.rank, "rows": len(batch), "sum": float(batch.batch["x"].sum())}

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, blocking=False)
    def slow_add(self, k, delay=0.2):
        time.sleep(delay)
        self.n += k
        return self.n

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_async(self, batch):
        return self.double(batch)

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def mutate(self, batch):
        batch.batch["x"].add_(100)
        return float(batch.batch["x"].sum())

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def append_to(self, items):
        items.append(self.rank)
        return items

    def identity(self):
        """Where the rank sits, as its SPMD context and its process's environment say."""
        return {
            "context": dataclasses.asdict(self.spmd_context),
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "env": {k: os.environ.get(k) for k in SPMD_VARIABLES},
            "pid": os.getpid(),
        }

    def fail_on(self, rank):
        if self.rank == rank:
            raise ValueError(f"rank {self.rank} refuses")
        return self.rank

    def get(self):
        return self.n

    def _private(self):
        return "hidden"


class Plain:
    """An ordinary class nobody decorated."""

    def __init__(self, tag):
        self.tag = tag

    def hello(self, name):
        return f"{self.tag}: hello {name}"


class Weights(sc.Worker):
    """A role holding state of its rank that a colocated sibling reads in process."""

    def __init__(self):
        self.value = 100 + self.rank

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def bump(self, k):
        self.value += k
        return self.value

    def _peek(self):  # for siblings, not the controller: private, so no group method
        return self.rank, self.value


class Reader(sc.Worker):
    """A role that reaches the ``weights`` role of its own rank."""

    def __init__(self, at_init=False):
        self.seen_at_init = self.sibling("weights")._peek() if at_init else None

    def read(self):
        return (self.rank, *self.sibling("weights")._peek())

    def first_read(self):
        return self.seen_at_init

    def lookup_error(self, role):
        try:
            self.sibling(role)
        except (RuntimeError, ValueError) as exc:
            return type(exc).__name__, str(exc)


class Recorder(sc.Worker):
    """Plain methods that log the calls they run and take their time, for order and deadlines."""

    def __init__(self, value: int = 0):
        self.value = value
        self.log: list = []
        self.running = 0
        self.most_running = 0

    def add(self, t, i):
        self.log.append((t, i))
        return (t, i, self.rank)

    def add_with(self, t, i, payload):
        """``add``, carrying ``payload`` (a large array crosses as a buffer of its own on process)."""
        return self.add(t, i)

    @sc.register(dispatch_mode=sc.Dispatch.ALL_TO_ALL)
    def each(self, value):
        return value * 10 + self.rank

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, timeout=1.0)
    def hang(self, seconds):
        time.sleep(seconds)
        return seconds

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    def reset(self):
        self.log, self.running, self.most_running = [], 0, 0

    def order(self):
        return self.log

    def peak(self):
        return self.most_running

    def pid(self):
        return os.getpid()

    def get(self):
        return self.value

    def unpicklable(self):
        return threading.Lock()


class Sleeper(Recorder):
    """Recorder with ``async def`` methods: its ranks serve every call on an event loop."""

    async def nap(self, seconds, tag=None):
        self.log.append(("nap", tag))
        await self._counted_sleep(seconds)
        return (tag, self.rank)

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, max_concurrency=1)
    async def nap_in_turn(self, seconds):
        await self._counted_sleep(seconds)
        return self.rank

    async def _counted_sleep(self, seconds):
        """Sleep, counting how many calls sleep at once (``most_running``)."""
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.running -= 1

    async def broken(self, what):
        await asyncio.sleep(0)
        raise ValueError(f"cannot {what}")


class MeshWorker(sc.Worker):
    """Declares its place in mesh ``m``: dp rank ``rank // tp``, rank ``dp * tp`` collects."""

    def __init__(self, tp: int):
        self.register_mesh(
            "m", dp_rank=self.rank // tp, dp_size=self.world_size // tp, is_collect=self.rank % tp == 0
        )
        self.last_ids: list = []

    @sc.register(dispatch_mode=sc.nd_dispatch("m"))
    def tag(self, batch):
        import torch

        from spmdcall import DataProto

        self.last_ids = batch.batch["x"].tolist()
        return DataProto.from_dict({"x": batch.batch["x"], "by": torch.full((len(batch),), self.rank)})

    def received(self):
        return self.last_ids


class Rollout(sc.Worker):
    """A role with a mesh of its own (every rank its own dp rank), beside a MeshWorker."""

    def __init__(self):
        self.register_mesh("rollout", dp_rank=self.rank, dp_size=self.world_size, is_collect=True)

    @sc.register(dispatch_mode=sc.nd_dispatch("rollout"))
    def generate(self, batch):
        import torch

        from spmdcall import DataProto

        return DataProto.from_dict({"x": batch.batch["x"], "by": torch.full((len(batch),), self.rank)})


class Stuck(Recorder):
    """Methods that block in C, for the reports of where a rank is: asleep, or waiting on a lock
    the rank holds itself (each line a report must show is marked)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def doze(self, seconds):
        time.sleep(seconds)  # doze: the line its report shows
        return self.rank

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, timeout=0.5)
    def doze_past_deadline(self, seconds):
        time.sleep(seconds)  # doze_past_deadline: the line its report shows
        return self.rank

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, warn_after=0.3)
    def doze_slowly(self, seconds):
        time.sleep(seconds)  # doze_slowly: the line its report shows
        return self.rank

    def deadlock(self, seconds):
        """Wait ``seconds`` for a lock this rank holds already (a deadlock, bounded)."""
        with self.lock:
            self.lock.acquire(timeout=seconds)  # deadlock: the line its report shows
        return self.rank


class Late(Recorder):
    """Calls that run past their deadline of 0.5 s, one per ``on_timeout`` policy, for what the
    policy does to them. Its ``async def`` method puts every rank on an event loop: plain calls
    then run on the loop's thread, on inline too (so a deadline applies there as well)."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = 0
        self.born = time.monotonic()

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, timeout=0.5)
    async def nap(self, seconds):
        await asyncio.sleep(seconds)  # nap: the line its report shows
        return self.rank

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, timeout=0.5, on_timeout="interrupt")
    def spin(self, seconds):
        """A busy loop of Python bytecode: what an interrupt stops."""
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pass
        except sc.CallInterrupted:
            self.interrupted += 1
            raise
        return self.rank

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, timeout=0.5)
    def spin_on(self, seconds):
        """``spin`` under the group's policy (``"leave"`` unless the group says)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return self.rank

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, timeout=0.5, on_timeout="restart")
    def stuck(self, seconds):
        time.sleep(seconds)  # stuck: blocked in C, as a rank in a lost collective is
        return self.rank

    def interruptions(self):
        return self.interrupted

    def birth(self):
        return self.born


class AllReduce(sc.Worker):
    """One all-reduce over the group, in a process group built from the SPMD environment."""

    def pid(self):
        return os.getpid()

    def all_reduce(self):
        import torch
        import torch.distributed as dist

        sc.init_distributed()  # reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        return float(value)


def rows(n: int) -> Any:
    """A DataProto of ``n`` rows: ``x`` = 0..n-1 and a non-tensor ``id`` column."""
    import torch

    from spmdcall import DataProto

    return DataProto.from_dict(
        {"x": torch.arange(float(n))}, non_tensors={"id": [f"row{i}" for i in range(n)]}
    )


class Elastic(Counter):
    """A counter that records what each resize told it."""

    def __init__(self, start: int = 0):
        super().__init__(start)
        self.resizes: list[tuple[int, int]] = []

    def on_resize(self, rank, world_size):
        self.resizes.append((rank, world_size))

    def told(self):
        return self.resizes


class Distributed(sc.Worker):
    """A rank that joins a gloo process group; ``Rebuilding`` knows how to rebuild it on a resize."""

    def join(self):
        sc.init_distributed("gloo", timeout_s=30)
        return self.all_sum()

    def all_sum(self):
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return (dist.get_rank(), dist.get_world_size(), int(t.item()))


class Rebuilding(Distributed):
    def on_resize(self, rank, world_size):
        import torch.distributed as dist

        dist.destroy_process_group()
        sc.init_distributed("gloo", timeout_s=30)
