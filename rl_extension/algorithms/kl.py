"""KL between the policy and the reference model: per-token estimators, the reward penalty, and
the controllers that set its coefficient.

Token-level tensors are (batch, response_len) with a `response_mask` of the same shape, as in
`rl_extension.algorithms.core`.
"""

from __future__ import annotations

import warnings

import torch

from rl_extension.algorithms.core import masked_mean

__all__ = [
    "KL_PENALTIES",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "get_kl_controller",
    "kl_penalty",
]

KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of the sampled tokens.

    With d = logprob - ref_logprob (tokens sampled from pi):
    * "kl" / "k1":         d                                  (unbiased, high variance)
    * "abs":               |d|
    * "mse" / "k2":        0.5 * d^2
    * "low_var_kl" / "k3": exp(-d) + d - 1, clamped to [-10, 10]  (unbiased, >= 0, low variance;
                           Schulman's k3 estimator)

    Args:
        logprob: (...) log-probs under the policy.
        ref_logprob: (...) log-probs under the reference model.
        kl_penalty: estimator name, one of `KL_PENALTIES`.

    Returns:
        (...) per-token KL estimates.

    Raises:
        ValueError: unknown estimator name.

    Example:
        >>> kl_penalty(torch.tensor([-1.0]), torch.tensor([-2.0]), "k2")
        tensor([0.5000])
    """
    diff = logprob - ref_logprob
    if kl_penalty in ("kl", "k1"):
        return diff
    if kl_penalty == "abs":
        return diff.abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * diff.square()
    if kl_penalty in ("low_var_kl", "k3"):
        # Clamping the log-ratio first keeps exp finite (and inf - inf out); the result saturates
        # at 10 long before |log-ratio| reaches 20, so the clamp does not change any value.
        log_ratio = (-diff).clamp(-20.0, 20.0)
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl_penalty {kl_penalty!r}; expected one of {KL_PENALTIES}")


# `apply_kl_penalty` takes a parameter named `kl_penalty` (the estimator's name, as in verl's
# configs), which shadows the function inside it.
_kl_penalty = kl_penalty


class FixedKLController:
    """A constant KL coefficient.

    Args:
        kl_coef: the coefficient beta.

    Example:
        >>> ctrl = FixedKLController(0.1); ctrl.update(5.0, n_steps=8); ctrl.value
        0.1
    """

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Ignored: the coefficient stays fixed."""


class AdaptiveKLController:
    """Proportional controller driving the measured KL towards a target (Ziegler et al. 2019).

    error = clip(current_kl / target_kl - 1, -0.2, 0.2)
    value <- value * (1 + error * n_steps / horizon)

    Args:
        init_kl_coef: starting coefficient.
        target_kl: the KL to aim for, > 0.
        horizon: number of samples over which the error is corrected, > 0.

    Example:
        >>> ctrl = AdaptiveKLController(0.1, target_kl=0.5, horizon=10)
        >>> ctrl.update(1.0, n_steps=1); round(ctrl.value, 6)  # error clipped to 0.2
        0.102
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient up when `current_kl` is above target, down when below."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


def get_kl_controller(
    kind: str,
    kl_coef: float,
    target_kl: float | None = None,
    horizon: float | None = None,
) -> KLController:
    """Build a KL controller by name.

    Args:
        kind: "fixed" or "adaptive".
        kl_coef: the (initial) coefficient.
        target_kl: required for "adaptive"; ignored with a warning for "fixed".
        horizon: required for "adaptive"; ignored with a warning for "fixed".

    Returns:
        A `FixedKLController` or an `AdaptiveKLController`.

    Raises:
        ValueError: unknown kind, or "adaptive" without target_kl/horizon.

    Example:
        >>> get_kl_controller("adaptive", 0.05, target_kl=0.1, horizon=10000).value
        0.05
    """
    if kind == "fixed":
        if target_kl is not None or horizon is not None:
            warnings.warn("target_kl and horizon are ignored by the fixed KL controller", stacklevel=2)
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                f"the adaptive KL controller needs target_kl and horizon, "
                f"got target_kl={target_kl}, horizon={horizon}"
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller kind {kind!r}; expected 'fixed' or 'adaptive'")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Subtract the KL penalty from the rewards and update the controller (in-reward KL).

    r_t = score_t - beta * kl_t on valid tokens (score_t unchanged elsewhere), with
    beta = kl_ctrl.value before the update. The batch KL is the mean over sequences of each
    sequence's mean token KL; the controller is updated with it and n_steps = batch size.

    Args:
        token_level_scores: (batch, response_len) scores from the reward function.
        old_log_prob: (batch, response_len) log-probs of the rollout policy.
        ref_log_prob: (batch, response_len) log-probs of the reference model.
        response_mask: (batch, response_len); nonzero on real response tokens.
        kl_ctrl: a `FixedKLController` or `AdaptiveKLController`; updated in place.
        kl_penalty: estimator name, see `kl_penalty`.

    Returns:
        (token_level_rewards, metrics) where metrics holds "actor/reward_kl_penalty" (the batch
        KL) and "actor/reward_kl_penalty_coeff" (the beta applied).

    Example:
        >>> scores = torch.tensor([[0.0, 1.0]]); lp = torch.tensor([[-1.0, -1.0]])
        >>> rewards, m = apply_kl_penalty(scores, lp, lp - 1, torch.ones(1, 2),
        ...                               FixedKLController(0.1))
        >>> rewards
        tensor([[-0.1000,  0.9000]])
    """
    valid = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    kld = torch.where(valid, _kl_penalty(old_log_prob, ref_log_prob, kl_penalty), 0.0)
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld

    per_seq_kl = masked_mean(kld, response_mask, dim=-1)
    current_kl = masked_mean(per_seq_kl, valid.any(dim=-1)).item()
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
