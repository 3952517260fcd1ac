"""A pool over two (simulated) nodes: rank order, per-node environment, torch.distributed across
nodes, and data moving between the controller's node and the workers' nodes."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

import spmdcall as sc

ray = pytest.importorskip(
    "ray", minversion="2.40"
)  # [ray]'s floor; also rejects tests/ray/ seen as a namespace package

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]


class NodeWorker(sc.Worker):
    def where(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "env": {
                k: os.environ[k]
                for k in (
                    "RANK",
                    "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE",
                    "GROUP_RANK",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                )
            },
            "context": (self.rank, self.local_rank, self.local_world_size, self.node_rank),
        }

    def all_reduce(self) -> tuple[float, list[str]]:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # from the env the group set
        total = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(total)
        nodes: list = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
        return total.item(), nodes

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def scale(self, batch):
        import torch

        batch.batch["x"] = batch.batch["x"] * 2
        batch.batch["rank"] = torch.full((len(batch),), self.rank)
        return batch

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def rank_of_input(self, batch):
        import torch

        batch.batch["consumer"] = torch.full((len(batch),), self.rank)
        return batch


@pytest.mark.timeout(180)
def test_two_node_pool_orders_ranks_by_node_and_runs_collectives_across_nodes(node_resource):
    torch = pytest.importorskip("torch")
    from spmdcall.data import DataProto

    pool = sc.ResourcePool([2, 2])
    # Each simulated worker node offers 2 of node_resource, so each node's placement group fills one node.
    with sc.WorkerGroup(
        pool,
        sc.ClassWithInitArgs(NodeWorker),
        backend="ray",
        name="two-nodes",
        resources_per_worker={node_resource: 1},
    ) as wg:
        where = wg.where()
        nodes = [w["node_id"] for w in where]
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # ranks ordered by node, then local rank
        head = ray.get_runtime_context().get_node_id()
        assert head not in nodes  # the custom resource kept them off the head node
        assert [w["context"] for w in where] == [(0, 0, 2, 0), (1, 1, 2, 0), (2, 0, 2, 1), (3, 1, 2, 1)]
        assert [w["env"]["GROUP_RANK"] for w in where] == ["0", "0", "1", "1"]
        assert {w["env"]["MASTER_ADDR"] for w in where} == {where[0]["ip"]}  # rank 0's node
        assert len({w["env"]["MASTER_PORT"] for w in where}) == 1

        results = wg.all_reduce()
        assert [total for total, _ in results] == [10.0] * 4  # 1 + 2 + 3 + 4, across both nodes
        assert results[0][1] == nodes

        # Data from the controller's node to both worker nodes and back, rows in order; then a
        # rank-to-rank hand-off (each rank reads its own output, on its own node).
        batch = DataProto.from_dict({"x": torch.arange(10.0)})
        scaled = wg.scale(batch)
        out = wg.rank_of_input(scaled)
        assert out.batch["x"].tolist() == [2.0 * i for i in range(10)]
        assert out.batch["rank"].tolist() == out.batch["consumer"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
