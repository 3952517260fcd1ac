"""Advantage estimators and their registry: GAE, GRPO, RLOO, REINFORCE++, and any you register.

An estimator turns the scored batch into ``(advantages, returns)``, both (batch, response_len) and
zero outside the response mask (the conventions of `rl_extension.algorithms.core`). It registers with one
decorator that declares what it needs, and ``algorithm.adv_estimator`` accepts its name:

    from rl_extension.algorithms.advantages import register_adv_estimator

    @register_adv_estimator(
        "grpo_no_eps",
        inputs=("token_level_rewards", "response_mask", "index"),  # the batch tensors it takes
        config_keys=("norm_adv_by_std_in_grpo",),                 # algorithm.* keys it takes
        needs_groups=True,                                        # compares a prompt's samples
    )
    def grpo_no_eps(token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=True):
        return compute_grpo_outcome_advantage(
            token_level_rewards, response_mask, index, 0.0, norm_adv_by_std_in_grpo
        )

The trainer passes the declared inputs and keys by name; an estimator whose inputs include
``values`` gets a critic (``PPOConfig.use_critic``), and one that ``needs_groups`` gets the checks
and filters of group advantages (``rollout.n >= 2``, ``algorithm.drop_uniform_groups``, ...).

torch is imported inside the estimators rather than at the top: the config reads this registry to
check ``algorithm.adv_estimator`` (and the CLI reports a bad name) before torch loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rl_extension.config.algorithm import AlgorithmConfig
from rl_extension.registry import Registry

if TYPE_CHECKING:
    import numpy as np
    import torch

    from rl_extension.algorithms.kl import KLController
    from spmdcall.data import DataProto

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_INPUTS",
    "AdvantageEstimator",
    "compute_advantages",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "get_advantage_estimator",
    "register_adv_estimator",
]

ADVANTAGE_INPUTS = ("token_level_rewards", "values", "response_mask", "index")
"""What the trainer can pass an estimator: the token rewards (scores minus any in-reward KL
penalty), the critic's values, the response mask, and the rows' group ids (prompt uids)."""


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator and what it declares it needs."""

    name: str
    """What ``algorithm.adv_estimator`` says to pick it."""
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """The function: the declared inputs and config keys by name -> (advantages, returns)."""
    inputs: tuple[str, ...]
    """The batch tensors it takes, by parameter name (some of ``ADVANTAGE_INPUTS``)."""
    config_keys: tuple[str, ...] = ()
    """The ``algorithm`` keys it takes, by parameter name (e.g. gamma, lam)."""
    needs_groups: bool = False
    """It compares the samples of one prompt (rows sharing an ``index``): it needs rollout.n >= 2."""
    display_name: str = ""
    """How the CLI's demo names the RL stage (GRPO, PPO)."""

    @property
    def needs_critic(self) -> bool:
        """Whether it takes the critic's values (the run then trains a critic)."""
        return "values" in self.inputs

    def __call__(
        self, inputs: Mapping[str, Any], config: AlgorithmConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(advantages, returns)`` from the batch tensors in ``inputs`` and the ``algorithm`` section."""
        return self.fn(
            **{key: inputs[key] for key in self.inputs},
            **{key: getattr(config, key) for key in self.config_keys},
        )


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
"""The registry: name -> estimator. ``@register_adv_estimator`` adds to it."""


def register_adv_estimator(
    name: str,
    *,
    inputs: tuple[str, ...],
    config_keys: tuple[str, ...] = (),
    needs_groups: bool = False,
    display_name: str = "",
) -> Callable[[Callable], Callable]:
    """Register an advantage estimator under ``name``; ``algorithm.adv_estimator=name`` then uses it.

    Registering a name again replaces the earlier estimator.

    Args:
        name: the estimator's name in the config.
        inputs: the batch tensors it takes, by parameter name, from ``ADVANTAGE_INPUTS``;
            ``values`` makes the run train a critic.
        config_keys: the ``algorithm`` keys it takes, by parameter name (e.g. ``("gamma",)``).
        needs_groups: it compares the samples of one prompt (needs ``rollout.n >= 2``; makes
            algorithm.drop_uniform_groups, dynamic_sampling and guide_failed_groups available).
        display_name: how the demo names the RL stage (default: ``name`` in upper case).

    Returns:
        A decorator that registers the function and returns it unchanged.

    Raises:
        ValueError: an input outside ``ADVANTAGE_INPUTS`` or a key that is not an ``algorithm`` key.

    Example:
        >>> @register_adv_estimator("sign", inputs=("token_level_rewards", "response_mask"))
        ... def sign(token_level_rewards, response_mask):
        ...     adv = token_level_rewards.sum(-1, keepdim=True).sign() * response_mask
        ...     return adv, adv
        >>> get_advantage_estimator("sign").needs_critic
        False
    """
    unknown_inputs = sorted(set(inputs) - set(ADVANTAGE_INPUTS))
    if unknown_inputs:
        raise ValueError(
            f"estimator {name!r}: unknown inputs {unknown_inputs}; expected some of {ADVANTAGE_INPUTS}"
        )
    unknown_keys = sorted(set(config_keys) - {f.name for f in dataclasses.fields(AlgorithmConfig)})
    if unknown_keys:
        raise ValueError(f"estimator {name!r}: {unknown_keys} are not keys of the algorithm section")

    def decorator(fn: Callable) -> Callable:
        ADVANTAGE_ESTIMATORS.register(
            AdvantageEstimator(
                name, fn, tuple(inputs), tuple(config_keys), needs_groups, display_name or name.upper()
            ),
            name,
        )
        return fn

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """Look up a registered advantage estimator by name.

    Args:
        name: a key of `ADVANTAGE_ESTIMATORS` ("gae", "grpo", "rloo", "reinforce_plus_plus", or one
            registered with ``register_adv_estimator``).

    Raises:
        ValueError: unknown name, naming the registered ones.

    Example:
        >>> get_advantage_estimator("grpo").fn is compute_grpo_outcome_advantage
        True
    """
    return ADVANTAGE_ESTIMATORS.lookup(name)


def compute_advantages(batch: DataProto, config: AlgorithmConfig, kl_ctrl: KLController) -> dict[str, float]:
    """A step's advantages, in place: the token rewards (``token_level_scores``, less the KL penalty
    with algorithm.use_kl_in_reward), then ``advantages`` and ``returns`` from algorithm.adv_estimator.
    Returns their means and the gaps between the log-probs the batch holds (actor to reference, sampler
    to actor).

    Args:
        batch: a scored step: ``token_level_scores``, ``response_mask``, the ``uid`` column, and
            ``old_log_prob``, ``ref_log_prob``, ``values``, ``rollout_log_prob`` where the run has them.
        config: the run's algorithm section.
        kl_ctrl: the KL coefficient's controller (updated by the in-reward penalty).
    """
    import torch

    from rl_extension.algorithms.core import masked_mean
    from rl_extension.algorithms.kl import apply_kl_penalty

    data, metrics = batch.batch, {}
    mask, rewards = data["response_mask"], data["token_level_scores"]
    if config.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_penalty(
            rewards, data["old_log_prob"], data["ref_log_prob"], mask, kl_ctrl, config.kl_penalty
        )
        metrics |= kl_metrics
    if "ref_log_prob" in data.keys() and "old_log_prob" in data.keys():
        metrics["actor/ref_kl"] = masked_mean(data["old_log_prob"] - data["ref_log_prob"], mask).item()
    if "rollout_log_prob" in data.keys() and "old_log_prob" in data.keys():
        # How far the sampler's log-probs are from the trainer's (0 up to numerics for the HF rollout).
        gap = (data["rollout_log_prob"] - data["old_log_prob"]).abs()
        sampled = mask  # the guided responses were written, not sampled
        if "guided" in batch.non_tensor_batch:
            sampled = mask * torch.as_tensor(~batch.non_tensor_batch["guided"]).unsqueeze(-1)
        metrics["rollout/log_prob_gap_mean"] = masked_mean(gap, sampled).item()
    data["token_level_rewards"] = rewards
    inputs = {"token_level_rewards": rewards, "response_mask": mask, "index": batch.non_tensor_batch["uid"]}
    if "values" in data.keys():
        inputs["values"] = data["values"]
    advantages, returns = get_advantage_estimator(config.adv_estimator)(inputs, config)
    data["advantages"], data["returns"] = advantages, returns
    metrics["adv/mean"] = masked_mean(advantages, mask).item()
    metrics["adv/returns_mean"] = masked_mean(returns, mask).item()
    if "values" in data.keys():
        metrics["critic/values_mean"] = masked_mean(data["values"], mask).item()
    return metrics


# --- The built-in estimators


@register_adv_estimator(
    "gae",
    inputs=("token_level_rewards", "values", "response_mask"),
    config_keys=("gamma", "lam"),
    display_name="PPO",
)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) over the valid tokens.

    Walking backwards over valid tokens t with next valid token t' (value 0 past the last one):
        delta_t = r_t + gamma * V_t' - V_t
        A_t     = delta_t + gamma * lam * A_t'
    A masked position is skipped: it passes the next value and advantage through unchanged, so a
    gap inside a response (e.g. tool output in a multi-turn rollout) does not cut the recursion.

    returns = A + V (unwhitened); advantages = masked_whiten(A) over the whole batch.

    Args:
        token_level_rewards: (batch, response_len) rewards r_t.
        values: (batch, response_len) critic values V_t.
        response_mask: (batch, response_len); nonzero on real response tokens.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        (advantages, returns), both (batch, response_len), zero outside the mask.

    Example:
        >>> r = torch.tensor([[0.0, 0.0, 1.0]]); v = torch.tensor([[0.5, 0.6, 0.7]])
        >>> adv, ret = compute_gae_advantage_return(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)
        >>> ret
        tensor([[1., 1., 1.]])
    """
    import torch

    from rl_extension.algorithms.core import masked_whiten, valid_mask

    valid = valid_mask(response_mask)
    with torch.no_grad():
        zeros = torch.zeros_like(values)
        rewards = torch.where(valid, token_level_rewards, zeros)
        values = torch.where(valid, values, zeros)
        next_value = torch.zeros_like(values[:, 0])
        next_advantage = torch.zeros_like(values[:, 0])
        advantages_reversed = []
        for t in reversed(range(values.shape[-1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            advantage = delta + gamma * lam * next_advantage
            next_value = torch.where(valid[:, t], values[:, t], next_value)
            next_advantage = torch.where(valid[:, t], advantage, next_advantage)
            advantages_reversed.append(next_advantage)
        advantages = torch.stack(advantages_reversed[::-1], dim=-1)
        returns = torch.where(valid, advantages + values, zeros)
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_adv_estimator(
    "grpo",
    inputs=("token_level_rewards", "response_mask", "index"),
    config_keys=("norm_adv_by_std_in_grpo",),
    needs_groups=True,
)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024): a score normalised within its prompt group.

    s_i = sum_t r_{i,t} (valid tokens);  A_i = (s_i - mean_g) / (std_g + epsilon)  for i in group g,
    or A_i = s_i - mean_g without std normalisation (Dr. GRPO). std_g is the unbiased standard
    deviation. A group of one sample gets mean 0 and std 1. A_i is copied to every valid token
    of row i; returns equal the advantages.

    Args:
        token_level_rewards: (batch, response_len); the score on the last response token.
        response_mask: (batch, response_len); nonzero on real response tokens.
        index: (batch,) numpy array of group ids (prompt uids).
        epsilon: added to the group std.
        norm_adv_by_std_in_grpo: divide by the group std.

    Returns:
        (advantages, returns), both (batch, response_len), zero outside the mask.

    Example:
        >>> r = torch.tensor([[1.0], [0.0]])
        >>> adv, _ = compute_grpo_outcome_advantage(r, torch.ones(2, 1), np.array(["a", "a"]))
        >>> adv[:, 0]  # (+-0.5) / sqrt(0.5)
        tensor([ 0.7071, -0.7071])
    """
    import torch

    from rl_extension.algorithms.core import group_ids, masked_sum

    with torch.no_grad():
        scores = masked_sum(token_level_rewards, response_mask, dim=-1)
        ids = group_ids(index, scores.shape[0], scores.device)
        sums, counts = _group_sums(scores, ids)
        mean = sums / counts
        sq_dev, _ = _group_sums((scores - mean[ids]) ** 2, ids)
        std = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))
        singleton = counts < 2
        mean = torch.where(singleton, torch.zeros_like(mean), mean)
        std = torch.where(singleton, torch.ones_like(std), std)
        scores = scores - mean[ids]
        if norm_adv_by_std_in_grpo:
            scores = scores / (std[ids] + epsilon)
        return _broadcast_to_tokens(scores, response_mask)


@register_adv_estimator("rloo", inputs=("token_level_rewards", "response_mask", "index"), needs_groups=True)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO advantage (Ahmadian et al. 2024): the score minus the mean of the group's others.

    s_i = sum_t r_{i,t};  A_i = s_i - (sum_{j in g, j != i} s_j) / (n_g - 1), baseline 0 when
    n_g = 1. A_i is copied to every valid token of row i; returns equal the advantages.

    Args:
        token_level_rewards: (batch, response_len); the score on the last response token.
        response_mask: (batch, response_len); nonzero on real response tokens.
        index: (batch,) numpy array of group ids (prompt uids).

    Returns:
        (advantages, returns), both (batch, response_len), zero outside the mask.

    Example:
        >>> r = torch.tensor([[1.0], [0.0]])
        >>> compute_rloo_outcome_advantage(r, torch.ones(2, 1), np.array(["a", "a"]))[0][:, 0]
        tensor([ 1., -1.])
    """
    import torch

    from rl_extension.algorithms.core import group_ids, masked_sum

    with torch.no_grad():
        scores = masked_sum(token_level_rewards, response_mask, dim=-1)
        ids = group_ids(index, scores.shape[0], scores.device)
        sums, counts = _group_sums(scores, ids)
        others = counts[ids] - 1
        baseline = torch.where(
            others > 0, (sums[ids] - scores) / others.clamp(min=1), torch.zeros_like(scores)
        )
        return _broadcast_to_tokens(scores - baseline, response_mask)


@register_adv_estimator(
    "reinforce_plus_plus",
    inputs=("token_level_rewards", "response_mask"),
    config_keys=("gamma",),
    display_name="REINFORCE++",
)
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): whitened discounted return-to-go, no critic.

    G_t = r_t + gamma * G_t' over valid tokens (t' the next valid token, G = 0 past the last);
    masked positions pass G through. returns = G; advantages = masked_whiten(G) over the batch.

    Args:
        token_level_rewards: (batch, response_len); per-token rewards (score and any KL penalty).
        response_mask: (batch, response_len); nonzero on real response tokens.
        gamma: discount factor.

    Returns:
        (advantages, returns), both (batch, response_len), zero outside the mask.

    Example:
        >>> r = torch.tensor([[0.0, 0.0, 1.0]])
        >>> compute_reinforce_plus_plus_outcome_advantage(r, torch.ones(1, 3), gamma=0.5)[1]
        tensor([[0.2500, 0.5000, 1.0000]])
    """
    import torch

    from rl_extension.algorithms.core import masked_whiten, valid_mask

    valid = valid_mask(response_mask)
    with torch.no_grad():
        rewards = torch.where(valid, token_level_rewards, torch.zeros_like(token_level_rewards))
        running = torch.zeros_like(rewards[:, 0])
        returns_reversed = []
        for t in reversed(range(rewards.shape[-1])):
            running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
            returns_reversed.append(running)
        returns = torch.where(valid, torch.stack(returns_reversed[::-1], dim=-1), 0.0)
        advantages = masked_whiten(returns, response_mask)
    return advantages, returns


def _group_sums(scores: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group sum of `scores` and per-group size, both (num_groups,)."""
    import torch

    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    sums = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    sums.index_add_(0, ids, scores)
    counts = torch.bincount(ids, minlength=num_groups).to(scores.dtype)
    return sums, counts


def _broadcast_to_tokens(
    scores: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spread one value per sequence over its valid tokens; returns (advantages, returns)."""
    import torch

    from rl_extension.algorithms.core import valid_mask

    per_token = torch.where(
        valid_mask(response_mask),
        scores.unsqueeze(-1),
        torch.zeros((), dtype=scores.dtype, device=scores.device),
    )
    return per_token, per_token.clone()
