"""Hand-computed checks for rl_extension.algorithms.core and rl_extension.algorithms.kl (CPU, fast).

Run: python -m pytest tests/rl/test_algorithms.py -q
"""

import math

import numpy as np
import pytest
import torch

from rl_extension.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_advantage_estimator,
)
from rl_extension.algorithms.core import (
    agg_loss,
    compute_value_loss,
    entropy_from_logits,
    informative_rows,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    pick_groups,
    uniform_group_fraction,
    uniform_groups,
)
from rl_extension.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from rl_extension.algorithms.policy_losses import compute_policy_loss, get_policy_loss

T = torch.tensor


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=0,
    )


# ----------------------------------------------------------------------------------- masked ops


def test_masked_sum_and_mean_ignore_garbage_in_masked_positions():
    x = T([[1.0, 2.0, math.inf], [4.0, math.nan, 6.0]])
    mask = T([[1, 1, 0], [1, 0, 1]])
    close(masked_sum(x, mask), 1 + 2 + 4 + 6)
    close(masked_mean(x, mask), 13 / 4)
    close(masked_sum(x, mask, dim=-1), [3.0, 10.0])
    close(masked_mean(x, mask, dim=-1), [1.5, 5.0])
    close(masked_mean(x, mask.float(), dim=0), [2.5, 2.0, 6.0])
    # a reduction with no valid entry is 0, not nan
    close(masked_mean(x, T([[0, 0, 0], [1, 1, 1]]).bool(), dim=-1)[0], 0.0)


def test_masked_var():
    x = T([1.0, 2.0, 3.0, 100.0])
    mask = T([1, 1, 1, 0])
    # mean 2, squared deviations 1 + 0 + 1 = 2
    close(masked_var(x, mask, unbiased=True), 2 / 2)
    close(masked_var(x, mask, unbiased=False), 2 / 3)
    # a single valid entry has no spread (no Bessel division by zero)
    close(masked_var(x, T([0, 1, 0, 0])), 0.0)


def test_masked_whiten():
    x = T([2.0, 4.0, 6.0, 1e6])
    mask = T([1, 1, 1, 0])
    # mean 4, unbiased var (4 + 0 + 4) / 2 = 4, std 2
    close(masked_whiten(x, mask), [-1.0, 0.0, 1.0, 0.0])
    close(masked_whiten(x, mask, shift_mean=False), [3.0, 4.0, 5.0, 0.0])


# ------------------------------------------------------------------------------------------ GAE


def reference_gae(rewards, values, mask, gamma, lam):
    """Slow GAE: per row, compact the valid tokens, run the textbook recursion, scatter back."""
    raw = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        positions = [t for t in range(rewards.shape[1]) if mask[i, t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(positions):
            delta = rewards[i, t].item() + gamma * next_value - values[i, t].item()
            next_adv = delta + gamma * lam * next_adv
            next_value = values[i, t].item()
            raw[i, t] = next_adv
    returns = (raw + values) * mask
    valid = raw[mask.bool()]
    whitened = (raw - valid.mean()) / torch.sqrt(valid.var(unbiased=True) + 1e-8) * mask
    return whitened, returns


def test_gae_gamma_1_lam_1_by_hand():
    rewards = T([[0.0, 0.0, 1.0]])
    values = T([[0.5, 0.6, 0.7]])
    adv, ret = compute_gae_advantage_return(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    # gamma = lam = 1: A_t = (sum of future rewards) - V_t = 1 - V_t = [0.5, 0.4, 0.3]
    close(ret, [[1.0, 1.0, 1.0]])  # A + V
    # whiten [0.5, 0.4, 0.3]: mean 0.4, unbiased var 0.01, std 0.1
    close(adv, [[1.0, 0.0, -1.0]], atol=1e-4)


def test_gae_gamma_09_lam_095_by_hand_and_against_reference():
    rewards = T([[0.0, 0.0, 1.0]])
    values = T([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.95)
    # t=2: delta = 1 + 0.9*0   - 0.7 = 0.3;   A = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03;  A = 0.03 + 0.855*0.3    = 0.2865
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04;  A = 0.04 + 0.855*0.2865 = 0.2849575
    close(ret, [[0.2849575 + 0.5, 0.2865 + 0.6, 0.3 + 0.7]])
    ref_adv, ref_ret = reference_gae(rewards, values, mask, 0.9, 0.95)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_masked_positions_pass_through():
    torch.manual_seed(0)
    rewards = torch.randn(4, 7)
    values = torch.randn(4, 7)
    mask = T(
        [
            [1, 1, 1, 1, 1, 1, 1],
            [1, 1, 0, 0, 1, 1, 0],  # a gap inside the response, then padding
            [1, 1, 1, 0, 0, 0, 0],
            [0, 1, 1, 1, 0, 1, 0],
        ]
    ).float()
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.95)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, 0.9, 0.95)
    close(adv, ref_adv)
    close(ret, ref_ret)
    # garbage at masked positions changes nothing
    garbage = torch.where(mask.bool(), 0.0, 1e9)
    adv2, ret2 = compute_gae_advantage_return(rewards + garbage, values - garbage, mask, 0.9, 0.95)
    close(adv2, adv)
    close(ret2, ret)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


# ------------------------------------------------------------------------------ GRPO and RLOO


def outcome_batch(scores, lengths, width=4):
    """Token rewards with each score on the last valid token, and the matching mask."""
    rewards = torch.zeros(len(scores), width)
    mask = torch.zeros(len(scores), width)
    for i, (score, length) in enumerate(zip(scores, lengths)):
        mask[i, :length] = 1
        rewards[i, length - 1] = score
    return rewards, mask


def test_grpo_two_groups_with_std_normalisation():
    rewards, mask = outcome_batch([1.0, 0.0, 1.0, 2.0, 3.0], [2, 4, 1, 3, 4])
    index = np.array(["a", "a", "b", "b", "b"], dtype=object)
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index, epsilon=1e-6)
    # group a: scores [1, 0], mean 0.5, unbiased std sqrt(0.25 + 0.25) = sqrt(0.5)
    # group b: scores [1, 2, 3], mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1
    expected = [
        0.5 / (math.sqrt(0.5) + 1e-6),
        -0.5 / (math.sqrt(0.5) + 1e-6),
        -1 / (1 + 1e-6),
        0.0,
        1 / (1 + 1e-6),
    ]
    close(adv, torch.tensor(expected).unsqueeze(-1) * mask)
    close(ret, adv)


def test_grpo_without_std_normalisation():
    rewards, mask = outcome_batch([1.0, 0.0, 1.0, 2.0, 3.0], [2, 4, 1, 3, 4])
    index = np.array(["a", "a", "b", "b", "b"], dtype=object)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    close(adv, T([[0.5], [-0.5], [-1.0], [0.0], [1.0]]) * mask)


def test_grpo_singleton_group_gets_mean_0_std_1():
    rewards, mask = outcome_batch([5.0, 1.0, 3.0], [2, 2, 2])
    index = np.array(["solo", "pair", "pair"], dtype=object)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, epsilon=1e-6)
    # solo: (5 - 0) / (1 + eps); pair: [1, 3], mean 2, std sqrt(2)
    s2 = math.sqrt(2) + 1e-6
    close(adv[:, 0], [5 / (1 + 1e-6), -1 / s2, 1 / s2])


def test_outcome_estimators_ignore_masked_rewards_and_check_index_length():
    rewards, mask = outcome_batch([1.0, 0.0], [2, 2])
    index = np.array(["a", "a"], dtype=object)
    dirty = rewards + torch.where(mask.bool(), 0.0, 1e9)  # garbage past the response
    for fn in (compute_grpo_outcome_advantage, compute_rloo_outcome_advantage):
        close(fn(dirty, mask, index)[0], fn(rewards, mask, index)[0])
        with pytest.raises(ValueError, match="one group id per row"):
            fn(rewards, mask, np.array(["a"], dtype=object))


def test_uniform_group_fraction():
    # groups a (all 1), b (mixed), c (all 0, interleaved with b), d (a single row: uniform)
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5])
    index = np.array(["a", "a", "b", "c", "b", "c", "d"], dtype=object)
    assert uniform_group_fraction(scores, index) == pytest.approx(3 / 4)
    assert uniform_group_fraction(torch.tensor([0.0, 1.0]), np.array([0, 0], dtype=object)) == 0.0
    assert uniform_group_fraction(torch.zeros(0), np.array([], dtype=object)) == 0.0


def test_uniform_groups_and_informative_rows():
    # groups a (all 1), b (mixed), c (all 0, interleaved with b), d (a single row: uniform)
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5])
    index = np.array(["a", "a", "b", "c", "b", "c", "d"], dtype=object)
    assert uniform_groups(scores, index).tolist() == [True, True, False, True, False, True, True]
    assert informative_rows(scores, index).tolist() == [2, 4]
    # Uniform groups come back in order of first appearance until the count is enough and even.
    assert informative_rows(scores, index, min_rows=3).tolist() == [0, 1, 2, 4]
    assert informative_rows(scores, index, min_rows=5, multiple_of=2).tolist() == [0, 1, 2, 3, 4, 5]
    assert informative_rows(scores, index, multiple_of=3).tolist() == [0, 1, 2, 3, 4, 5]
    assert informative_rows(scores, index, min_rows=100).tolist() == list(range(7))
    assert informative_rows(torch.zeros(0), np.array([], dtype=object)).tolist() == []


def test_pick_groups_takes_informative_groups_first_then_fills_with_uniform_ones():
    # groups a (all 1), b (mixed), c (all 0, interleaved with b), d (a single row: uniform), e (mixed)
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 1.0, 0.0])
    index = np.array(["a", "a", "b", "c", "b", "c", "d", "e", "e"], dtype=object)
    assert pick_groups(scores, index, 1).tolist() == [2, 4]  # b: the first informative group
    assert pick_groups(scores, index, 2).tolist() == [2, 4, 7, 8]  # b and e
    assert pick_groups(scores, index, 3).tolist() == [0, 1, 2, 4, 7, 8]  # + a, the first uniform group
    assert pick_groups(scores, index, 9).tolist() == list(range(9))
    assert pick_groups(torch.zeros(0), np.array([], dtype=object), 2).tolist() == []


def test_rloo_leave_one_out_baseline():
    rewards, mask = outcome_batch([1.0, 0.0, 1.0, 2.0, 3.0, 5.0], [2, 4, 1, 3, 4, 3])
    index = np.array(["a", "a", "b", "b", "b", "c"], dtype=object)
    adv, ret = compute_rloo_outcome_advantage(rewards, mask, index)
    # a: baselines [0, 1]           -> [1 - 0, 0 - 1]         = [1, -1]
    # b: baselines [2.5, 2, 1.5]    -> [1 - 2.5, 2 - 2, 3 - 1.5] = [-1.5, 0, 1.5]
    # c: alone, baseline 0          -> 5
    close(adv, T([[1.0], [-1.0], [-1.5], [0.0], [1.5], [5.0]]) * mask)
    close(ret, adv)


# ------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_by_hand():
    rewards = T([[0.0, 0.0, 1.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    # return-to-go with gamma 0.5: [0.25, 0.5, 1]; mean 7/12, deviations [-4, -1, 5] / 12,
    # unbiased var (16 + 1 + 25) / 144 / 2 = 21/144  ->  whitened = [-4, -1, 5] / sqrt(21)
    close(ret, [[0.25, 0.5, 1.0, 0.0]])
    close(adv, [[-4 / math.sqrt(21), -1 / math.sqrt(21), 5 / math.sqrt(21), 0.0]], atol=1e-4)


def test_reinforce_plus_plus_skips_masked_gap():
    rewards = T([[1.0, 7.0, 2.0]])
    mask = T([[1.0, 0.0, 1.0]])
    _, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    # the masked 7 is ignored and the gap does not discount: G = [1 + 0.5*2, 0, 2]
    close(ret, [[2.0, 0.0, 2.0]])


def test_advantage_estimator_registry():
    assert {"gae", "grpo", "rloo", "reinforce_plus_plus"} <= set(ADVANTAGE_ESTIMATORS)
    gae, rloo = get_advantage_estimator("gae"), get_advantage_estimator("rloo")
    assert gae.fn is compute_gae_advantage_return and gae.needs_critic and not gae.needs_groups
    assert rloo.fn is compute_rloo_outcome_advantage and rloo.needs_groups and not rloo.needs_critic
    assert get_advantage_estimator("reinforce_plus_plus").display_name == "REINFORCE++"
    with pytest.raises(ValueError, match="'bogus'.*gae.*grpo"):
        get_advantage_estimator("bogus")


def test_policy_loss_registry_passes_the_actor_keys_and_names_the_metrics():
    from rl_extension.config import ActorConfig

    ppo = get_policy_loss("ppo")
    assert ppo.fn is compute_policy_loss
    old, new = torch.zeros(1, 2), torch.tensor([[0.5, -0.5]])
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    config = ActorConfig(clip_ratio_high=0.28)
    loss, metrics = ppo(config, old, new, adv, mask)
    expected = compute_policy_loss(old, new, adv, mask, clip_ratio_high=0.28)
    assert torch.equal(loss, expected[0]) and list(metrics) == ["pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"]
    assert all(torch.equal(metrics[k], v) for k, v in zip(metrics, expected[1:]))
    with pytest.raises(ValueError, match="'bogus'.*ppo"):
        get_policy_loss("bogus")


# ------------------------------------------------------------------------------------ agg_loss


LOSS = T([[1.0, 2.0, math.inf], [4.0, math.nan, 6.0]])
LOSS_MASK = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),  # 7/3
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),  # 3.5
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4) / 2),  # 2.75
    ],
)
def test_agg_loss_modes(mode, expected):
    close(agg_loss(LOSS, LOSS_MASK, mode), expected)
    # a fully masked row does not count as a sequence
    padded_loss = torch.cat([LOSS, T([[9.0, 9.0, 9.0]])])
    padded_mask = torch.cat([LOSS_MASK, torch.zeros(1, 3)])
    close(agg_loss(padded_loss, padded_mask, mode), expected)


def test_agg_loss_bad_mode():
    with pytest.raises(ValueError, match="'token-sum'"):
        agg_loss(LOSS, LOSS_MASK, "token-sum")


# --------------------------------------------------------------------------------- policy loss


def test_policy_loss_clip_and_dual_clip():
    # token: advantage, ratio
    #  0: A=-1, r=5   -> max(5, 1.2) = 5, dual bound 3*1 = 3 -> 3   (dual clip active)
    #  1: A=+1, r=2   -> max(-2, -1.2) = -1.2                       (ratio clip active)
    #  2: A=+1, r=1   -> -1                                          (nothing clipped)
    #  3: A=-1, r=0.5 -> max(0.5, 0.8) = 0.8 < 3                     (ratio clip active)
    #  4: masked, garbage
    ratio = T([[5.0, 2.0, 1.0, 0.5, 1e6]])
    old = T([[-1.0, -1.0, -1.0, -1.0, -math.inf]])
    new = (old + ratio.log()).clone().requires_grad_(True)
    adv = T([[-1.0, 1.0, 1.0, -1.0, 1e9]])
    mask = T([[1.0, 1.0, 1.0, 1.0, 0.0]])
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(old, new, adv, mask)
    close(pg_loss, (3 - 1.2 - 1 + 0.8) / 4)
    close(clipfrac, 2 / 4)
    close(clipfrac_lower, 1 / 4)
    close(ppo_kl, -(math.log(5) + math.log(2) + 0 + math.log(0.5)) / 4)  # mean(old - new)
    pg_loss.backward()
    # clipped tokens give no gradient; token 2: d(-A r)/d logp = -A r / 4 = -0.25
    close(new.grad, [[0.0, 0.0, -0.25, 0.0, 0.0]])


def test_policy_loss_asymmetric_clip_and_agg_mode():
    old = torch.zeros(1, 2)
    new = T([[math.log(1.25), math.log(1.25)]])
    adv = T([[1.0, 1.0]])
    mask = torch.ones(1, 2)
    # clip_ratio_high 0.28: ratio 1.25 is inside [0.8, 1.28] -> loss -1.25, no clipping
    loss, clipfrac, _, _ = compute_policy_loss(old, new, adv, mask, clip_ratio_high=0.28)
    close(loss, -1.25)
    close(clipfrac, 0.0)
    # seq-mean-token-sum sums the two tokens: -2 * 1.2
    loss, clipfrac, _, _ = compute_policy_loss(old, new, adv, mask, loss_agg_mode="seq-mean-token-sum")
    close(loss, -2.4)
    close(clipfrac, 1.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(old, new, adv, mask, clip_ratio_c=1.0)


# ---------------------------------------------------------------------------------- value loss


def test_value_loss_by_hand():
    # c = 0.2
    #  0: v=1, old=0, R=2   -> unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24 -> 3.24 (clipped)
    #  1: v=1, old=0, R=0.5 -> unclipped 0.25, clipped (0.2-0.5)^2 = 0.09    -> 0.25
    #  2: masked garbage
    vpreds = T([[1.0, 1.0, math.nan]]).requires_grad_(True)
    returns = T([[2.0, 0.5, math.inf]])
    values = T([[0.0, 0.0, 3.0]])
    mask = T([[1.0, 1.0, 0.0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    close(vf_loss, 0.5 * (3.24 + 0.25) / 2)
    close(vf_clipfrac, 0.5)
    vf_loss.backward()
    # token 0 clipped: no gradient; token 1: 0.5 * 2 * (1 - 0.5) / 2 = 0.25
    close(vpreds.grad, [[0.0, 0.25, 0.0]])


# ------------------------------------------------------------------------------ logit helpers


def test_entropy_from_logits():
    # uniform over 2: log 2; p = [1/4, 3/4]: -(1/4 log 1/4 + 3/4 log 3/4)
    logits = T([[0.0, 0.0], [0.0, math.log(3)], [1000.0, 1000.0], [1000.0, -1000.0]])
    expected = [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2), 0.0]
    close(entropy_from_logits(logits), expected)


def test_logprobs_from_logits_by_hand():
    logits = T([[[0.0, math.log(3)], [0.0, 0.0]]])  # (1, 2, 2)
    labels = T([[1, 0]])
    # softmax [1/4, 3/4] -> log 3/4; uniform -> log 1/2
    close(logprobs_from_logits(logits, labels), [[math.log(0.75), math.log(0.5)]])
    close(logprobs_from_logits(T([[2000.0, 0.0, -2000.0]]), T([0])), [0.0])
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(logits, T([1, 0]))


def test_logprobs_from_logits_matches_log_softmax_over_chunks_and_bf16():
    torch.manual_seed(0)
    logits = torch.randn(3, 1100, 7, requires_grad=True)  # 3300 rows: several chunks
    labels = torch.randint(0, 7, (3, 1100))
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    actual = logprobs_from_logits(logits, labels)
    close(actual, expected)
    (grad,) = torch.autograd.grad(actual.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    close(grad, expected_grad)
    bf16 = logprobs_from_logits(logits.detach().bfloat16(), labels)
    assert bf16.dtype == torch.float32
    close(bf16, expected.detach(), atol=5e-2)


# ----------------------------------------------------------------------------------------- KL


@pytest.mark.parametrize(
    "names, expected",
    [
        # d = logprob - ref = [1, -1]
        (("kl", "k1"), [1.0, -1.0]),
        (("abs",), [1.0, 1.0]),
        (("mse", "k2"), [0.5, 0.5]),
        # exp(-d) + d - 1: d=1 -> e^-1; d=-1 -> e - 2
        (("low_var_kl", "k3"), [math.exp(-1), math.e - 2]),
    ],
)
def test_kl_penalty_types(names, expected):
    logprob = T([-1.0, -2.0])
    ref = T([-2.0, -1.0])
    for name in names:
        close(kl_penalty(logprob, ref, name), expected)


def test_low_var_kl_is_clamped_and_finite():
    logprob = T([0.0, 0.0, 0.0, -math.inf])
    ref = T([30.0, -30.0, 2.0, 0.0])
    # ref - lp = 30 -> huge -> 10; -30 -> 29 -> 10; 2 -> e^2 - 3 = 4.389; inf -> 10
    close(kl_penalty(logprob, ref, "k3"), [10.0, 10.0, math.exp(2) - 3, 10.0])


def test_kl_penalty_bad_name():
    with pytest.raises(ValueError, match="'full'.*low_var_kl"):
        kl_penalty(T([0.0]), T([0.0]), "full")


def kl_batch():
    scores = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ref = torch.zeros(2, 3)
    old = T([[0.2, 0.4, 0.6], [1.0, 0.0, 99.0]])  # k1 = old - ref; 99 is masked
    return scores, old, ref, mask


def test_apply_kl_penalty_fixed():
    scores, old, ref, mask = kl_batch()
    ctrl = FixedKLController(0.1)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    # rewards = scores - 0.1 * kl on valid tokens; the masked 99 is not penalised
    close(rewards, [[-0.02, -0.04, 1.0 - 0.06], [-0.1, 1.0, 0.0]])
    # per-sequence mean kl [0.4, 0.5] -> batch 0.45
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.45)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert ctrl.value == pytest.approx(0.1)


def test_apply_kl_penalty_updates_adaptive_controller():
    scores, old, ref, mask = kl_batch()
    ctrl = AdaptiveKLController(0.1, target_kl=0.5, horizon=10)
    _, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    # error = 0.45/0.5 - 1 = -0.1; n_steps = 2 -> value = 0.1 * (1 - 0.1 * 2 / 10) = 0.098
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)  # the beta applied
    assert ctrl.value == pytest.approx(0.098)


def test_adaptive_controller_moves_towards_target():
    up = AdaptiveKLController(0.1, target_kl=0.5, horizon=10)
    up.update(1.0, n_steps=1)  # error 1.0 clipped to 0.2 -> * 1.02
    assert up.value == pytest.approx(0.102)
    down = AdaptiveKLController(0.1, target_kl=0.5, horizon=10)
    down.update(0.0, n_steps=1)  # error -1 clipped to -0.2 -> * 0.98
    assert down.value == pytest.approx(0.098)
    small = AdaptiveKLController(0.1, target_kl=0.5, horizon=100)
    small.update(0.55, n_steps=10)  # error 0.1 -> * (1 + 0.1 * 10 / 100) = 1.01
    assert small.value == pytest.approx(0.101)
    fixed = FixedKLController(0.1)
    fixed.update(100.0, n_steps=10)
    assert fixed.value == 0.1


def test_get_kl_controller():
    assert isinstance(get_kl_controller("fixed", 0.2), FixedKLController)
    adaptive = get_kl_controller("adaptive", 0.2, target_kl=0.1, horizon=1000)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.2
    with pytest.raises(ValueError, match="'pid'"):
        get_kl_controller("pid", 0.2)
    with pytest.raises(ValueError, match="target_kl"):
        get_kl_controller("adaptive", 0.2)
    with pytest.warns(UserWarning, match="ignored"):
        get_kl_controller("fixed", 0.2, target_kl=0.1)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.2, target_kl=0.1, horizon=0)
