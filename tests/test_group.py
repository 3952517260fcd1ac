"""Shared behaviour of worker groups, run on every backend (inline, process, ray)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import spmdcall as sc
from spmdcall import DataProto

pytestmark = pytest.mark.timeout(120)


class Counter(sc.Worker):
    """A counter per rank."""

    def __init__(self, start=0):
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
        return DataProto.from_dict({"x": batch.batch["x"] + 1})

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def sample(self, batch):
        """n outputs per input row, interleaved (like n rollouts per prompt)."""
        n = batch.meta_info["n"]
        out = batch.repeat(n, interleave=True)
        out.batch["sample"] = torch.arange(n).repeat(len(batch))
        return out

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, batch):
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

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, timeout=1.0)
    def sleepy(self, seconds):
        time.sleep(seconds)
        return seconds

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def mutate(self, batch):
        batch.batch["x"].add_(100)
        return float(batch.batch["x"].sum())

    def identity(self):
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "env": {
                k: os.environ.get(k)
                for k in (
                    "RANK",
                    "WORLD_SIZE",
                    "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                )
            },
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


def batch_of(n: int) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(float(n))}, non_tensors={"id": [f"row{i}" for i in range(n)]}
    )


@pytest.fixture(scope="module")
def shared_group(module_backend):
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter, start=1), backend=module_backend
    ) as wg:
        yield wg


@pytest.fixture
def group(shared_group):
    """A 2-rank Counter(start=1) group, one per backend for the module (starting one on ray costs
    seconds): each test finds both counters back at 1."""
    assert shared_group.set_each([1, 1]) == [1, 1]
    return shared_group


def test_one_to_all_returns_one_result_per_rank(group):
    assert group.world_size == 2
    assert group.add(3) == [4, 4]
    assert group.add(1) == [5, 5]


def test_all_to_all_gives_rank_i_entry_i(group):
    assert group.set_each([10, 20]) == [10, 20]
    assert group.get() == [10, 20]
    assert group.scaled([2, 3]) == [20, 60]


def test_rank_zero_modes_return_rank_zero_result_only(group):
    assert group.only_zero(5) == (0, 6)
    assert group.zero_executes() == 0
    assert group.execute_rank_zero("get") == 1
    assert group.execute_all("get") == [1, 1]


def test_spmd_context_and_environment(group):
    info = group.identity()
    assert [i["rank"] for i in info] == [0, 1]
    assert all(i["world_size"] == 2 and i["local_rank"] == i["rank"] for i in info)
    for i in info:
        env = i["env"]
        assert (
            env["RANK"] == str(i["rank"]) and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == str(i["rank"])
        )
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["MASTER_ADDR"] and int(env["MASTER_PORT"]) > 0
    assert info[0]["env"]["MASTER_PORT"] == info[1]["env"]["MASTER_PORT"]


def test_inline_ranks_leave_the_controller_environment_as_it_was(monkeypatch):
    """The inline backend writes each rank's variables for its calls only: a variable the
    controller had keeps its value, one it lacked is gone again, after every call."""
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # what the ranks get too: left alone
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter), backend="inline") as g:
        assert dict(os.environ) == before
        for _ in range(2):
            info = g.identity()
            assert [i["env"]["RANK"] for i in info] == ["0", "1"]
            assert {i["env"]["MASTER_ADDR"] for i in info} == {"127.0.0.1"}
            assert dict(os.environ) == before


def _rows_come_back_in_order(wg):
    for rows in (1, 2, 3, 5, 7):
        batch = batch_of(rows)
        out = wg.double(batch)
        assert len(out) == rows
        assert out.batch["x"].tolist() == [2.0 * i for i in range(rows)]
        assert list(out.non_tensor_batch["id"]) == [f"row{i}" for i in range(rows)]
        assert batch.batch["x"].tolist() == [float(i) for i in range(rows)]  # the caller's batch is untouched
        seen = list(out.non_tensor_batch["seen_by"])
        assert seen == sorted(seen)  # rank i computed the i-th block of rows


def test_dp_compute_proto_any_batch_size_rows_in_order(group):
    _rows_come_back_in_order(group)


@pytest.mark.parametrize("world_size", [1, 3])
def test_dp_compute_proto_rows_in_order_on_other_world_sizes(backend, world_size):
    with sc.WorkerGroup(sc.ResourcePool([world_size]), sc.ClassWithInitArgs(Counter), backend=backend) as wg:
        _rows_come_back_in_order(wg)


def test_dp_compute_proto_unpads_multi_sample_outputs(group):
    batch = batch_of(5)
    batch.meta_info["n"] = 3
    out = group.sample(batch)
    assert len(out) == 15
    assert out.batch["x"].tolist() == [float(i) for i in range(5) for _ in range(3)]
    assert out.batch["sample"].tolist() == [0, 1, 2] * 5


def test_dp_compute_proto_with_func_and_metric(group):
    out = group.apply(lambda x: x * 10, batch_of(4))
    assert out.batch["x"].tolist() == [0.0, 10.0, 20.0, 30.0]
    metrics = group.metrics(batch_of(4))
    assert [m["rank"] for m in metrics] == [0, 1]
    assert [m["rows"] for m in metrics] == [2, 2] and sum(m["sum"] for m in metrics) == 6.0


def test_worker_mutation_does_not_leak_into_caller(group):
    batch = batch_of(4)
    sums = group.mutate(batch)
    assert sums == [406.0, 406.0]  # each rank saw its own copy: 0+1+2+3 + 4*100
    assert batch.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_any_class_is_a_group(backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Plain, "w"), backend=backend) as wg:
        assert wg.hello("you") == ["w: hello you", "w: hello you"]
        assert "hello" in dir(wg)
        assert wg.method_names() == ["hello"]


def test_methods_are_discoverable_and_documented(group):
    names = group.method_names()
    assert {"add", "double", "identity", "get"} <= set(names) and "_private" not in names
    assert "add" in dir(group)
    assert group.add.__doc__ == "Add k on every rank."
    with pytest.raises(AttributeError, match="no public method 'nope'"):
        group.nope()
    with pytest.raises(AttributeError):
        group._private()


def test_non_blocking_call_returns_group_future(group):
    fut = group.slow_add(2, delay=0.3)
    assert isinstance(fut, sc.GroupFuture)
    assert fut.get() == [3, 3]
    assert fut.done() and fut.get() == [3, 3]


def test_future_passed_into_another_groups_call(group, module_backend, monkeypatch):
    producer = group
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter), backend=module_backend
    ) as consumer:
        concats = []
        real_concat = DataProto.concat
        monkeypatch.setattr(
            DataProto,
            "concat",
            staticmethod(lambda d, alloc=None: concats.append(1) or real_concat(d, alloc)),
        )
        fut = producer.double_async(batch_of(5))
        out = consumer.plus_one(fut)
        assert out.batch["x"].tolist() == [1.0, 3.0, 5.0, 7.0, 9.0]  # padding stripped at the end too
        # Rank i's output went to rank i: the controller concatenated the consumer's results only.
        assert len(concats) == 1
        assert fut.get().batch["x"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]  # still there if wanted


class Source:
    """Makes a new 1 MiB batch on every call (in its own shared-memory segments)."""

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, prompts):
        x = prompts.batch["x"].float()[:, None]
        return DataProto.from_dict({"a": x.repeat(1, 512), "b": -x.repeat(1, 512)})

    def segments(self):
        from spmdcall.transport.segments import pool

        return pool().stats()


class Sink:
    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def scribble(self, batch):
        """Writes into its input, and keeps it."""
        batch.batch["a"].add_(1000)
        self.kept = batch
        return DataProto.from_dict(
            {"a0": batch.batch["a"][:, 0].clone(), "b0": batch.batch["b"][:, 0].clone()}
        )

    def kept_b(self):
        return self.kept.batch["b"][:, 0].clone()

    def drop(self):
        del self.kept


def test_a_handed_off_batch_is_the_consumers_own_inline():
    """Rank i's output goes on to rank i (no concat), but as the consumer's own: its writes do not
    show in the producer's result, and the producer's later batches do not change a batch it keeps.
    (On process and ray, the next test checks this and more.)"""
    x = torch.arange(256.0)
    with (
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Source), backend="inline") as source,
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Sink), backend="inline") as sink,
    ):
        fut = source.produce(DataProto.from_dict({"x": torch.arange(256)}))
        out = sink.scribble(fut)
        assert torch.equal(out.batch["a0"], x + 1000) and torch.equal(out.batch["b0"], -x)
        assert torch.equal(fut.get().batch["a"][:, 0], x)
        del fut
        for k in (2, 3):
            assert torch.equal(
                source.produce(DataProto.from_dict({"x": torch.arange(256) * k})).get().batch["a"][:, 0],
                x * k,
            )
        assert torch.equal(torch.cat(sink.kept_b()), -x)


def test_handed_off_outputs_pass_on_in_the_producers_memory(process_backend, monkeypatch):
    """A GroupFuture passed into another group's call: rank i's output goes to rank i in the
    producer's own shared memory (the controller copies nothing), mapped copy-on-write, so the
    consumer's writes stay its own; the producer's segment is not reused while the consumer holds
    it, and is free again once the consumer lets go."""
    import gc

    from spmdcall.transport import frames

    copied = []
    real_copy_into = frames.copy_into
    monkeypatch.setattr(frames, "copy_into", lambda f, c, r: copied.append(c) or real_copy_into(f, c, r))
    prompts = DataProto.from_dict({"x": torch.arange(256)})
    x = torch.arange(256.0)
    with (
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Source), backend=process_backend) as source,
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Sink), backend=process_backend) as sink,
    ):
        fut = source.produce(prompts)
        copied.clear()  # the prompts went out as a copy (below a segment's size: inline) before
        out = sink.scribble(fut)
        assert copied == []  # nothing copied on the way to the sink
        assert torch.equal(out.batch["a0"], x + 1000) and torch.equal(out.batch["b0"], -x)
        assert torch.equal(fut.get().batch["a"][:, 0], x)  # the sink's writes are its own
        del fut, out  # the controller's own views of the first batch go
        gc.collect()

        for k in (2, 3, 4):  # new batches while the sink keeps the first: its bytes do not change
            again = source.produce(DataProto.from_dict({"x": torch.arange(256) * k})).get()
            assert torch.equal(again.batch["a"][:, 0], x * k)
        del again
        assert torch.equal(torch.cat(sink.kept_b()), -x)

        gc.collect()
        received, held = len(frames.received), sum(s["segments"] - s["free"] for s in source.segments())
        sink.drop()
        assert len(frames.received) == received - 2  # on the sink's reply, the controller let go
        if process_backend == "process":  # a Ray actor hears of it when it next reads its link
            source.segments()  # the source hears of it with this call
            assert sum(s["segments"] - s["free"] for s in source.segments()) == held - 2


def test_colocated_roles_share_processes(backend):
    fused = sc.colocate(
        {"counter": sc.ClassWithInitArgs(Counter, start=5), "plain": sc.ClassWithInitArgs(Plain, "p")}
    )
    with sc.WorkerGroup(sc.ResourcePool([2]), fused, backend=backend) as wg:
        views = wg.spawn({"counter", "plain"})
        assert views["counter"].add(1) == [6, 6]
        assert views["plain"].hello("x") == ["p: hello x", "p: hello x"]
        assert views["counter"].double(batch_of(3)).batch["x"].tolist() == [0.0, 2.0, 4.0]
        assert "hello" in views["plain"].method_names() and "hello" not in views["counter"].method_names()
        pids = [i["pid"] for i in views["counter"].identity()]
        assert [i["pid"] for i in wg.worker_info()] == pids
        with pytest.raises(ValueError, match="unknown roles"):
            wg.spawn({"nobody"})


def test_colocated_roles_reach_their_siblings_of_the_same_rank(backend):
    fused = sc.colocate(
        {"weights": sc.ClassWithInitArgs(Weights), "reader": sc.ClassWithInitArgs(Reader, at_init=True)}
    )
    with sc.WorkerGroup(sc.ResourcePool([3]), fused, backend=backend) as wg:
        views = wg.spawn({"weights", "reader"})
        assert views["reader"].first_read() == [(0, 100), (1, 101), (2, 102)]  # built before it: reachable
        views["weights"].bump(5)
        assert views["reader"].read() == [(0, 0, 105), (1, 1, 106), (2, 2, 107)]  # the live object, same rank
        assert views["reader"].lookup_error("critic")[0] == (
            "ValueError",
            "no role 'critic' in this colocation; its roles are ['weights', 'reader']",
        )
        assert "sibling" not in views["reader"].method_names()
        assert "_peek" not in views["weights"].method_names()


def test_a_sibling_built_later_is_not_there_in_init(backend):
    fused = sc.colocate(
        {"reader": sc.ClassWithInitArgs(Reader, at_init=True), "weights": sc.ClassWithInitArgs(Weights)}
    )
    with pytest.raises(sc.WorkerError, match="role 'weights' is not built yet") as info:
        sc.WorkerGroup(sc.ResourcePool([2]), fused, backend=backend)
    assert info.value.method == "__init__" and info.value.exc_type == "RuntimeError"


def test_a_role_outside_a_colocation_has_no_siblings(backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Reader), backend=backend) as wg:
        with pytest.raises(sc.WorkerError, match="Reader is not a role of a colocation") as info:
            wg.read()
        assert info.value.exc_type == "RuntimeError"
    with pytest.raises(RuntimeError, match=r"sc.colocate\(\{'weights': ..., ...\}\)"):
        Reader().read()  # built by hand, outside any group: the same error


def test_custom_dispatch_modes_by_object_name_and_dict(backend):
    def first_rank_gets_all(group, *args, **kwargs):
        return tuple([a] + [None] * (group.world_size - 1) for a in args), {}

    def collect_sum(group, outputs):
        return sum(o for o in outputs if o is not None)

    mode = sc.register_dispatch_mode("TEST_SUM_FIRST", first_rank_gets_all, collect_sum, overwrite=True)

    class Adder:
        @sc.register(dispatch_mode=mode)
        def by_object(self, x):
            return None if x is None else x + 1

        @sc.register(dispatch_mode="TEST_SUM_FIRST")
        def by_name(self, x):
            return None if x is None else x * 2

        @sc.register(
            dispatch_mode={"dispatch_fn": sc.Dispatch.ONE_TO_ALL.dispatch_fn, "collect_fn": collect_sum}
        )
        def by_dict(self, x):
            return x

    with sc.WorkerGroup(sc.ResourcePool([3]), sc.ClassWithInitArgs(Adder), backend=backend) as wg:
        assert wg.by_object(1) == 2
        assert wg.by_name(5) == 10
        assert wg.by_dict(4) == 12


def test_shutdown_and_context_manager(backend):
    wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter), backend=backend)
    assert wg.add(1) == [1, 1]
    wg.shutdown()
    wg.shutdown()  # twice is fine
    with pytest.raises(RuntimeError, match="shut down"):
        wg.add(1)


def test_constructor_error_is_a_worker_error(backend):
    with pytest.raises(sc.WorkerError) as info:
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Plain), backend=backend)  # missing "tag"
    assert info.value.method == "__init__" and "tag" in str(info.value)


def test_trace_records_dispatch_execute_collect(group, tmp_path):
    import json

    path = tmp_path / "trace.json"
    with sc.trace(path):
        group.add(1)
        group.double(batch_of(3))
    events = json.loads(path.read_text())["traceEvents"]
    names = [e["name"] for e in events if e["ph"] == "X"]
    assert names.count("add dispatch") == 1 and names.count("add collect") == 1 and names.count("add") == 2
    assert names.count("double") == 2
    ranks = sorted(e["args"]["rank"] for e in events if e["ph"] == "X" and e["name"] == "double")
    assert ranks == [0, 1]


def test_split_and_merged_pools_keep_their_device_slots():
    pool = sc.ResourcePool([4, 4], use_gpu=True, max_colocate_count=3)
    first, second = pool.split([2, 6])
    assert (first.world_size, second.world_size) == (2, 6)
    assert second.process_on_nodes == [2, 4] and second.placements() == [(0, 2), (0, 3)] + [
        (1, b) for b in range(4)
    ]
    assert [(base is pool, node) for base, node, _ in second.slots()] == [(True, 0)] * 2 + [(True, 1)] * 4
    assert (second.use_gpu, second.max_colocate_count) == (True, 3)
    # Split again (equal parts of 2), then merge back in another order: slots follow the ranks.
    quarters = second.split(2)
    assert [q.placements() for q in quarters] == [[(0, 2), (0, 3)], [(0, 0), (0, 1)], [(0, 2), (0, 3)]]
    merged = sc.ResourcePool.merge([quarters[2], first])
    assert [(node, bundle) for _, node, bundle in merged.slots()] == [(1, 2), (1, 3), (0, 0), (0, 1)]
    assert merged.process_on_nodes == [2, 2]
    # Local ranks count from 0 on every node of the new pool, whatever its slots.
    ctx = merged.contexts("127.0.0.1", 1234)
    assert [(c.rank, c.node_rank, c.local_rank, c.local_world_size) for c in ctx] == [
        (0, 0, 0, 2),
        (1, 0, 1, 2),
        (2, 1, 0, 2),
        (3, 1, 1, 2),
    ]
    with pytest.raises(ValueError, match="add up to 7"):
        pool.split([3, 4])
    with pytest.raises(ValueError, match="does not divide"):
        pool.split(3)
    with pytest.raises(ValueError, match="same device slot twice"):
        sc.ResourcePool.merge([first, first])
    with pytest.raises(ValueError, match="different use_gpu"):
        sc.ResourcePool.merge([first, sc.ResourcePool([1])])


def test_groups_on_split_pools(backend):
    left, right = sc.ResourcePool([3]).split([1, 2])
    with (
        sc.WorkerGroup(left, sc.ClassWithInitArgs(Counter), backend=backend) as a,
        sc.WorkerGroup(right, sc.ClassWithInitArgs(Counter), backend=backend) as b,
    ):
        assert a.world_size == 1 and b.world_size == 2
        assert [i["env"]["LOCAL_RANK"] for i in b.identity()] == ["0", "1"]
        assert a.add(1) == [1] and b.add(2) == [2, 2]


def test_bad_constructor_arguments_are_clear():
    with pytest.raises(TypeError, match="ClassWithInitArgs"):
        sc.WorkerGroup(sc.ResourcePool([2]), Counter)
    with pytest.raises(TypeError, match="expects a class"):
        sc.ClassWithInitArgs(Counter(), 1)
    with pytest.raises(ValueError, match="positive integer"):
        sc.ResourcePool([0])
    with pytest.raises(TypeError, match="list of process counts"):
        sc.ResourcePool(2)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Counter), backend="nope")
