"""Each RL extension point is one decorator: an advantage estimator, a policy loss, a scorer and a
tool-call format defined in this file alone are accepted by the config and used by the trainer.

Run: python -m pytest tests/rl/test_extension_points.py -q
"""

import json

import pytest
import torch

from rl_extension.agents.formats import TagFormat, count_calls, final_answer, format_for, register_tool_format
from rl_extension.algorithms.advantages import compute_grpo_outcome_advantage, register_adv_estimator
from rl_extension.algorithms.core import agg_loss, masked_mean
from rl_extension.algorithms.policy_losses import get_policy_loss, register_policy_loss
from rl_extension.app.demo import algorithm_name
from rl_extension.config import PPOConfig, load_config
from rl_extension.data.scorers import get_scorer, register_scorer
from rl_extension.trainers.ppo import PPOTrainer

# One inline worker, a 2-layer model, 4 prompts x 4 samples, 2 steps.
TINY = [
    "model.tiny.num_layers=2",
    "model.tiny.hidden_size=64",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=128",
    "data.synthetic.num_train=200",
    "data.synthetic.num_val=4",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=4",
    "rollout.max_new_tokens=6",
    "trainer.total_steps=2",
    "trainer.val_every=0",
    "trainer.save_every=0",
    "trainer.backend=inline",
    "trainer.num_workers=1",
    "trainer.loggers=[jsonl]",
    "trainer.progress=none",
]

CALLS: dict[str, list] = {"estimator": [], "loss": [], "scorer": []}


@register_adv_estimator(
    "signed_grpo",
    inputs=("token_level_rewards", "response_mask", "index"),
    config_keys=("norm_adv_by_std_in_grpo",),
    needs_groups=True,
    display_name="Signed GRPO",
)
def signed_grpo(token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=True):
    """GRPO's advantages reduced to their sign: every token's advantage is -1, 0 or +1."""
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo
    )
    advantages = advantages.sign()
    CALLS["estimator"].append(advantages)
    return advantages, advantages.clone()


@register_policy_loss("plain_pg", config_keys=("loss_agg_mode",), metrics=("mean_ratio",))
def plain_pg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean"):
    """REINFORCE on the advantages, no clipping; reports the mean ratio."""
    CALLS["loss"].append(loss_agg_mode)
    ratio = torch.exp(log_prob - old_log_prob)
    return agg_loss(-advantages * log_prob, response_mask, loss_agg_mode), masked_mean(
        ratio, response_mask
    ).detach()


@register_scorer("has_digit", "any_digit")
def has_digit(response: str, ground_truth: str) -> float:
    CALLS["scorer"].append(response)
    return float(any(c.isdigit() for c in response))


@register_tool_format("brackets")
class BracketFormat(TagFormat):
    """TagFormat's parsing with other tags: ``[call]calc 1+2[/call]`` and ``[result]3[/result]``."""

    call_start, result_end = "[call]", "[/result]"

    def parse(self, text, tools):
        return super().parse(text.replace("[call]", "<call>").replace("[/call]", "</call>"), tools)

    def render_call(self, name, arguments):
        return super().render_call(name, arguments).replace("<call>", "[call]").replace("</call>", "[/call]")

    def observation(self, results):
        return "".join(f"[result]{r}[/result]" for r in results)


@pytest.mark.timeout(300)
def test_an_estimator_a_loss_and_a_scorer_of_this_file_train_through_the_config(tmp_path):
    for calls in CALLS.values():
        calls.clear()
    overrides = [
        f"trainer.run_dir={tmp_path / 'run'}",
        *TINY,
        "algorithm.adv_estimator=signed_grpo",  # the preset's drop_uniform_groups=true is allowed: needs_groups
        "actor.policy_loss=plain_pg",
        "reward.scorer=has_digit",
    ]
    config = load_config(PPOConfig, "tiny-cpu", overrides)
    assert not config.use_critic
    with PPOTrainer(config) as trainer:
        trainer.fit()
    assert len(CALLS["estimator"]) == 2  # one call a step
    for advantages in CALLS["estimator"]:
        assert set(advantages.unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert CALLS["loss"] and set(CALLS["loss"]) == {"token-mean"}  # the actor's key, passed by name
    assert len(CALLS["scorer"]) >= 2 * 4 * 4  # every sample of both steps (and the validation prompts)
    lines = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "actor/pg_loss" in line]
    assert len(steps) == 2
    assert all("actor/mean_ratio" in line and "actor/pg_clipfrac" not in line for line in steps)


def test_the_registry_is_read_when_the_config_is_checked_and_an_unknown_name_is_named():
    with pytest.raises(
        ValueError,
        match=r"algorithm.adv_estimator: unknown advantage estimator 'bogus'; expected one of \[.*'signed_grpo'",
    ):
        load_config(PPOConfig, "tiny-cpu", ["algorithm.adv_estimator=bogus"])
    with pytest.raises(
        ValueError,
        match=r"actor.policy_loss: unknown policy loss 'bogus'; expected one of \['plain_pg', 'ppo'\]",
    ):
        load_config(PPOConfig, "tiny-cpu", ["actor.policy_loss=bogus"])
    with pytest.raises(
        ValueError, match=r"reward.scorer: unknown scorer 'bogus'; valid names: \[.*'has_digit'"
    ):
        load_config(PPOConfig, "tiny-cpu", ["reward.scorer=bogus"])
    load_config(PPOConfig, "tiny-cpu", ["reward.scorer=any_digit"])  # an alias
    load_config(PPOConfig, "tiny-cpu", ["reward.scorer=my_rewards:score"])  # imported when the run starts

    @register_adv_estimator("registered_late", inputs=("token_level_rewards", "response_mask"))
    def registered_late(token_level_rewards, response_mask):
        return token_level_rewards, token_level_rewards

    config = load_config(
        PPOConfig,
        "tiny-cpu",
        ["algorithm.adv_estimator=registered_late", "algorithm.drop_uniform_groups=false"],
    )
    assert config.algorithm.adv_estimator == "registered_late"
    assert (
        algorithm_name(config) == "REGISTERED_LATE"
        and algorithm_name(load_config(PPOConfig, "tiny-cpu-ppo")) == "PPO"
    )
    # What the trainer and the config need is declared on the entry, not read from a list of names.
    with pytest.raises(
        ValueError, match="drop_uniform_groups needs group advantages.*adv_estimator=registered_late"
    ):
        load_config(
            PPOConfig, "tiny-cpu", ["algorithm.adv_estimator=registered_late"]
        )  # the preset drops uniform groups


def test_an_estimator_that_takes_values_gets_a_critic_and_bad_declarations_fail_at_registration():
    @register_adv_estimator("values_only", inputs=("values", "response_mask"), config_keys=("gamma",))
    def values_only(values, response_mask, gamma):
        return values * gamma, values

    config = load_config(PPOConfig, "tiny-cpu-ppo", ["algorithm.adv_estimator=values_only"])
    assert config.use_critic
    with pytest.raises(ValueError, match=r"unknown inputs \['rewards'\]"):
        register_adv_estimator("bad", inputs=("rewards",))
    with pytest.raises(ValueError, match=r"\['gama'\] are not keys of the algorithm section"):
        register_adv_estimator("bad", inputs=("values",), config_keys=("gama",))
    with pytest.raises(ValueError, match=r"\['clip'\] are not keys of the actor section"):
        register_policy_loss("bad", config_keys=("clip",))


def test_a_policy_loss_and_a_scorer_at_unit_level():
    loss = get_policy_loss("plain_pg")
    old, new = torch.zeros(1, 2), torch.log(torch.tensor([[2.0, 0.5]]))
    value, metrics = loss(
        load_config(PPOConfig, "tiny-cpu").actor, old, new, torch.ones(1, 2), torch.ones(1, 2)
    )
    assert value.item() == pytest.approx(-(new.sum() / 2).item()) and metrics[
        "mean_ratio"
    ].item() == pytest.approx(1.25)
    assert get_scorer("has_digit")("x7", "") == 1.0 and get_scorer("any_digit")("none", "") == 0.0


def test_a_tool_format_of_this_file_is_found_by_name_and_graded():
    fmt = format_for(None, "brackets")
    assert isinstance(fmt, BracketFormat) and fmt.name == "brackets"
    trajectory = f"{fmt.render_call('calc', {'expression': '1+2'})}{fmt.observation(['3'])} 3"
    assert final_answer(trajectory) == " 3" and count_calls(trajectory) == 1
    assert get_scorer("calc", tool_call_penalty=0.25)(trajectory, "3") == 0.75
    with pytest.raises(ValueError, match="unknown tool-call format 'nope'; available: auto, .*brackets"):
        format_for(None, "nope")
