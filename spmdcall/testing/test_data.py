"""DataProto through every backend: split by rank, rows back in order, padding undone, device
meshes, hand-off between groups, and torch.distributed between the ranks. Skipped without torch
and tensordict (the ``spmdcall[torch]`` extra)."""

from __future__ import annotations

import pytest

import spmdcall as sc
from spmdcall.testing.plugin import own_processes
from spmdcall.testing.workers import AllReduce, Counter, MeshWorker, Rollout, rows

pytest.importorskip("torch", reason="DataProto needs torch: pip install 'spmdcall[torch]'")
pytest.importorskip("tensordict", reason="DataProto needs tensordict: pip install 'spmdcall[torch]'")

from spmdcall import DataProto  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def data_counters(spmd_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter), backend=spmd_backend) as wg:
        yield wg


def _rows_come_back_in_order(wg):
    for num_rows in (1, 2, 3, 5, 7):
        batch = rows(num_rows)
        out = wg.double(batch)
        assert len(out) == num_rows
        assert out.batch["x"].tolist() == [2.0 * i for i in range(num_rows)]
        assert list(out.non_tensor_batch["id"]) == [f"row{i}" for i in range(num_rows)]
        assert batch.batch["x"].tolist() == [
            float(i) for i in range(num_rows)
        ]  # the caller's batch is untouched
        seen = list(out.non_tensor_batch["seen_by"])
        assert seen == sorted(seen)  # rank i computed the i-th block of rows


def test_dp_compute_proto_any_batch_size_rows_in_order(data_counters):
    _rows_come_back_in_order(data_counters)


@pytest.mark.parametrize("world_size", [1, 3])
def test_dp_compute_proto_rows_in_order_on_other_world_sizes(spmd_backend, world_size):
    with sc.WorkerGroup(
        sc.ResourcePool([world_size]), sc.ClassWithInitArgs(Counter), backend=spmd_backend
    ) as wg:
        _rows_come_back_in_order(wg)


def test_dp_compute_proto_unpads_multi_sample_outputs(data_counters):
    batch = rows(5)
    batch.meta_info["n"] = 3
    out = data_counters.sample(batch)
    assert len(out) == 15
    assert out.batch["x"].tolist() == [float(i) for i in range(5) for _ in range(3)]
    assert out.batch["sample"].tolist() == [0, 1, 2] * 5


def test_dp_compute_proto_with_func_and_metric(data_counters):
    out = data_counters.apply(lambda x: x * 10, rows(4))
    assert out.batch["x"].tolist() == [0.0, 10.0, 20.0, 30.0]
    metrics = data_counters.metrics(rows(4))
    assert [m["rank"] for m in metrics] == [0, 1]
    assert [m["rows"] for m in metrics] == [2, 2] and sum(m["sum"] for m in metrics) == 6.0


def test_worker_mutation_of_a_batch_does_not_leak_into_caller(data_counters):
    batch = rows(4)
    sums = data_counters.mutate(batch)
    assert sums == [406.0, 406.0]  # each rank saw its own copy: 0+1+2+3 + 4*100
    assert batch.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_bad_data_raises_before_anything_is_sent(data_counters):
    data_counters.set_each([1, 1])
    with pytest.raises(ValueError, match="empty DataProto"):
        data_counters.double(rows(0))
    with pytest.raises(TypeError, match="argument 0 of type list cannot be split"):
        data_counters.double([1, 2, 3])
    with pytest.raises(ValueError, match="same number of rows"):
        data_counters.apply(lambda x: x, rows(3), rows(4))
    assert data_counters.get() == [1, 1]  # nothing reached the workers


def test_future_passed_into_another_groups_call(data_counters, spmd_backend, monkeypatch):
    """A GroupFuture passed into a call of a group split the same way: rank i's output goes to
    rank i (the controller concatenates the consumer's results only), whether the backend takes
    rank futures itself (``Capabilities.hand_off``) or the group hands their values on."""
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter), backend=spmd_backend
    ) as consumer:
        concats = []
        real_concat = DataProto.concat

        def counted_concat(data, alloc=None):
            concats.append(1)
            return real_concat(data, alloc)

        monkeypatch.setattr(DataProto, "concat", staticmethod(counted_concat))
        future = data_counters.double_async(rows(5))
        out = consumer.plus_one(future)
        assert out.batch["x"].tolist() == [1.0, 3.0, 5.0, 7.0, 9.0]  # padding stripped at the end too
        assert len(concats) == 1
        assert future.get().batch["x"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]  # still there if wanted


# dp 2 with tp replicas (5 rows: padding shared by replicas); dp 3 without (an odd dp size).
@pytest.mark.parametrize("world_size,tp", [(4, 2), (3, 1)])
def test_nd_dispatch_splits_over_dp_and_collects_once_per_dp_rank(spmd_backend, world_size, tp):
    dp = world_size // tp
    with sc.WorkerGroup(
        sc.ResourcePool([world_size]), sc.ClassWithInitArgs(MeshWorker, tp), backend=spmd_backend
    ) as wg:
        for num_rows in (dp * 2, dp * 2 + 1, 1):
            out = wg.tag(rows(num_rows))
            assert out.batch["x"].tolist() == [float(i) for i in range(num_rows)]  # each row once, in order
            assert set(out.batch["by"].tolist()) <= {r for r in range(world_size) if r % tp == 0}
            received = wg.received()
            for d in range(dp):
                replicas = [received[d * tp + t] for t in range(tp)]
                assert all(r == replicas[0] for r in replicas)  # tp replicas got identical chunks
            layout = wg.mesh_layout("m")
            assert layout.dp_size == dp and layout.collect_ranks == [d * tp for d in range(dp)]


def test_colocated_roles_with_different_meshes(spmd_backend):
    fused = sc.colocate(
        {"actor": sc.ClassWithInitArgs(MeshWorker, 2), "rollout": sc.ClassWithInitArgs(Rollout)}
    )
    with sc.WorkerGroup(sc.ResourcePool([2]), fused, backend=spmd_backend) as wg:
        views = wg.spawn({"actor", "rollout"})
        assert views["actor"].tag(rows(3)).batch["by"].tolist() == [0, 0, 0]  # dp1 x tp2: rank 0 collects
        assert views["rollout"].generate(rows(4)).batch["by"].tolist() == [0, 0, 1, 1]  # dp2
        assert (
            views["actor"].mesh_layout("m").dp_size == 1
            and views["rollout"].mesh_layout("rollout").dp_size == 2
        )


def test_torch_distributed_works_from_the_spmd_environment(spmd_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(AllReduce), backend=spmd_backend) as wg:
        if not own_processes(wg, wg.pid()):
            pytest.skip("the ranks are not processes of their own (worker_info): no collectives between them")
        assert wg.all_reduce() == [3.0, 3.0]
