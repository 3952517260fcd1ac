"""A verl-style trainer skeleton, written as verl writes it, running on spmdcall.

Apart from its imports (``from spmdcall.compat.verl import ...`` where verl has ``from verl...``)
and the ``--backend`` flag every example takes, this is verl code. What it shows:

- a worker that builds a torch DeviceMesh (dp x tp) and declares its place with
  ``self._register_dispatch_collect_info("actor", ...)``, and methods dispatched with
  ``make_nd_compute_dataproto_dispatch_fn("actor")``: the batch is split over the dp ranks, tp
  replicas get the same rows (checked with a collective), only tp rank 0 of each dp rank reports;
- ``split_resource_pool`` cutting one pool into a trainer part and a reward part (whose
  ``DP_COMPUTE_PROTO`` method splits the batch over its two ranks);
- ``create_colocated_worker_cls`` putting actor and reference policy in the same processes, and
  ``spawn`` giving one group per role;
- ``ray.get`` on what non-blocking calls return (Ray ObjectRefs, as in verl).

Needs torch and Ray: ``pip install "spmdcall[torch,ray]"``.

Run it (it needs the ray backend: the driver calls ray.get):

    python examples/verl_style.py [--backend ray]
"""

from __future__ import annotations

import argparse
import sys

import ray
import torch
import torch.distributed as dist

from spmdcall.compat.verl import (  # verl: from verl import DataProto; from verl.single_controller... import ...
    DataProto,
    Dispatch,
    Execute,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    create_colocated_worker_cls,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    set_default_backend,
    split_resource_pool,
)


class ActorWorker(Worker):
    """The policy, sharded over a dp x tp mesh (the "model" is one scale per rank)."""

    def __init__(self, tp_size: int):
        super().__init__()
        if not dist.is_initialized():
            dist.init_process_group(backend="gloo")
        dp_size = dist.get_world_size() // tp_size
        self.mesh = dist.device_mesh.init_device_mesh("cpu", (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
        self._register_dispatch_collect_info(
            "actor",
            dp_rank=self.mesh["dp"].get_local_rank(),
            is_collect=self.mesh["tp"].get_local_rank() == 0,
        )
        self.scale = 1.0

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        # Every tp rank of a dp group sees the same rows: check it with a collective, as tp would.
        rows = torch.tensor([float(prompts.batch["prompts"].sum())])
        dist.all_reduce(rows, group=self.mesh["tp"].get_group())
        assert rows.item() == self.mesh["tp"].size() * float(prompts.batch["prompts"].sum())
        responses = prompts.batch["prompts"] * self.scale
        dp_rank = torch.full((len(prompts),), self.mesh["dp"].get_local_rank())
        return DataProto.from_dict({"responses": responses, "dp_rank": dp_rank})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data: DataProto) -> DataProto:
        # A policy-gradient-shaped step; the dp ranks average it so they stay one model, as FSDP would.
        step = (data.batch["advantages"] * data.batch["responses"]).mean().reshape(1) / 10
        dist.all_reduce(step, group=self.mesh["dp"].get_group())
        self.scale += float(step) / self.mesh["dp"].size()
        return DataProto(meta_info={"metrics": {"actor/scale": self.scale}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def set_seed(self, seed: int) -> int:
        torch.manual_seed(seed + self.rank)
        return seed + self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def save_checkpoint(self, path: str) -> str:
        return f"rank {self.rank} saved scale {self.scale:.2f} to {path}"


class RefWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"ref_log_prob": -data.batch["responses"].float() / 10})


class RewardWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_score(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"scores": (data.batch["responses"] > 2).float()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ray", help="ray (the driver calls ray.get on results)")
    args = parser.parse_args()
    if args.backend != "ray":
        parser.error(
            f"--backend {args.backend}: this verl-style driver calls ray.get, so it needs --backend ray"
        )
    set_default_backend(args.backend)
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False)

    global_pool = RayResourcePool(process_on_nodes=[4], use_gpu=False)
    trainer_pool, reward_pool = split_resource_pool(global_pool, split_size=2)

    class_dict = {
        "actor": RayClassWithInitArgs(cls=ActorWorker, tp_size=2),
        "ref": RayClassWithInitArgs(cls=RefWorker),
    }
    trainer_wg = RayWorkerGroup(
        resource_pool=trainer_pool, ray_cls_with_init=create_colocated_worker_cls(class_dict)
    )
    roles = trainer_wg.spawn(prefix_set=class_dict.keys())
    actor_wg, ref_wg = roles["actor"], roles["ref"]
    reward_wg = RayWorkerGroup(
        resource_pool=reward_pool, ray_cls_with_init=RayClassWithInitArgs(cls=RewardWorker)
    )

    seeds = ray.get(actor_wg.set_seed(42))  # a list of ObjectRefs, as verl returns
    assert seeds == [42, 43], seeds

    prompts = DataProto.from_dict({"prompts": torch.arange(6.0)})
    for step in range(2):
        batch = actor_wg.generate_sequences(prompts)  # dp=1 x tp=2: both ranks get every row
        assert batch.batch["dp_rank"].tolist() == [0] * 6  # and only tp rank 0 reports
        batch = batch.union(ref_wg.compute_ref_log_prob(batch))
        batch = batch.union(reward_wg.compute_score(batch))
        batch.batch["advantages"] = batch.batch["scores"] - batch.batch["scores"].mean()
        metrics = actor_wg.update_actor(batch).meta_info["metrics"]
        print(f"step {step}: mean score {batch.batch['scores'].mean():.2f}, metrics {metrics}")
    print(actor_wg.save_checkpoint("/tmp/ckpt"))
    assert actor_wg._dispatch_info["actor"] == [0, 0] and actor_wg._collect_info["actor"] == [True, False]

    for wg in (trainer_wg, reward_wg):
        wg.shutdown()
    ray.shutdown()
    print("verl-style driver: ok")


if __name__ == "__main__":
    sys.exit(main())
