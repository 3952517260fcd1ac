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


COLS = 1024  # float32 columns: 4 KiB a row


class Producer(sc.Worker):
    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, prompts):
        from spmdcall.data import DataProto

        x = prompts.batch["i"].float()[:, None]
        return DataProto.from_dict({"a": x.repeat(1, COLS)})

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, execute_mode=sc.Execute.RANK_ZERO, blocking=False)
    def export(self, n):
        import torch

        from spmdcall.data import DataProto

        return DataProto.from_dict({"a": torch.arange(float(n))[:, None].repeat(1, COLS)})


class Consumer(sc.Worker):
    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def take(self, batch):
        import torch

        from spmdcall.data import DataProto

        a = batch.batch["a"]
        assert torch.equal(a, a[:, :1].expand_as(a))  # every column of a row holds the row's number
        node = ray.get_runtime_context().get_node_id()
        return DataProto.from_dict({"i": a[:, 0].clone()}, meta_info={"nodes": [node]})

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def whole(self, batch):
        return len(batch), float(batch.batch["a"][:, 0].sum())


@pytest.mark.timeout(240)
def test_a_chain_between_two_nodes_moves_its_bytes_node_to_node(node_resource):
    """A producer group on one worker node, a consumer group on the other: a same-split hand-off
    goes node to node by ObjectRef (the controller's node never holds the bytes, and it sends a
    few KiB), while the same rows as a value, rank 0's result to every rank and a different
    split go through the controller (fetched, then one ``ray.put`` per consumer argument)."""
    torch = pytest.importorskip("torch")
    from spmdcall.data import DataProto

    rows, size = 1024, 1024 * COLS * 4  # 4 MiB in all, 2 MiB per producer rank
    on_one_node = {"resources_per_worker": {node_resource: 1}}  # each node offers 2: a group fills one
    with (
        sc.WorkerGroup(
            sc.ResourcePool([2]), sc.ClassWithInitArgs(Producer), backend="ray", **on_one_node
        ) as prod,
        sc.WorkerGroup(
            sc.ResourcePool([2]), sc.ClassWithInitArgs(Consumer), backend="ray", **on_one_node
        ) as cons,
    ):
        prompts = DataProto.from_dict({"i": torch.arange(rows)})
        fut = prod.produce(prompts)
        out = cons.take(fut)  # rank i's output to rank i, node to node
        handed = cons.transfer_stats()
        assert out.batch["i"].tolist() == list(range(rows))
        head = ray.get_runtime_context().get_node_id()
        producer_nodes = {w["node_id"] for w in prod.worker_info()}
        consumer_nodes = set(out.meta_info["nodes"])
        assert len(producer_nodes) == len(consumer_nodes) == 1 and producer_nodes != consumer_nodes
        assert head not in producer_nodes | consumer_nodes
        # Each producer rank's output is on both worker nodes now, and never came to the controller's.
        refs = [r.object_ref for r in fut.rank_futures]
        where = ray.experimental.get_object_locations(refs)
        for ref in refs:
            assert set(where[ref]["node_ids"]) == producer_nodes | consumer_nodes

        assert size <= handed.handed_on_bytes < size + 16 * 1024  # the two outputs, as Ray stored them
        assert handed.sent_bytes < 4 * 1024  # the call itself: metadata at most (Ray's task spec aside)

        cons.take(fut.get())  # the same rows as a value: the controller sends them
        as_value = cons.transfer_stats()
        assert as_value.handed_on_bytes == handed.handed_on_bytes
        assert as_value.sent_bytes - handed.sent_bytes >= size

        export = prod.export(rows)  # rank 0's 4 MiB
        assert cons.whole(export) == [(rows, rows * (rows - 1) / 2)] * 2  # RANK_ZERO -> ONE_TO_ALL
        broadcast = cons.transfer_stats()
        assert cons.take(export).batch["i"].tolist() == list(range(rows))  # rank 0's rows, split over 2
        split = cons.transfer_stats()
        figure = {
            "same split, handed on": (handed.sent_bytes, handed.handed_on_bytes),
            "same split, .get() first": (
                as_value.sent_bytes - handed.sent_bytes,
                as_value.handed_on_bytes - handed.handed_on_bytes,
            ),
            "RANK_ZERO -> ONE_TO_ALL": (
                broadcast.sent_bytes - as_value.sent_bytes,
                broadcast.handed_on_bytes - as_value.handed_on_bytes,
            ),
            "a different split": (
                split.sent_bytes - broadcast.sent_bytes,
                split.handed_on_bytes - broadcast.handed_on_bytes,
            ),
        }
        print(figure)  # docs/data.md, "Where the bytes go"
        # Neither is handed on by reference on ray: the controller fetches rank 0's result, and
        # puts what each consumer rank gets in the object store (one argument for every rank when
        # it is the whole result; one per rank, each with the pieces it takes rows of, when split).
        assert figure["RANK_ZERO -> ONE_TO_ALL"][1] == figure["a different split"][1] == 0
        assert size <= figure["RANK_ZERO -> ONE_TO_ALL"][0] < size + 16 * 1024
        assert 2 * size <= figure["a different split"][0] < 2 * size + 16 * 1024  # rank 0's rows, to each
