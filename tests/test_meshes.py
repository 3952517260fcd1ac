"""nd_dispatch: data split over dp ranks only, results from collect ranks only; real collectives inside."""

from __future__ import annotations

import pytest
import torch

import spmdcall as sc
from spmdcall import DataProto

pytestmark = pytest.mark.timeout(180)


class MeshWorker(sc.Worker):
    def __init__(self, tp: int, mesh_name: str = "m"):
        self.mesh_name = mesh_name
        self.register_mesh(
            mesh_name, dp_rank=self.rank // tp, dp_size=self.world_size // tp, is_collect=self.rank % tp == 0
        )
        self.last_ids: list = []

    @sc.register(dispatch_mode=sc.nd_dispatch("m"))
    def tag(self, batch):
        self.last_ids = batch.batch["x"].tolist()
        return DataProto.from_dict({"x": batch.batch["x"], "by": torch.full((len(batch),), self.rank)})

    def received(self):
        return self.last_ids


def batch_of(n):
    return DataProto.from_dict({"x": torch.arange(float(n))})


# dp 2 with tp replicas (5 rows: padding shared by replicas); dp 3 without (an odd dp size).
@pytest.mark.parametrize("world_size,tp", [(4, 2), (3, 1)])
def test_nd_dispatch_splits_over_dp_and_collects_once_per_dp_rank(process_backend, world_size, tp):
    dp = world_size // tp
    with sc.WorkerGroup(
        sc.ResourcePool([world_size]), sc.ClassWithInitArgs(MeshWorker, tp), backend=process_backend
    ) as wg:
        for rows in (dp * 2, dp * 2 + 1, 1):
            out = wg.tag(batch_of(rows))
            assert out.batch["x"].tolist() == [
                float(i) for i in range(rows)
            ]  # each row exactly once, in order
            assert set(out.batch["by"].tolist()) <= {r for r in range(world_size) if r % tp == 0}
            received = wg.received()
            for d in range(dp):
                replicas = [received[d * tp + t] for t in range(tp)]
                assert all(r == replicas[0] for r in replicas)  # tp replicas got identical chunks
            layout = wg.mesh_layout("m")
            assert layout.dp_size == dp and layout.collect_ranks == [d * tp for d in range(dp)]


class TensorParallelSum(sc.Worker):
    """Each tp pair holds half of a weight vector and all-reduces its partial results."""

    def __init__(self):
        self.mesh = sc.build_device_mesh((2, 2), ("dp", "tp"))
        self.register_mesh("actor", mesh=self.mesh, dp_axis="dp")
        self.tp_rank = self.mesh.get_local_rank("tp")

    @sc.register(dispatch_mode=sc.nd_dispatch("actor"))
    def forward(self, batch):
        import torch.distributed as dist

        x = batch.batch["x"]  # (rows, 4): each tp rank multiplies its half by weight [1, 2, 3, 4]
        half = slice(2 * self.tp_rank, 2 * self.tp_rank + 2)
        partial = (x[:, half] * torch.tensor([1.0, 2.0, 3.0, 4.0])[half]).sum(dim=1)
        dist.all_reduce(partial, group=self.mesh["tp"].get_group())
        return DataProto.from_dict({"y": partial})


def test_tensor_parallel_collective_inside_the_method(process_backend):
    with sc.WorkerGroup(
        sc.ResourcePool([4]), sc.ClassWithInitArgs(TensorParallelSum), backend=process_backend
    ) as wg:
        x = torch.arange(20.0).reshape(5, 4)
        out = wg.forward(DataProto.from_dict({"x": x}))
        assert torch.allclose(out.batch["y"], x @ torch.tensor([1.0, 2.0, 3.0, 4.0]))
        assert wg.mesh_layout("actor").collect_ranks == [0, 2]


class Undeclared(sc.Worker):
    @sc.register(dispatch_mode=sc.nd_dispatch("m"))
    def tag(self, batch):
        return batch

    def declare_twice(self):
        self.register_mesh("x", dp_rank=0, dp_size=1, is_collect=True)
        self.register_mesh("x", dp_rank=self.rank, dp_size=self.world_size, is_collect=True)


class NotAWorker:
    @sc.register(dispatch_mode=sc.nd_dispatch("m"))
    def tag(self, batch):
        return batch


def test_missing_or_conflicting_declarations_are_clear_errors(backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Undeclared), backend=backend) as wg:
        with pytest.raises(ValueError, match=r"ranks \[0, 1\] did not declare mesh 'm'"):
            wg.tag(batch_of(2))
        with pytest.raises(sc.WorkerError, match="conflicting new declaration"):
            wg.declare_twice()
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(NotAWorker), backend=backend) as wg:
        with pytest.raises(TypeError, match="subclass sc.Worker"):
            wg.tag(batch_of(2))


class Rollout(sc.Worker):
    def __init__(self):
        self.register_mesh("rollout", dp_rank=self.rank, dp_size=self.world_size, is_collect=True)

    @sc.register(dispatch_mode=sc.nd_dispatch("rollout"))
    def generate(self, batch):
        return DataProto.from_dict({"x": batch.batch["x"], "by": torch.full((len(batch),), self.rank)})


def test_colocated_roles_with_different_meshes(backend):
    fused = sc.colocate(
        {"actor": sc.ClassWithInitArgs(MeshWorker, 2), "rollout": sc.ClassWithInitArgs(Rollout)}
    )
    with sc.WorkerGroup(sc.ResourcePool([2]), fused, backend=backend) as wg:
        views = wg.spawn({"actor", "rollout"})
        assert views["actor"].tag(batch_of(3)).batch["by"].tolist() == [0, 0, 0]  # dp1 x tp2: rank 0 collects
        assert views["rollout"].generate(batch_of(4)).batch["by"].tolist() == [0, 0, 1, 1]  # dp2
        assert (
            views["actor"].mesh_layout("m").dp_size == 1
            and views["rollout"].mesh_layout("rollout").dp_size == 2
        )
