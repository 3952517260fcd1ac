"""The off-policy correction of the actor loss (actor.off_policy_correction, rl_extension/algorithms/policy_losses.py).

Against a hand computation on 2 x 3 tokens (one masked), with the truncation active on two tokens:
truncated importance sampling (tis) on the ppo loss and on another registered loss, decoupled PPO,
their metrics; both equal the plain loss when the rollout sampled with the proximal policy; an
actor update logs the metrics; and the config refuses what cannot work.

Run: python -m pytest tests/rl/test_off_policy_correction.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
from batches import build_small_model, prompt_batch

import spmdcall as sc
from rl_extension.algorithms.core import agg_loss
from rl_extension.algorithms.policy_losses import (
    POLICY_LOSSES,
    get_policy_loss,
    importance_weights,
    policy_loss_with_correction,
    register_policy_loss,
)
from rl_extension.config import ActorConfig, ModelConfig, PPOConfig, RolloutConfig, load_config
from rl_extension.models import load_tokenizer
from rl_extension.roles import Actor, HFRollout
from rl_extension.roles.keys import ACTOR_UPDATE_KEYS
from rl_extension.trainers.metrics import mean_metrics

ln = math.log
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
BEHAVIOUR = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -0.5, -2.0]])  # rollout_log_prob
# pi_prox / pi_behav = [[1.5, 4, 5 (masked)], [0.5, 1, 3]]: truncated at C = 2 -> [[1.5, 2, 0], [0.5, 1, 2]]
PROXIMAL = BEHAVIOUR + torch.tensor([[ln(1.5), ln(4.0), ln(5.0)], [ln(0.5), 0.0, ln(3.0)]])  # old_log_prob
# pi / pi_prox = [[1.1, 1.5, 9 (masked)], [0.5, 1.0, 0.9]]
RATIO = torch.tensor([[ln(1.1), ln(1.5), ln(9.0)], [ln(0.5), 0.0, ln(0.9)]])
ADVANTAGES = torch.tensor([[1.0, 1.0, 7.0], [-1.0, 2.0, -1.0]])
# PPO per token, clip 0.2: max(-A r, -A clip(r, 0.8, 1.2)) (no dual clip reached, c = 3):
#   [[-1.1, -1.2 (clipped), -], [0.8 (clipped), -2.0, 0.9]]
PPO_TOKENS = torch.tensor([[-1.1, -1.2, 0.0], [0.8, -2.0, 0.9]])
WEIGHTS = torch.tensor([[1.5, 2.0, 0.0], [0.5, 1.0, 2.0]])
# Weighted: [[-1.65, -2.4, -], [0.4, -2.0, 1.8]]
TOKEN_MEAN = (-1.65 - 2.4 + 0.4 - 2.0 + 1.8) / 5  # -0.77
SEQ_MEAN_TOKEN_MEAN = ((-1.65 - 2.4) / 2 + (0.4 - 2.0 + 1.8) / 3) / 2
PLAIN_TOKEN_MEAN = (-1.1 - 1.2 + 0.8 - 2.0 + 0.9) / 5  # -0.52
# d loss / d log_prob (token-mean): -A r w / 5 where the ratio is not clipped, 0 where it is.
GRADIENT = torch.tensor([[-1.1 * 1.5 / 5, 0.0, 0.0], [0.0, -2.0 / 5, 0.9 * 2.0 / 5]])


def weighted_pg(old_log_prob, log_prob, advantages, response_mask, token_weights=None):
    """-A r per token (no clip), times token_weights."""
    losses = -advantages * torch.exp(log_prob - old_log_prob)
    if token_weights is not None:
        losses = losses * token_weights
    return (agg_loss(losses, response_mask, "token-mean"),)


@pytest.fixture(autouse=True)
def test_losses():
    """Two losses of this file's, registered while each test runs: one takes token weights, one not."""
    register_policy_loss("test_weighted_pg", takes_token_weights=True)(weighted_pg)
    register_policy_loss("test_unweighted_pg")(lambda old, new, adv, mask: ((new - old).sum(),))
    yield
    for name in ("test_weighted_pg", "test_unweighted_pg"):
        POLICY_LOSSES.pop(name)


def corrected(correction: str, loss: str = "ppo", behaviour=BEHAVIOUR, **config):
    log_prob = (PROXIMAL + RATIO).requires_grad_()
    actor = ActorConfig(
        policy_loss=loss, off_policy_correction=correction, importance_weight_cap=2.0, **config
    )
    value, metrics = policy_loss_with_correction(
        get_policy_loss(loss), actor, PROXIMAL, log_prob, ADVANTAGES, MASK, behaviour
    )
    value.backward()
    return value.detach(), metrics, log_prob.grad


def test_importance_weights_truncate_and_mask():
    proximal = PROXIMAL.clone().requires_grad_()
    weights, metrics = importance_weights(proximal, BEHAVIOUR, MASK, cap=2.0)
    assert torch.allclose(weights, WEIGHTS) and not weights.requires_grad
    assert float(metrics["is_weight_mean"]) == pytest.approx((1.5 + 4 + 0.5 + 1 + 3) / 5)  # before truncation
    assert float(metrics["is_weight_max"]) == pytest.approx(4.0)  # the masked 5 left out
    assert float(metrics["is_truncated_frac"]) == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="cap must be > 0, got 0"):
        importance_weights(PROXIMAL, BEHAVIOUR, MASK, cap=0)


@pytest.mark.parametrize("correction", ["tis", "decoupled"])
def test_ppo_loss_with_correction_matches_the_hand_computation(correction):
    value, metrics, grad = corrected(correction)
    assert float(value) == pytest.approx(TOKEN_MEAN)
    assert torch.allclose(grad, GRADIENT, atol=1e-6)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(2 / 5)  # the clip is on pi / pi_prox
    assert float(metrics["is_truncated_frac"]) == pytest.approx(2 / 5)
    seq_mean, _, _ = corrected(correction, loss_agg_mode="seq-mean-token-mean")
    assert float(seq_mean) == pytest.approx(SEQ_MEAN_TOKEN_MEAN)
    plain, plain_metrics, _ = corrected("none")
    assert float(plain) == pytest.approx(PLAIN_TOKEN_MEAN)
    assert "is_weight_mean" not in plain_metrics
    assert torch.allclose(agg_loss(PPO_TOKENS * WEIGHTS, MASK, "token-mean"), value)


def test_tis_weights_any_loss_that_takes_token_weights():
    value, metrics, _ = corrected("tis", loss="test_weighted_pg")
    assert float(value) == pytest.approx((-1.1 * 1.5 - 1.5 * 2.0 + 0.5 * 0.5 - 2.0 + 0.9 * 2.0) / 5)
    assert set(metrics) == {"is_weight_mean", "is_weight_max", "is_truncated_frac"}
    with pytest.raises(ValueError, match="decoupled needs the ppo loss, got 'test_weighted_pg'"):
        corrected("decoupled", loss="test_weighted_pg")


@pytest.mark.parametrize("correction", ["tis", "decoupled"])
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum"])
def test_behaviour_equal_to_proximal_gives_exactly_the_standard_loss(correction, loss_agg_mode):
    g = torch.Generator().manual_seed(0)
    proximal, advantages = -torch.rand(4, 5, generator=g) * 3, torch.randn(4, 5, generator=g)
    log_prob = proximal + 0.3 * torch.randn(4, 5, generator=g)  # ratios inside and outside the clip
    mask = (torch.rand(4, 5, generator=g) > 0.3).long()
    actor = ActorConfig(off_policy_correction=correction, loss_agg_mode=loss_agg_mode)
    standard = get_policy_loss("ppo")(actor, proximal, log_prob, advantages, mask)
    value, metrics = policy_loss_with_correction(
        get_policy_loss("ppo"), actor, proximal, log_prob, advantages, mask, proximal.clone()
    )
    assert torch.equal(value, standard[0])
    assert all(torch.equal(metrics[k], v) for k, v in standard[1].items())
    assert (float(metrics["is_weight_mean"]), float(metrics["is_weight_max"])) == (1.0, 1.0)
    assert float(metrics["is_truncated_frac"]) == 0.0


def test_the_correction_needs_rollout_log_probs():
    actor = ActorConfig(off_policy_correction="tis")
    with pytest.raises(ValueError, match="off_policy_correction=tis needs rollout_log_prob"):
        policy_loss_with_correction(get_policy_loss("ppo"), actor, PROXIMAL, PROXIMAL, ADVANTAGES, MASK)


def test_config_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="policy_loss='test_weighted_pg' must be 'ppo'"):
        ActorConfig(policy_loss="test_weighted_pg", off_policy_correction="decoupled").check("actor.")
    with pytest.raises(ValueError, match="without takes_token_weights=True"):
        ActorConfig(policy_loss="test_unweighted_pg", off_policy_correction="tis").check("actor.")
    with pytest.raises(ValueError, match="needs rollout.compute_log_probs=true"):
        load_config(PPOConfig, "tiny-cpu", ["actor.off_policy_correction=tis"]).validate()
    with pytest.warns(UserWarning, match="importance_weight_cap is ignored"):
        load_config(PPOConfig, "tiny-cpu", ["actor.importance_weight_cap=3.0"]).validate()
    config = load_config(
        PPOConfig, "tiny-cpu", ["actor.off_policy_correction=decoupled", "rollout.compute_log_probs=true"]
    )
    config.validate()
    assert (config.actor.off_policy_correction, config.actor.importance_weight_cap) == ("decoupled", 2.0)


def test_max_metrics_take_the_largest_value_across_ranks():
    merged = mean_metrics(
        [{"actor/is_weight_max": 3.0, "actor/x": 1.0}, {"actor/is_weight_max": 5.0, "actor/x": 2.0}]
    )
    assert merged == {"actor/is_weight_max": 5.0, "actor/x": 1.5}


@pytest.mark.timeout(60)
def test_actor_update_logs_the_importance_weights(tmp_path):
    """An update with tis on rows whose behaviour log-probs were lowered by 1 on some tokens: those
    tokens' weights are e > 2, truncated; the others' are 1 up to numerics."""
    path = build_small_model(tmp_path / "tiny")
    model = ModelConfig(path=path)
    rollout = sc.WorkerGroup(
        sc.ResourcePool([1]),
        sc.ClassWithInitArgs(
            HFRollout,
            model,
            RolloutConfig(n=2, max_new_tokens=4, compute_log_probs=True),
            model_path=path,
            tokenizer_path=path,
        ),
        backend="inline",
    )
    try:
        batch = rollout.generate(prompt_batch(load_tokenizer(path), ["12+34=", "7+5="]))
    finally:
        rollout.shutdown()
    mask = batch.batch["response_mask"]
    batch.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    lowered = torch.zeros(mask.shape, dtype=torch.bool)
    lowered[:, 0] = True
    batch.batch["rollout_log_prob"] = batch.batch["rollout_log_prob"] - lowered.float()
    config = ActorConfig(lr=1e-3, ppo_mini_batch_size=2, off_policy_correction="tis")
    actor = sc.WorkerGroup(
        sc.ResourcePool([1]),
        sc.ClassWithInitArgs(
            Actor, model, config, model_path=path, num_mini_batches=1, total_steps=1, threads=1
        ),
        backend="inline",
    )
    try:
        metrics = mean_metrics(
            actor.update_policy(batch.select(batch_keys=(*ACTOR_UPDATE_KEYS, "rollout_log_prob")))
        )
    finally:
        actor.shutdown()
    num_lowered = float((lowered & mask.bool()).sum())
    assert metrics["actor/is_truncated_frac"] == pytest.approx(num_lowered / float(mask.sum()))
    assert metrics["actor/is_weight_max"] == pytest.approx(math.e, rel=1e-3)
    expected_mean = (num_lowered * math.e + float(mask.sum()) - num_lowered) / float(mask.sum())
    assert metrics["actor/is_weight_mean"] == pytest.approx(expected_mean, rel=1e-3)
