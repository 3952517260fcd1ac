"""The process backend: shared-memory transport, process death, controller death, torch.distributed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import spmdcall as sc
from spmdcall import DataProto
from spmdcall.backends.channel import encode

pytestmark = pytest.mark.timeout(120)


class Probe(sc.Worker):
    def __init__(self, value=0):
        self.value = value

    def pid(self):
        return os.getpid()

    def context(self):
        return self.spmd_context

    def where_is(self, tensor):
        """Which mapping of this process holds the tensor's bytes."""
        addr = tensor.data_ptr()
        with open("/proc/self/maps") as f:
            for line in f:
                span, *rest = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in span.split("-"))
                if lo <= addr < hi:
                    return rest[4].strip() if len(rest) >= 5 else "anonymous"
        return "unknown"

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


def test_large_tensors_travel_in_shared_memory_not_the_socket():
    big = torch.randn(1 << 20)
    frame = encode((None, "f", (big,), {}))
    assert frame.fd >= 0 and len(frame.header) < 2000  # 4 MiB of data, a tiny frame
    frame.close()
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Probe)) as wg:
        assert all("memfd:spmdcall" in where for where in wg.where_is(big))
        out = wg.make(1 << 20)
        assert [t[0].item() for t in out] == [0.0, 1.0] and all(t.shape == (1 << 20,) for t in out)


def test_small_payloads_stay_inline():
    frame = encode((None, "f", (torch.ones(4),), {}))
    assert frame.fd == -1
    frame.close()


@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_distributed_all_reduce(world_size):
    with sc.WorkerGroup(sc.ResourcePool([world_size]), sc.ClassWithInitArgs(Probe)) as wg:
        expected = world_size * (world_size + 1) / 2
        assert wg.allreduce() == [expected] * world_size


def test_simulated_nodes_get_local_ranks():
    with sc.WorkerGroup(sc.ResourcePool([2, 1]), sc.ClassWithInitArgs(Probe)) as wg:
        envs = wg.context()
        assert [(c.rank, c.node_rank, c.local_rank, c.local_world_size) for c in envs] == [(0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 1)]


def test_killed_worker_raises_worker_died_error_fast_and_restart_recovers():
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Probe, value=7)) as wg:
        pids = wg.pid()
        wg.set(8)
        fut = wg.execute_all_async("sleep", 2)
        time.sleep(0.3)
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(sc.WorkerDiedError) as info:
            fut.get()
        assert time.monotonic() - start < 5
        assert info.value.rank == 1 and "SIGKILL" in str(info.value)
        start = time.monotonic()
        with pytest.raises(sc.WorkerDiedError, match="rank 1"):
            wg.get()  # fails fast until restart
        assert time.monotonic() - start < 1
        wg.restart([1])
        new_pids = wg.pid()
        assert new_pids[0] == pids[0] and new_pids[1] != pids[1]
        assert wg.get()[1] == 7  # constructor ran again
        assert wg.context()[1].rank == 1


def test_unpicklable_result_is_a_type_error_naming_the_method():
    with sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Probe)) as wg:
        with pytest.raises(TypeError, match="unpicklable"):
            wg.unpicklable()
        assert wg.get() == [0]


def _run_controller(script: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.getcwd()])}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True, env=env)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it has exited
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_workers_exit_when_the_controller_is_killed():
    proc = _run_controller("""
        import spmdcall as sc, time
        from test_process_backend import Probe
        wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Probe))
        fut = wg.execute_all_async("sleep", 60)   # busy workers must notice too
        print(*wg.worker_info() and [i["pid"] for i in wg.worker_info()], flush=True)
        time.sleep(60)
    """)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _wait_gone(pids, 10) == []


def test_ctrl_c_reaches_the_controller_and_workers_are_cleaned_up():
    proc = _run_controller("""
        import spmdcall as sc
        from test_process_backend import Probe
        wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Probe))
        print(*[i["pid"] for i in wg.worker_info()], flush=True)
        try:
            wg.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise
    """)
    pids = [int(p) for p in proc.stdout.readline().split()]
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "interrupted"
    assert proc.wait(timeout=15) != 0
    assert _wait_gone(pids, 10) == []


def test_group_without_shutdown_is_cleaned_up_at_exit():
    proc = _run_controller("""
        import spmdcall as sc
        from test_process_backend import Probe
        wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Probe))
        print(*[i["pid"] for i in wg.worker_info()], flush=True)
    """)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert proc.wait(timeout=30) == 0
    assert _wait_gone(pids, 5) == []


def test_script_classes_defined_in_main_work_without_a_main_guard():
    proc = _run_controller("""
        import spmdcall as sc
        class Local:
            def twice(self, x): return 2 * x
        wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Local))
        print(wg.twice(21), flush=True)
        wg.shutdown()
    """)
    assert proc.stdout.readline().strip() == "[42, 42]"
    assert proc.wait(timeout=30) == 0


def test_dataproto_echo_keeps_values(tmp_path):
    batch = DataProto.from_dict({"a": torch.randn(64, 1024), "b": torch.arange(64)}, non_tensors={"s": [str(i) for i in range(64)]})

    class Echo:
        @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
        def echo(self, b):
            return b

    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Echo)) as wg:
        out = wg.echo(batch)
    assert torch.equal(out.batch["a"], batch.batch["a"]) and torch.equal(out.batch["b"], batch.batch["b"])
    assert list(out.non_tensor_batch["s"]) == [str(i) for i in range(64)]
