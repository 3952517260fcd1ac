"""``PPOConfig``: every section of a PPO/GRPO run, and the rules between sections."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rl_extension.config.algorithm import AlgorithmConfig
from rl_extension.config.data import DataConfig
from rl_extension.config.model import ModelConfig
from rl_extension.config.roles import ActorConfig, CriticConfig, RefConfig, RewardConfig, RolloutConfig
from rl_extension.config.schema import Section, warn_if_changed
from rl_extension.config.trainer import TrainerConfig, ranks_in_controller
from rl_extension.user_code import import_modules

if TYPE_CHECKING:
    from rl_extension.algorithms.advantages import AdvantageEstimator

__all__ = ["PPOConfig"]


@dataclass(kw_only=True)
class PPOConfig(Section):
    """Everything a PPO/GRPO run needs, one section per component."""

    imports: list[str] = field(default_factory=list)
    """Your modules, imported before the config is checked: dotted names importable from sys.path, or paths of .py files. What they register (an advantage estimator, a policy loss, a scorer, a tool-call format, a tool) can then be named in this config (docs/rl/custom_reward_and_data.md)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and batching."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy training."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response sampling."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (gae only)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and the in-reward KL penalty."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The run."""

    @property
    def use_critic(self) -> bool:
        """Whether the advantage estimator takes the critic's values (gae)."""
        return self._estimator.needs_critic

    @property
    def has_groups(self) -> bool:
        """Whether each prompt is sampled more than once (rollout.n >= 2), so its samples form a group."""
        return self.rollout.n >= 2

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def use_reward_model(self) -> bool:
        return bool(self.reward.model_path)

    @property
    def num_actor_mini_batches(self) -> int:
        """Optimizer steps per pass over a step's batch (train_batch_size / ppo_mini_batch_size)."""
        return self.data.train_batch_size // self.actor.ppo_mini_batch_size

    @property
    def compute_old_log_prob(self) -> bool:
        """Whether old_log_prob needs its own forward pass before the update (see actor.always_compute_old_log_prob)."""
        one_mini_batch = self.data.train_batch_size == self.actor.ppo_mini_batch_size
        return self.actor.always_compute_old_log_prob or not one_mini_batch or self.algorithm.use_kl_in_reward

    def validate(self) -> None:
        """Raise ValueError naming the key of a value outside its declared range or at odds with others;
        warn about values that will be ignored. The modules of ``imports`` are imported first, so
        the names they register pass."""
        import_modules(self.imports)
        self.check()  # every section checks its own keys
        self._check_between_sections()
        self._warn_ignored()

    def _check_between_sections(self) -> None:
        t, r, algorithm = self.trainer, self.rollout, self.algorithm
        self._check_mini_batches("actor", self.actor.ppo_mini_batch_size, t.num_workers)
        if self.use_critic:
            c = self.critic
            critic_workers = c.num_workers if c.placement == "separate" and c.num_workers else t.num_workers
            self._check_mini_batches("critic", c.ppo_mini_batch_size, critic_workers)
        group_advantages = self._estimator.needs_groups and self.has_groups
        for key in ("drop_uniform_groups", "dynamic_sampling", "guide_failed_groups"):
            if getattr(algorithm, key) and not group_advantages:
                raise ValueError(
                    f"algorithm.{key} needs group advantages (an algorithm.adv_estimator that compares "
                    f"a prompt's samples, such as grpo or rloo, and rollout.n >= 2), got "
                    f"adv_estimator={algorithm.adv_estimator}, rollout.n={r.n}"
                )
        for key, on in (
            ("algorithm.guide_failed_groups", algorithm.guide_failed_groups),
            ("actor.sft_loss_coef", self.actor.sft_loss_coef > 0),
        ):
            if on and r.multi_turn.enable and not self.data.demonstration_key:
                raise ValueError(
                    f"{key} with rollout.multi_turn.enable=true needs "
                    "data.demonstration_key: a column of whole demonstration trajectories"
                )
        if t.mode == "async" and algorithm.dynamic_sampling:
            raise ValueError(
                "algorithm.dynamic_sampling=true is not supported with trainer.mode=async: the rollout "
                "produces one batch of prompts per step; use trainer.mode=sync for it"
            )
        correction = f"actor.off_policy_correction={self.actor.off_policy_correction}"
        if self.actor.off_policy_correction != "none" and not r.compute_log_probs:
            raise ValueError(
                f"{correction} needs rollout.compute_log_probs=true (the behaviour policy's log-probs)"
            )
        if self.actor.off_policy_correction != "none" and algorithm.guide_failed_groups:
            raise ValueError(
                f"{correction} with algorithm.guide_failed_groups=true: guided responses are written, "
                "not sampled, so no behaviour log-probs exist for them"
            )
        if not self.use_reward_model and self.reward.rule_weight == 0:
            raise ValueError(
                "reward.rule_weight=0 and no reward.model_path: nothing would score the responses"
            )

    def _check_mini_batches(self, role: str, mini_batch_size: int, num_workers: int) -> None:
        """A step's prompts fill whole mini-batches, and a mini-batch's rows split evenly over the workers."""
        batch_size, rows = self.data.train_batch_size, mini_batch_size * self.rollout.n
        if batch_size % mini_batch_size:
            raise ValueError(
                f"data.train_batch_size={batch_size} must be a multiple of "
                f"{role}.ppo_mini_batch_size={mini_batch_size}"
            )
        if rows % num_workers:
            raise ValueError(
                f"a mini-batch of {role}.ppo_mini_batch_size * rollout.n = {rows} rows does not split "
                f"evenly over the {role}'s {num_workers} workers"
            )

    def _warn_ignored(self) -> None:
        algorithm = self.algorithm
        if not self.use_critic:
            warn_if_changed(
                self.critic, "critic", f"algorithm.adv_estimator={algorithm.adv_estimator} trains no critic"
            )
        if not self.use_reference:
            warn_if_changed(
                self.ref, "ref", "neither actor.use_kl_loss nor algorithm.use_kl_in_reward is set"
            )
        if (
            not algorithm.dynamic_sampling
            and algorithm.max_sample_rounds != AlgorithmConfig().max_sample_rounds
        ):
            warnings.warn(
                "algorithm.max_sample_rounds is ignored without algorithm.dynamic_sampling", stacklevel=3
            )
        actor = self.actor
        if (
            actor.off_policy_correction == "none"
            and actor.importance_weight_cap != ActorConfig().importance_weight_cap
        ):
            warnings.warn(
                "actor.importance_weight_cap is ignored with actor.off_policy_correction=none", stacklevel=3
            )
        if self.trainer.max_restarts and ranks_in_controller(self.trainer.backend):
            warnings.warn(
                f"trainer.max_restarts is ignored on the {self.trainer.backend} backend: its ranks run in this process "
                "and cannot die or be restarted",
                stacklevel=3,
            )
        async_keys = (
            "max_staleness",
            "buffer_size",
            "rollout_workers",
            "rollout_workers_min",
            "rollout_workers_max",
            "rollout_chunks",
            "rollout_batches_in_flight",
            "weight_canary_atol",
            "rollout_max_replacements",
        )
        changed = [k for k in async_keys if getattr(self.trainer, k) != getattr(TrainerConfig(), k)]
        if self.trainer.mode == "sync" and changed:
            warnings.warn(f"trainer.mode=sync ignores trainer.{', trainer.'.join(changed)}", stacklevel=3)
        if self.trainer.rollout_chunks > 1 and self.rollout.multi_turn.enable:
            warnings.warn(
                "trainer.rollout_chunks is ignored with rollout.multi_turn.enable=true: new weights reach "
                "a trajectory from its next turn, and chunks would wait for each other's slowest trajectory",
                stacklevel=3,
            )
        if self._estimator.needs_groups and not self.has_groups:
            warnings.warn(
                f"{algorithm.adv_estimator} compares samples of the same prompt; with rollout.n=1 "
                "every advantage is 0 and nothing is learned",
                stacklevel=3,
            )

    @property
    def _estimator(self) -> AdvantageEstimator:
        # Imported here: rl_extension.algorithms.advantages imports the config package.
        from rl_extension.algorithms.advantages import get_advantage_estimator

        return get_advantage_estimator(self.algorithm.adv_estimator)
