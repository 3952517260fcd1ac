"""The worker groups of a run: which roles share a pool, starting them, and stopping them.

By default one pool of ``trainer.num_workers`` processes holds the actor, the rollout and the
reference, fused with ``sc.colocate``; the critic and the reward model join that pool or get pools
of their own (``critic.placement``, ``reward.placement``). With ``trainer.mode=async`` the rollout
gets a pool of its own (``trainer.rollout_workers`` processes), so it can generate while the actor
trains; it then takes weights through ``load_weights``, not from a colocated actor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import spmdcall as sc
from rl_extension.algorithms.policy_losses import get_policy_loss
from rl_extension.config import PPOConfig
from rl_extension.roles.actor import Actor
from rl_extension.roles.critic import Critic
from rl_extension.roles.ref import Reference
from rl_extension.roles.reward_model import RewardModel
from rl_extension.roles.rollout import ROLLOUTS

__all__ = ["Roles", "build_roles"]


@dataclass
class Roles:
    """The group (or colocated view) playing each role; None for roles this run does not use."""

    actor: sc.WorkerGroup
    rollout: sc.WorkerGroup
    ref: sc.WorkerGroup | None = None
    critic: sc.WorkerGroup | None = None
    reward_model: sc.WorkerGroup | None = None
    groups: list[sc.WorkerGroup] = field(default_factory=list)

    def stateful(self) -> dict[str, sc.WorkerGroup]:
        """Roles with state to checkpoint, in load order (the rollout's weights come from the actor)."""
        roles = {"actor": self.actor, "rollout": self.rollout, "critic": self.critic}
        return {name: group for name, group in roles.items() if group is not None}

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()


# A role that gets a pool of its own: its class with init args, and its number of workers (0: trainer.num_workers).
Separate = dict[str, tuple[sc.ClassWithInitArgs, int]]


def build_roles(config: PPOConfig, model_path: str, tokenizer_path: str) -> Roles:
    """Start the worker groups: actor + rollout (+ reference) colocated on one pool; critic and reward model
    colocated with them or on pools of their own, as configured."""
    colocated, separate = _role_classes(config, model_path, tokenizer_path)
    t = config.trainer
    groups = []
    try:
        main = sc.WorkerGroup(
            sc.ResourcePool([t.num_workers], use_gpu=t.use_gpu),
            sc.colocate(colocated),
            backend=t.backend,
            name="_".join(colocated),
            default_timeout=t.call_timeout_s,
        )
        groups.append(main)
        views = main.spawn(set(colocated))
        for name, (cls_with_init, num_workers) in separate.items():
            group = sc.WorkerGroup(
                sc.ResourcePool([num_workers or t.num_workers], use_gpu=t.use_gpu),
                cls_with_init,
                backend=t.backend,
                name=name,
                default_timeout=t.call_timeout_s,
            )
            groups.append(group)
            views[name] = group
    except BaseException:
        for group in groups:
            group.shutdown()
        raise
    return Roles(groups=groups, **views)


def _role_classes(
    config: PPOConfig, model_path: str, tokenizer_path: str
) -> tuple[dict[str, sc.ClassWithInitArgs], Separate]:
    """Each role the run uses with its init args: those on the main pool, and those with pools of their own."""
    t = config.trainer
    common = {"threads": _threads_per_worker(config), "use_gpu": t.use_gpu}
    steps = {"total_steps": t.total_steps, "seed": t.seed, **common}
    colocated = {
        "actor": sc.ClassWithInitArgs(
            Actor,
            config.model,
            config.actor,
            model_path=model_path,
            policy_loss=get_policy_loss(config.actor.policy_loss),
            **steps,
            num_mini_batches=config.num_actor_mini_batches,
        ),
    }
    rollout = sc.ClassWithInitArgs(
        ROLLOUTS[config.rollout.name],
        config.model,
        config.rollout,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        seed=t.seed,
        **common,
    )
    separate: Separate = {}
    placement = "separate" if t.mode == "async" else "colocated"  # async: generates while the actor trains
    _place(colocated, separate, "rollout", rollout, placement, t.rollout_workers)
    if config.use_reference:
        colocated["ref"] = sc.ClassWithInitArgs(
            Reference, config.model, config.ref, model_path=config.ref.path or model_path, **common
        )
    if config.use_critic:
        critic = sc.ClassWithInitArgs(
            Critic,
            config.model,
            config.critic,
            model_path=config.critic.path or model_path,
            **steps,
            num_mini_batches=config.data.train_batch_size // config.critic.ppo_mini_batch_size,
        )
        _place(colocated, separate, "critic", critic, config.critic.placement, config.critic.num_workers)
    if config.use_reward_model:
        reward_model = sc.ClassWithInitArgs(RewardModel, config.model, config.reward, **common)
        _place(
            colocated,
            separate,
            "reward_model",
            reward_model,
            config.reward.placement,
            config.reward.num_workers,
        )
    return colocated, separate


def _threads_per_worker(config: PPOConfig) -> int:
    """trainer.threads_per_worker; with 0 in async mode, the cores shared by the processes of the actor's
    pool and of the rollout's, which compute at the same time (0 lets each worker divide the cores
    among its own pool: right when one pool computes at a time)."""
    t = config.trainer
    if t.threads_per_worker or t.mode != "async" or t.use_gpu:
        return t.threads_per_worker
    return max(1, (os.cpu_count() or 1) // (t.num_workers + (t.rollout_workers or t.num_workers)))


def _place(
    colocated: dict[str, sc.ClassWithInitArgs],
    separate: Separate,
    name: str,
    cls_with_init: sc.ClassWithInitArgs,
    placement: str,
    num_workers: int,
) -> None:
    if placement == "colocated":
        colocated[name] = cls_with_init
    else:
        separate[name] = (cls_with_init, num_workers)
