"""Colocate two roles in the same worker processes, and compare with separate processes.

What it shows:

- ``sc.colocate({"actor": ..., "critic": ...})`` fuses two classes into one worker: each rank's
  process builds one Actor and one Critic (on GPUs they would share one CUDA caching allocator);
- ``wg.spawn({"actor", "critic"})`` gives one view per role. A view exposes only its own role's
  methods (the critic view has no ``update_policy``), with the role's dispatch modes;
- both views run in the same processes (same ``os.getpid()`` per rank), and a role's state lives
  next to the other's, while two ordinary groups get processes of their own;
- shutting down the fused group (the ``with`` block) stops the processes of every view.

Needs torch: ``pip install "spmdcall[torch]"``.

Run it:

    python examples/colocation.py [--backend process|inline|ray]
"""

from __future__ import annotations

import argparse
import os

import torch

import spmdcall as sc
from spmdcall.data import DataProto


class Actor(sc.Worker):
    def __init__(self, lr: float):
        self.lr = lr
        self.weight = torch.ones(3)

    def where(self) -> tuple[int, int]:
        return self.rank, os.getpid()

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_METRIC)
    def update_policy(self, batch: DataProto) -> dict:
        advantages = batch.batch["advantages"]
        self.weight += self.lr * advantages.mean()
        return {"rank": self.rank, "num_rows": len(batch), "weight": self.weight[0].item()}


class Critic(sc.Worker):
    def __init__(self, gamma: float):
        self.gamma = gamma

    def where(self) -> tuple[int, int]:
        return self.rank, os.getpid()

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def compute_advantages(self, batch: DataProto) -> DataProto:
        rewards = batch.batch["rewards"]
        return DataProto.from_dict({"advantages": rewards - self.gamma * rewards.mean()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="process", help="process (default), inline or ray")
    args = parser.parse_args()

    pool = sc.ResourcePool([2], max_colocate_count=2)
    actor_cls = sc.ClassWithInitArgs(Actor, lr=0.5)
    critic_cls = sc.ClassWithInitArgs(Critic, gamma=0.5)

    # One group of fused workers: each of the 2 processes holds an Actor and a Critic.
    with sc.WorkerGroup(
        pool, sc.colocate({"actor": actor_cls, "critic": critic_cls}), backend=args.backend
    ) as fused:
        views = fused.spawn({"actor", "critic"})
        actor, critic = views["actor"], views["critic"]
        print(f"actor view methods:  {actor.method_names()}")
        print(f"critic view methods: {critic.method_names()}")
        assert "update_policy" in actor.method_names() and "update_policy" not in critic.method_names()
        assert not hasattr(critic, "update_policy")

        actor_where, critic_where = actor.where(), critic.where()
        print(f"actor  (rank, pid): {actor_where}")
        print(f"critic (rank, pid): {critic_where}")
        assert actor_where == critic_where, "colocated roles must share each rank's process"

        batch = DataProto.from_dict({"rewards": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])})
        advantages = critic.compute_advantages(batch)  # critic role, data-parallel
        metrics = actor.update_policy(advantages)  # actor role, same processes
        print(f"update_policy -> {metrics}")
        assert [m["num_rows"] for m in metrics] == [3, 3]
        assert all(abs(m["weight"] - (1 + 0.5 / 3)) < 1e-6 for m in metrics), metrics

    # The other option: two ordinary groups, each with processes of its own (on GPUs they would
    # share the devices as separate processes, which max_colocate_count=2 allows).
    with (
        sc.WorkerGroup(pool, actor_cls, backend=args.backend) as actor,
        sc.WorkerGroup(pool, critic_cls, backend=args.backend) as critic,
    ):
        actor_pids = [pid for _, pid in actor.where()]
        critic_pids = [pid for _, pid in critic.where()]
        print(f"separate groups: actor pids {actor_pids}, critic pids {critic_pids}")
        if args.backend != "inline":  # inline ranks all live in this one process
            assert not set(actor_pids) & set(critic_pids), "separate groups must not share processes"

    print("colocation: OK")


if __name__ == "__main__":
    main()
