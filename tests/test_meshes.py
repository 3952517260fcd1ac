"""nd_dispatch beyond the shipped suite (spmdcall/testing/test_data.py splits over dp ranks and
collects from collect ranks on every backend): real collectives inside, and declaration errors."""

from __future__ import annotations

import pytest
import torch

import spmdcall as sc
from spmdcall import DataProto
from spmdcall.testing.workers import rows

pytestmark = pytest.mark.timeout(180)


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
            wg.tag(rows(2))
        with pytest.raises(sc.WorkerError, match="conflicting new declaration"):
            wg.declare_twice()
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(NotAWorker), backend=backend) as wg:
        with pytest.raises(TypeError, match="subclass sc.Worker"):
            wg.tag(rows(2))
