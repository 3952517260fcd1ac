"""Policy losses and their registry: PPO's clipped surrogate, and any you register.

A policy loss takes the behaviour and current log-probs, the advantages and the response mask
(all (batch, response_len), the conventions of `rl_extension.algorithms`) plus the ``actor`` keys it
declares, and returns the loss (a scalar that carries the gradient) followed by the values of the
metrics it declares. It registers with one decorator, and ``actor.policy_loss`` accepts its name:

    from rl_extension.policy_losses import register_policy_loss

    @register_policy_loss("reinforce", config_keys=("loss_agg_mode",), metrics=("ppo_kl",))
    def reinforce(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean"):
        loss = agg_loss(-advantages * log_prob, response_mask, loss_agg_mode)
        return loss, masked_mean(old_log_prob - log_prob, response_mask).detach()

The actor logs each metric as ``actor/<name>``, beside ``actor/pg_loss``; the entropy bonus, the
KL loss and the supervised term are added to whatever loss is chosen.

torch is imported inside the losses rather than at the top: the config reads this registry to check
``actor.policy_loss`` before torch loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl_extension.config.roles import ActorConfig

if TYPE_CHECKING:
    import torch

__all__ = ["POLICY_LOSSES", "PolicyLoss", "compute_policy_loss", "get_policy_loss", "register_policy_loss"]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss and what it declares."""

    name: str
    """What ``actor.policy_loss`` says to pick it."""
    fn: Callable[..., tuple[torch.Tensor, ...]]
    """(old_log_prob, log_prob, advantages, response_mask, **config_keys) -> (loss, *metrics)."""
    config_keys: tuple[str, ...] = ()
    """The ``actor`` keys it takes, by parameter name (e.g. clip_ratio_low)."""
    metrics: tuple[str, ...] = ()
    """Names of the values it returns after the loss, logged as ``actor/<name>``."""

    def __call__(
        self,
        config: ActorConfig,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and its metrics by name, with the declared ``actor`` keys taken from ``config``."""
        loss, *values = self.fn(
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            **{key: getattr(config, key) for key in self.config_keys},
        )
        return loss, dict(zip(self.metrics, values, strict=True))


POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""The registry: name -> policy loss. ``@register_policy_loss`` adds to it."""


def register_policy_loss(
    name: str, *, config_keys: tuple[str, ...] = (), metrics: tuple[str, ...] = ()
) -> Callable[[Callable], Callable]:
    """Register a policy loss under ``name``; ``actor.policy_loss=name`` then uses it.

    Registering a name again replaces the earlier loss.

    Args:
        name: the loss's name in the config.
        config_keys: the ``actor`` keys it takes, by parameter name.
        metrics: names of the values it returns after the loss (logged as ``actor/<name>``).

    Returns:
        A decorator that registers the function and returns it unchanged.

    Raises:
        ValueError: a key that is not an ``actor`` key.

    Example:
        >>> @register_policy_loss("plain_pg")
        ... def plain_pg(old_log_prob, log_prob, advantages, response_mask):
        ...     return (-advantages * log_prob * response_mask).sum() / response_mask.sum()
        >>> get_policy_loss("plain_pg").metrics
        ()
    """
    unknown = sorted(set(config_keys) - {f.name for f in dataclasses.fields(ActorConfig)})
    if unknown:
        raise ValueError(f"policy loss {name!r}: {unknown} are not keys of the actor section")

    def decorator(fn: Callable) -> Callable:
        POLICY_LOSSES[name] = PolicyLoss(name, fn, tuple(config_keys), tuple(metrics))
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    """Look up a registered policy loss by name.

    Raises:
        ValueError: unknown name, naming the registered ones.

    Example:
        >>> get_policy_loss("ppo").fn is compute_policy_loss
        True
    """
    try:
        return POLICY_LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown policy loss {name!r}; expected one of {sorted(POLICY_LOSSES)}") from None


@register_policy_loss(
    "ppo",
    config_keys=("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode"),
    metrics=("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"),
)
def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate loss with dual clip (Ye et al. 2020).

    rho = exp(log_prob - old_log_prob)
    L_clip = max(-A rho, -A clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high))
    L = min(L_clip, -A clip_ratio_c) where A < 0 (dual clip: a huge ratio on a bad token cannot
        blow up the loss), L = L_clip where A >= 0; aggregated with `agg_loss`.

    Args:
        old_log_prob: (batch, response_len) log-probs of the behaviour policy.
        log_prob: (batch, response_len) log-probs of the current policy (carries the gradient).
        advantages: (batch, response_len).
        response_mask: (batch, response_len); nonzero on real response tokens.
        clip_ratio_low: lower clip epsilon.
        clip_ratio_high: upper clip epsilon (set above `clip_ratio_low` for clip-higher / DAPO).
        clip_ratio_c: dual-clip bound, must be > 1.
        loss_agg_mode: see `agg_loss`.

    Returns:
        (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower), all scalars: the fractions of valid tokens
        where the ratio clip and the dual clip were active, ppo_kl = masked mean of (old - new log-prob).

    Example:
        >>> lp = torch.zeros(1, 2); adv = torch.tensor([[1.0, -1.0]])
        >>> compute_policy_loss(lp, lp, adv, torch.ones(1, 2))[0]
        tensor(0.)
    """
    import torch

    from rl_extension.algorithms import agg_loss, masked_mean, valid_mask

    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for the dual clip, got {clip_ratio_c}")
    valid = valid_mask(response_mask)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    log_ratio = torch.where(valid, log_prob - old_log_prob, zero)
    advantages = torch.where(valid, advantages, zero)
    # Clamped so exp stays finite; a log-ratio of 20 is already far past any clip range.
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    ppo_kl = masked_mean(-log_ratio, response_mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(log_prob.dtype), response_mask)
    loss_dual_bound = -advantages * clip_ratio_c
    dual_active = (advantages < 0) & (loss_ppo > loss_dual_bound)
    pg_losses = torch.where(dual_active, loss_dual_bound, loss_ppo)
    pg_clipfrac_lower = masked_mean(dual_active.to(log_prob.dtype), response_mask)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl.detach(), pg_clipfrac_lower
