"""Policy losses and their registry: PPO's clipped surrogate, and any you register.

A policy loss takes the behaviour and current log-probs, the advantages and the response mask
(all (batch, response_len), the conventions of `rl_extension.algorithms.core`) plus the ``actor`` keys it
declares, and returns the loss (a scalar that carries the gradient) followed by the values of the
metrics it declares. It registers with one decorator, and ``actor.policy_loss`` accepts its name:

    from rl_extension.algorithms.policy_losses import register_policy_loss

    @register_policy_loss("reinforce", config_keys=("loss_agg_mode",), metrics=("ppo_kl",))
    def reinforce(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean"):
        loss = agg_loss(-advantages * log_prob, response_mask, loss_agg_mode)
        return loss, masked_mean(old_log_prob - log_prob, response_mask).detach()

The actor logs each metric as ``actor/<name>``, beside ``actor/pg_loss``; the entropy bonus, the
KL loss and the supervised term are added to whatever loss is chosen.

A loss registered with ``takes_token_weights=True`` also takes ``token_weights`` (batch,
response_len), detached, that multiply each token's loss before aggregation: the off-policy
correction (``actor.off_policy_correction``, ``importance_weights``) passes its truncated
importance weights there.

torch is imported inside the losses rather than at the top: the config reads this registry to check
``actor.policy_loss`` before torch loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl_extension.config.roles import ActorConfig
from rl_extension.registry import Registry

if TYPE_CHECKING:
    import torch

__all__ = [
    "POLICY_LOSSES",
    "PolicyLoss",
    "compute_policy_loss",
    "get_policy_loss",
    "importance_weights",
    "policy_loss_with_correction",
    "register_policy_loss",
]


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
    takes_token_weights: bool = False
    """``fn`` takes ``token_weights=`` (per-token multipliers of its loss, for the off-policy correction)."""

    def __call__(
        self,
        config: ActorConfig,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        token_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and its metrics by name, with the declared ``actor`` keys taken from ``config``
        and ``token_weights``, if given, passed on (the loss must take them)."""
        kwargs = {key: getattr(config, key) for key in self.config_keys}
        if token_weights is not None:
            if not self.takes_token_weights:
                raise ValueError(f"policy loss {self.name!r} does not take token_weights")
            kwargs["token_weights"] = token_weights
        loss, *values = self.fn(old_log_prob, log_prob, advantages, response_mask, **kwargs)
        return loss, dict(zip(self.metrics, values, strict=True))


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
"""The registry: name -> policy loss. ``@register_policy_loss`` adds to it."""


def register_policy_loss(
    name: str,
    *,
    config_keys: tuple[str, ...] = (),
    metrics: tuple[str, ...] = (),
    takes_token_weights: bool = False,
) -> Callable[[Callable], Callable]:
    """Register a policy loss under ``name``; ``actor.policy_loss=name`` then uses it.

    Registering a name again replaces the earlier loss.

    Args:
        name: the loss's name in the config.
        config_keys: the ``actor`` keys it takes, by parameter name.
        metrics: names of the values it returns after the loss (logged as ``actor/<name>``).
        takes_token_weights: the function takes ``token_weights=`` (detached per-token multipliers of
            its loss, before aggregation), so ``actor.off_policy_correction=tis`` can use it.

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
        POLICY_LOSSES.register(
            PolicyLoss(name, fn, tuple(config_keys), tuple(metrics), takes_token_weights), name
        )
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
    return POLICY_LOSSES.lookup(name)


@register_policy_loss(
    "ppo",
    config_keys=("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode"),
    metrics=("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"),
    takes_token_weights=True,
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
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate loss with dual clip (Ye et al. 2020).

    rho = exp(log_prob - old_log_prob)
    L_clip = max(-A rho, -A clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high))
    L = min(L_clip, -A clip_ratio_c) where A < 0 (dual clip: a huge ratio on a bad token cannot
        blow up the loss), L = L_clip where A >= 0; times token_weights; aggregated with `agg_loss`.

    Args:
        old_log_prob: (batch, response_len) log-probs of the behaviour policy.
        log_prob: (batch, response_len) log-probs of the current policy (carries the gradient).
        advantages: (batch, response_len).
        response_mask: (batch, response_len); nonzero on real response tokens.
        clip_ratio_low: lower clip epsilon.
        clip_ratio_high: upper clip epsilon (set above `clip_ratio_low` for clip-higher / DAPO).
        clip_ratio_c: dual-clip bound, must be > 1.
        loss_agg_mode: see `agg_loss`.
        token_weights: (batch, response_len) detached multipliers of each token's loss, or None.

    Returns:
        (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower), all scalars: the fractions of valid tokens
        where the ratio clip and the dual clip were active, ppo_kl = masked mean of (old - new log-prob).

    Example:
        >>> lp = torch.zeros(1, 2); adv = torch.tensor([[1.0, -1.0]])
        >>> compute_policy_loss(lp, lp, adv, torch.ones(1, 2))[0]
        tensor(0.)
    """
    import torch

    from rl_extension.algorithms.core import agg_loss, masked_mean, valid_mask

    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for the dual clip, got {clip_ratio_c}")
    valid = valid_mask(response_mask)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    log_ratio = torch.where(valid, log_prob - old_log_prob, zero)
    advantages = torch.where(valid, advantages, zero)
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))  # finite; 20 is far past any clip range
    ppo_kl = masked_mean(-log_ratio, response_mask)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(log_prob.dtype), response_mask)
    dual_active = (advantages < 0) & (loss_ppo > -advantages * clip_ratio_c)
    pg_losses = torch.where(dual_active, -advantages * clip_ratio_c, loss_ppo)
    pg_clipfrac_lower = masked_mean(dual_active.to(log_prob.dtype), response_mask)
    weighted = pg_losses if token_weights is None else pg_losses * token_weights
    pg_loss = agg_loss(weighted, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl.detach(), pg_clipfrac_lower


def importance_weights(
    proximal_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor, response_mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights of the off-policy correction, and their metrics.

    w = min(exp(proximal_log_prob - behaviour_log_prob), cap) per token, detached, 0 off the mask:
    the policy the loss is anchored on (old_log_prob, recomputed by the actor) over the one that
    sampled (the rollout's ``rollout_log_prob``). ``actor.off_policy_correction=tis`` multiplies the
    policy loss by it; ``decoupled`` is the ppo loss's clip on pi/pi_prox weighted by it.

    Args:
        proximal_log_prob: (batch, response_len) log-probs of the proximal policy (old_log_prob).
        behaviour_log_prob: (batch, response_len) log-probs of the behaviour policy (rollout_log_prob).
        response_mask: (batch, response_len); nonzero on real response tokens.
        cap: the truncation C (actor.importance_weight_cap), > 0.

    Returns:
        (weights, metrics): metrics over the masked tokens, before the truncation: ``is_weight_mean``,
        ``is_weight_max`` and ``is_truncated_frac`` (the share of tokens whose weight exceeded ``cap``).

    Example:
        >>> w, m = importance_weights(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 2), cap=2.0)
        >>> w, float(m["is_truncated_frac"])
        (tensor([[1., 2.]]), 0.5)
    """
    import torch

    from rl_extension.algorithms.core import masked_mean, valid_mask

    if not cap > 0:
        raise ValueError(f"the importance weight cap must be > 0, got {cap}")
    valid = valid_mask(response_mask)
    zero = torch.zeros((), dtype=proximal_log_prob.dtype, device=proximal_log_prob.device)
    log_weight = torch.where(valid, proximal_log_prob.detach() - behaviour_log_prob.detach(), zero)
    raw = torch.exp(log_weight.clamp(max=20.0))  # finite; far past any sensible cap
    weights = torch.where(valid, raw.clamp(max=cap), zero)
    metrics = {
        "is_weight_mean": masked_mean(raw, response_mask),
        "is_weight_max": raw[valid].max() if bool(valid.any()) else zero,
        "is_truncated_frac": masked_mean((raw > cap).to(raw.dtype), response_mask),
    }
    return weights, metrics


def policy_loss_with_correction(
    policy_loss: PolicyLoss,
    config: ActorConfig,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_prob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``policy_loss`` with ``config.off_policy_correction`` applied: the loss and its metrics by name.

    none: the loss as registered. tis: each token's loss times ``importance_weights(old_log_prob,
    rollout_log_prob)``. decoupled (the ppo loss only, as ``ActorConfig.check`` enforces): the clip
    on pi/pi_prox with pi_prox = ``old_log_prob``, times the same weights. Since the actor's
    old_log_prob is the proximal policy, decoupled computes what tis on the ppo loss does; both
    equal the plain loss where the rollout sampled with the proximal policy (weights 1).

    Args:
        policy_loss, config, old_log_prob, log_prob, advantages, response_mask: as for ``PolicyLoss``.
        rollout_log_prob: (batch, response_len) the behaviour policy's log-probs; needed unless
            the correction is none.
    """
    correction = config.off_policy_correction
    if correction == "none":
        return policy_loss(config, old_log_prob, log_prob, advantages, response_mask)
    if rollout_log_prob is None:
        raise ValueError(
            f"actor.off_policy_correction={correction} needs rollout_log_prob "
            "(the rollout's sampling log-probs: rollout.compute_log_probs=true)"
        )
    if correction == "decoupled" and policy_loss.name != "ppo":
        raise ValueError(
            f"actor.off_policy_correction=decoupled needs the ppo loss, got {policy_loss.name!r}"
        )
    weights, is_metrics = importance_weights(
        old_log_prob, rollout_log_prob, response_mask, config.importance_weight_cap
    )
    loss, metrics = policy_loss(
        config, old_log_prob, log_prob, advantages, response_mask, token_weights=weights
    )
    return loss, metrics | is_metrics
