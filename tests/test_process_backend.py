"""The process backend: shared-memory transport, process death, controller death, torch.distributed."""

from __future__ import annotations

import os
import time

import pytest
import torch
from procs import run_controller, wait_gone

import spmdcall as sc
from spmdcall import DataProto
from spmdcall.transport.frames import encode

pytestmark = pytest.mark.timeout(120)


def _mapping_of(tensor) -> str:
    """The name of this process's mapping that holds the tensor's first byte."""
    addr = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return rest[4].strip() if len(rest) >= 5 else "anonymous"
    return "unknown"


class Probe(sc.Worker):
    def __init__(self, value=0):
        self.value = value

    def pid(self):
        return os.getpid()

    def context(self):
        return self.spmd_context

    def where_is(self, tensor):
        """Which mapping of this process holds the tensor's bytes."""
        return _mapping_of(tensor)

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    def get(self):
        return self.value

    def set(self, value):
        self.value = value

    def allreduce(self):
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()

    def make(self, n):
        return torch.full((n,), float(self.rank))

    def unpicklable(self):
        import threading

        return threading.Lock()


@pytest.mark.parametrize("spin_us", [0.0, 300.0])
def test_idle_workers_sleep_after_the_spin_window(spin_us):
    """Each side polls for spin_us after a message instead of sleeping at once; after that window an
    idle worker sleeps in recv and uses no CPU."""
    import psutil

    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Probe, value=3), spin_us=spin_us) as wg:
        for _ in range(200):
            assert wg.get() == [3, 3]
        workers = [psutil.Process(pid) for pid in wg.pid()]
        time.sleep(0.05)
        busy = [sum(w.cpu_times()[:2]) for w in workers]
        time.sleep(1.0)
        used = [sum(w.cpu_times()[:2]) - b for w, b in zip(workers, busy)]
    assert max(used) < 0.1, f"idle workers used {used} s of CPU in 1 s"


def test_a_group_dropped_without_shutdown_is_collected_and_its_workers_end():
    """Nothing the controller keeps for writing to a worker (its channel's ``when_full``) may hold
    the group: once dropped, the group is collected and its finalizer ends the workers."""
    import gc

    wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Probe), backend="process")
    futures = [wg.pid.submit() for _ in range(50)]  # calls made, and a reader thread started
    pids = futures[-1].get(timeout=60)
    del wg, futures
    gc.collect()
    assert wait_gone(pids, 10.0) == []


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_bad_spin_us_is_refused(bad):
    with pytest.raises(ValueError, match=r"spin_us must be a number of microseconds >= 0, got"):
        sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Probe), spin_us=bad)


def test_large_tensors_travel_in_shared_memory_not_the_socket():
    big = torch.randn(1 << 20)
    frame = encode((None, "f", (big,), {}))
    assert frame.segment is not None and frame.segment.size >= big.nbytes
    assert len(frame.body) < 2000  # 4 MiB of data, a tiny frame on the socket
    frame.discard()
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Probe)) as wg:
        assert all("memfd:spmdcall" in where for where in wg.where_is(big))
        out = wg.make(1 << 20)
        assert [t[0].item() for t in out] == [0.0, 1.0] and all(t.shape == (1 << 20,) for t in out)


def test_small_payloads_stay_inline():
    frame = encode((None, "f", (torch.ones(4),), {}))
    assert frame.segment is None


def test_replies_collected_from_several_threads_each_reach_their_own_call():
    """Threads waiting on calls of the same workers, and one polling done(), share the sockets:
    every reply is read once, by whichever thread comes first, and none is waited for twice."""
    import threading

    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Probe)) as wg:
        futures = [wg.execute_all_async("sleep", 0.001 * (i % 3)) for i in range(60)]
        results: dict[int, list] = {}
        stop = threading.Event()

        def poll():
            while not stop.is_set():
                for f in futures:
                    f.done()

        def collect(indices):
            for i in indices:
                results[i] = futures[i].get(timeout=30)

        poller = threading.Thread(target=poll)
        collectors = [threading.Thread(target=collect, args=(range(k, 60, 3),)) for k in range(3)]
        poller.start()
        for t in collectors:
            t.start()
        for t in collectors:
            t.join(timeout=60)
        stop.set()
        poller.join(timeout=10)
        assert results == {i: [0, 1] for i in range(60)}
        assert wg.execute_all("get") == [0, 0]  # nothing left unread to confuse the next call


@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_distributed_all_reduce(world_size):
    with sc.WorkerGroup(sc.ResourcePool([world_size]), sc.ClassWithInitArgs(Probe)) as wg:
        expected = world_size * (world_size + 1) / 2
        assert wg.allreduce() == [expected] * world_size


def test_simulated_nodes_get_local_ranks():
    with sc.WorkerGroup(sc.ResourcePool([2, 1]), sc.ClassWithInitArgs(Probe)) as wg:
        envs = wg.context()
        assert [(c.rank, c.node_rank, c.local_rank, c.local_world_size) for c in envs] == [
            (0, 0, 0, 2),
            (1, 0, 1, 2),
            (2, 1, 0, 1),
        ]


def test_script_classes_defined_in_main_work_without_a_main_guard():
    proc = run_controller("""
        import spmdcall as sc
        class Local(sc.Worker):
            def twice(self, x): return 2 * x
            @sc.register(dispatch_mode=sc.Dispatch.RANK_ZERO)
            def who(self): return self.rank
            def myself(self): return self
        for backend in ["process", "inline", "process"]:
            wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Local), backend=backend)
            wg.myself()  # instances of a __main__ class coming back must not reset the class
            print(wg.twice(21), wg.who(), wg.method_names(), flush=True)
            wg.shutdown()
    """)
    for _ in range(3):
        assert proc.stdout.readline().strip() == "[42, 42] 0 ['myself', 'twice', 'who']"
    assert proc.wait(timeout=60) == 0


def test_arguments_keep_their_exact_types_plain_or_defined_in_the_script():
    # Plain values take the C pickler; anything else in them (a script's function, an enum, a
    # str subclass, a dict with int keys) must still go by value through cloudpickle.
    proc = run_controller("""
        import enum
        import spmdcall as sc
        class Colour(enum.IntEnum):
            RED = 1
        class Name(str):
            pass
        class Echo:
            def echo(self, x): return x
            def apply(self, x): return [f(v) for f, v in x]
        wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Echo))
        plain = (None, True, 1, 2.5, 1j, "s", b"b", [1, (2, 3)], {"k": [None]}, ())
        out = wg.echo(plain)[1]
        print(out == plain and [type(v) for v in out] == [type(v) for v in plain], flush=True)
        odd = [Colour.RED, Name("n"), {1: "int key"}, [[[[4]]]], list(range(40))]
        out = wg.echo(odd)[1]
        print(out == odd, type(out[0]).__name__, type(out[1]).__name__, flush=True)
        print(wg.apply([(lambda v: v + 1, 1), (abs, -2)]), flush=True)
        wg.shutdown()
    """)
    assert proc.stdout.readline().strip() == "True"
    assert proc.stdout.readline().strip() == "True Colour Name"
    assert proc.stdout.readline().strip() == "[[2, 2], [2, 2]]"
    assert proc.wait(timeout=60) == 0


def test_dataproto_echo_keeps_values(tmp_path):
    batch = DataProto.from_dict(
        {"a": torch.randn(64, 1024), "b": torch.arange(64)}, non_tensors={"s": [str(i) for i in range(64)]}
    )

    class Echo:
        @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
        def echo(self, b):
            return b

    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Echo)) as wg:
        out = wg.echo(batch)
    assert torch.equal(out.batch["a"], batch.batch["a"]) and torch.equal(out.batch["b"], batch.batch["b"])
    assert list(out.non_tensor_batch["s"]) == [str(i) for i in range(64)]


def test_large_collected_columns_are_joined_into_reused_shared_memory():
    """A large column of a DP_COMPUTE_PROTO result is joined into a free segment of the controller
    (its pages faulted in already), which goes back to the pool when the result is dropped."""
    import gc

    from spmdcall.transport.segments import pool

    batch = DataProto.from_dict({"big": torch.randn(256, 2048), "small": torch.arange(256)})  # 2 MiB, 2 KiB

    class Echo:
        @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
        def echo(self, b):
            return b

    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Echo)) as wg:
        out = wg.echo(batch)
        assert torch.equal(out.batch["big"], batch.batch["big"]) and torch.equal(
            out.batch["small"], batch.batch["small"]
        )
        assert "spmdcall" in _mapping_of(out.batch["big"])  # a memfd segment
        assert "spmdcall" not in _mapping_of(out.batch["small"])  # below a segment's size: new memory
        out.batch["big"].add_(1)  # a result is the caller's own, writable memory
        assert torch.equal(out.batch["big"], batch.batch["big"] + 1)
        free_before = pool().stats()["free"]
        del out
        gc.collect()
        assert pool().stats()["free"] > free_before
        again = wg.echo(batch)  # reuses a segment: the values are the new call's
        assert torch.equal(again.batch["big"], batch.batch["big"])


class Keeper:
    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def echo(self, b):
        return b

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def keep(self, b):
        self.kept = b
        return b

    def bump_kept(self):
        self.kept.batch["a"].add_(1000)


def test_returned_views_of_the_input_go_back_by_reference_unless_the_worker_keeps_them(monkeypatch):
    from spmdcall.transport.segments import SegmentPool

    borrowed = []
    real_borrow = SegmentPool.borrow
    monkeypatch.setattr(SegmentPool, "borrow", lambda self, *a: borrowed.append(a) or real_borrow(self, *a))
    batch = DataProto.from_dict({"a": torch.randn(256, 1024), "b": torch.randn(256, 1024)})
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Keeper)) as wg:
        out = wg.echo(batch)
        assert torch.equal(out.batch["a"], batch.batch["a"]) and torch.equal(out.batch["b"], batch.batch["b"])
        assert len(borrowed) == 4  # 2 ranks x 2 columns: no copy on the way back

        borrowed.clear()
        kept = wg.keep(batch)
        assert borrowed == []  # the worker still holds its input: the reply is a copy
        wg.bump_kept()
        assert torch.equal(kept.batch["a"], batch.batch["a"])  # so later writes there stay there
