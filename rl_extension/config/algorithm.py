"""The ``algorithm`` section: advantage estimation and the KL penalty in the reward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rl_extension.config.ranges import Fraction, NonNegativeFloat, PositiveFloat, PositiveInt
from rl_extension.config.schema import Section, check_registered

__all__ = ["AlgorithmConfig", "KLControlConfig"]


@dataclass(kw_only=True)
class KLControlConfig(Section):
    """The coefficient of the in-reward KL penalty."""

    kind: Literal["fixed", "adaptive"] = "fixed"
    """fixed, or adaptive (driven towards target_kl)."""
    kl_coef: NonNegativeFloat = 0.001
    """The (initial) coefficient beta."""
    target_kl: PositiveFloat = 0.1
    """Target KL of the adaptive controller."""
    horizon: PositiveFloat = 10000.0
    """Samples over which the adaptive controller corrects its error."""


@dataclass(kw_only=True)
class AlgorithmConfig(Section):
    """Advantage estimation and the optional KL penalty in the reward (computed in the controller)."""

    adv_estimator: str = "grpo"
    """Advantage estimator: grpo, rloo, reinforce_plus_plus, gae (trains a critic), or one registered with @register_adv_estimator (rl_extension.algorithms.advantages)."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's std (false: Dr. GRPO)."""
    drop_uniform_groups: bool = False
    """GRPO/RLOO: leave the groups whose samples all scored alike out of the actor update. Their
    advantages are zero, so they only dilute the loss average and cost a forward and backward pass
    (their tokens also leave the entropy and KL-loss terms, and the logged actor/entropy). Groups are
    put back when too few remain to give every worker an equal share and a row per mini-batch."""
    dynamic_sampling: bool = False
    """GRPO/RLOO (DAPO's dynamic sampling): when groups whose samples all scored alike leave fewer than
    data.train_batch_size informative groups, sample further batches of prompts and fill the step's
    batch with their informative groups, at most max_sample_rounds batches a step (then uniform
    groups fill what is left). Every update then learns from a full batch of signal, for more
    generation a step. The reward/ metrics describe the first batch sampled, as without it."""
    max_sample_rounds: PositiveInt = 4
    """Dynamic sampling: prompt batches sampled at most in one step (the first included)."""
    guide_failed_groups: bool = False
    """GRPO/RLOO (off-policy guidance, as in LUFFY): in a group where no sample scored 1.0, one
    sample is replaced by the prompt's demonstration written as a response (its tokens, then eos),
    which is scored like any other. Such a group then teaches the model the answer it could not
    find, where otherwise it teaches nothing. The demonstration is data.demonstration_key's column,
    or else the ground truth (tasks whose ground truth is a whole response, as exact match grades
    it); with multi-turn rollouts it is a whole trajectory, whose tool results stay out of the
    response mask, and data.demonstration_key is required. One too long for rollout.max_new_tokens
    is left out."""
    gamma: Fraction = 1.0
    """Discount factor (gae, reinforce_plus_plus)."""
    lam: Fraction = 1.0
    """GAE lambda."""
    use_kl_in_reward: bool = False
    """Subtract beta * KL(policy || reference) from the token rewards; needs the reference model."""
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "kl"
    """KL estimator of the in-reward penalty."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient of the in-reward penalty."""

    def check(self, prefix: str = "") -> None:
        """Raise ValueError on an advantage estimator that is not registered."""
        super().check(prefix)
        from rl_extension.algorithms.advantages import get_advantage_estimator  # that module imports this one

        check_registered(f"{prefix}adv_estimator", self.adv_estimator, get_advantage_estimator)
