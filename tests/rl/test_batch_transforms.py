"""The batch recipes (``rl_extension.trainers.batch_transforms``), each alone on a small DataProto, no worker
group: guidance, dynamic sampling, dropping uniform groups and the supervised term's demonstrations.
The trainer's use of them is in test_sampling.py.

Run: python -m pytest tests/rl/test_batch_transforms.py -q
"""

import numpy as np
import pytest
import torch

from rl_extension.config import PPOConfig, load_config
from rl_extension.data.rewards import RewardManager
from rl_extension.models import build_tiny_tokenizer
from rl_extension.roles.rollout import rollout_batch
from rl_extension.trainers.batch_transforms import BATCH_TRANSFORMS, BatchContext, apply_transforms
from spmdcall.data import DataProto

WIDTH = 4  # response columns


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _config(*overrides: str) -> PPOConfig:
    """tiny-cpu, 2 prompts x 2 samples, every recipe off but what ``overrides`` turn on."""
    recipes_off = [
        "algorithm.guide_failed_groups=false",
        "algorithm.dynamic_sampling=false",
        "algorithm.drop_uniform_groups=false",
        "actor.sft_loss_coef=0",
    ]
    sizes = ["rollout.n=2", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "trainer.num_workers=1"]
    return load_config(PPOConfig, "tiny-cpu", [*recipes_off, *sizes, *overrides])


def _batch(tokenizer, uids: str, scores: list[float], answers: list[str] | None = None) -> DataProto:
    """A scored ``generate`` output: one row per character of ``uids`` (its group), prompt "q<uid>",
    response "x" then eos, ground truth ``answers[i]`` (default "7"), sequence score ``scores[i]``
    on the last response token (as token_level_scores and token_level_rewards)."""
    rows = len(uids)
    prompts = torch.tensor([tokenizer(f"q{u}")["input_ids"] for u in uids])
    data = DataProto.from_dict(
        {
            "input_ids": prompts,
            "attention_mask": torch.ones_like(prompts),
            "position_ids": torch.arange(prompts.shape[1]).expand(rows, -1).clone(),
        },
        {
            "uid": np.array(list(uids), dtype=object),
            "ground_truth": np.array(answers or ["7"] * rows, dtype=object),
        },
    )
    x, eos, pad = tokenizer("x")["input_ids"][0], tokenizer.eos_token_id, tokenizer.pad_token_id
    batch = rollout_batch(data, torch.tensor([[x, eos] + [pad] * (WIDTH - 2)] * rows), [eos])
    token_scores = torch.zeros(rows, WIDTH)
    token_scores[:, 1] = torch.tensor(scores)
    batch.batch["token_level_scores"] = token_scores
    batch.batch["token_level_rewards"] = token_scores.clone()
    batch.batch["advantages"] = token_scores.clone()
    return batch


def _score_exact(tokenizer):
    manager = RewardManager(tokenizer, "exact_match")

    def score(batch: DataProto) -> dict[str, float]:
        batch.batch["token_level_scores"] = manager(batch).token_level_scores
        return {}

    return score


def test_the_recipes_are_registered_in_the_order_the_step_applies_them():
    assert [(t.stage, t.name) for t in BATCH_TRANSFORMS.values()] == [
        ("round", "guide_failed_groups"),
        ("step", "dynamic_sampling"),
        ("update", "drop_uniform_groups"),
        ("update", "sft_demonstrations"),
    ]


def test_each_recipe_is_off_unless_its_config_key_turns_it_on(tokenizer):
    config = _config()
    batch = _batch(tokenizer, "aabb", [0, 0, 1, 0])
    for stage in ("round", "step", "update"):
        out, metrics = apply_transforms(stage, batch, BatchContext(config=config, tokenizer=tokenizer))
        assert out is batch and metrics == {}
    on = _config("algorithm.drop_uniform_groups=true")
    out, _ = apply_transforms("update", batch, BatchContext(config=on, tokenizer=tokenizer, scored=batch))
    assert out.non_tensor_batch["uid"].tolist() == ["b", "b"]


def test_guidance_writes_the_ground_truth_over_the_first_sample_of_each_failed_group(tokenizer):
    # group a found its answer (score 1), group b did not: b's first row becomes "12" then eos, scored again.
    batch = _batch(tokenizer, "aabb", [1, 0, 0, 0.5], answers=["7", "7", "12", "12"])
    context = BatchContext(
        config=_config("algorithm.guide_failed_groups=true"),
        tokenizer=tokenizer,
        score=_score_exact(tokenizer),
    )
    out, metrics = apply_transforms("round", batch, context)
    assert out is batch and metrics == {"guidance/guided_group_frac": 0.5}
    assert batch.non_tensor_batch["guided"].tolist() == [False, False, True, False]
    written = batch.batch["responses"][2].tolist()
    assert written[:3] == [*tokenizer("1")["input_ids"], *tokenizer("2")["input_ids"], tokenizer.eos_token_id]
    assert batch.batch["response_mask"][2].tolist() == [1, 1, 1, 0]
    assert batch.batch["token_level_scores"].sum(-1).tolist() == [0.0, 0.0, 1.0, 0.0]  # exact_match again


def test_guidance_leaves_out_a_demonstration_longer_than_the_responses(tokenizer):
    batch = _batch(tokenizer, "aa", [0, 0], answers=["12345", "12345"])  # 5 tokens + eos > 4 columns
    context = BatchContext(
        config=_config("algorithm.guide_failed_groups=true"),
        tokenizer=tokenizer,
        score=_score_exact(tokenizer),
    )
    _, metrics = apply_transforms("round", batch, context)
    assert metrics == {"guidance/guided_group_frac": 0.0}
    assert not batch.non_tensor_batch["guided"].any()


def test_dynamic_sampling_samples_until_enough_groups_are_informative(tokenizer):
    # The first round's two groups are uniform; the next round's two are not: the step keeps those.
    rounds = iter([_batch(tokenizer, "ccdd", [1, 0, 0, 1])])
    config = _config("algorithm.dynamic_sampling=true", "algorithm.max_sample_rounds=3")
    context = BatchContext(
        config=config, tokenizer=tokenizer, sample=lambda: (next(rounds), {"ignored": 1.0})
    )
    out, metrics = apply_transforms("step", _batch(tokenizer, "aabb", [0, 0, 1, 1]), context)
    assert out.non_tensor_batch["uid"].tolist() == ["c", "c", "d", "d"]
    assert metrics == {"sampling/rounds": 2, "sampling/informative_group_frac": 1.0}


def test_dynamic_sampling_stops_at_max_sample_rounds_and_fills_up_with_uniform_groups(tokenizer):
    sampled = []

    def sample():
        sampled.append(_batch(tokenizer, "ee", [0, 0]))
        return sampled[-1], {}

    config = _config("algorithm.dynamic_sampling=true", "algorithm.max_sample_rounds=2")
    context = BatchContext(config=config, tokenizer=tokenizer, sample=sample)
    out, metrics = apply_transforms("step", _batch(tokenizer, "aabb", [0, 0, 1, 0]), context)
    assert len(sampled) == 1
    assert out.non_tensor_batch["uid"].tolist() == ["a", "a", "b", "b"]  # b informative, then a
    assert metrics == {"sampling/rounds": 2, "sampling/informative_group_frac": 0.5}


def test_drop_uniform_groups_keeps_the_informative_ones_and_splits_evenly(tokenizer):
    batch = _batch(tokenizer, "aabbcc", [1, 1, 0, 1, 0, 0])
    config = _config("algorithm.drop_uniform_groups=true")
    out, metrics = apply_transforms("update", batch, BatchContext(config=config, tokenizer=tokenizer))
    assert out.non_tensor_batch["uid"].tolist() == ["b", "b"] and metrics == {}
    # 2 workers x 2 mini-batches: at least 4 rows, uniform groups put back first ones first
    config = _config("algorithm.drop_uniform_groups=true", "data.train_batch_size=4", "trainer.num_workers=2")
    out, _ = apply_transforms("update", batch, BatchContext(config=config, tokenizer=tokenizer))
    assert out.non_tensor_batch["uid"].tolist() == ["a", "a", "b", "b"]


def test_sft_demonstrations_add_one_row_per_prompt_read_by_the_supervised_term_alone(tokenizer):
    scored = _batch(tokenizer, "aabb", [1, 1, 0, 1], answers=["7", "7", "3", "3"])
    rows = scored.select_idxs([2, 3])  # as if the uniform group a had been dropped
    config = _config("actor.sft_loss_coef=0.5")
    out, metrics = apply_transforms(
        "update", rows, BatchContext(config=config, tokenizer=tokenizer, scored=scored)
    )
    assert metrics == {} and "sft_mask" not in rows.batch.keys()  # the input keeps its columns
    assert out.non_tensor_batch["uid"].tolist() == ["b", "b", "a", "b"]  # one demonstration per prompt
    sampled, demos = out.slice(0, 2), out.slice(2)
    assert not sampled.batch["sft_mask"].any()
    assert torch.equal(sampled.batch["response_mask"], rows.batch["response_mask"])
    answers = [
        tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
        for r, m in zip(demos.batch["responses"], demos.batch["sft_mask"])
    ]
    assert answers == ["7", "3"]
    for key in ("response_mask", "advantages", "token_level_rewards"):
        assert not demos.batch[key].any(), key
    width = scored.batch["prompts"].shape[1]
    assert torch.equal(demos.batch["input_ids"][:, :width], scored.batch["prompts"][[0, 2]])  # their prompts


def test_sft_demonstrations_interleave_each_workers_share(tokenizer):
    scored = _batch(tokenizer, "aabbcc", [1, 0, 1, 0, 1, 0])
    config = _config("actor.sft_loss_coef=0.5", "trainer.num_workers=2", "data.train_batch_size=2")
    out, _ = apply_transforms(
        "update", scored, BatchContext(config=config, tokenizer=tokenizer, scored=scored)
    )
    # 3 prompts over 2 workers: 2 demonstrations, one after each worker's 3 sampled rows
    demo = out.batch["sft_mask"].sum(-1) > 0
    assert demo.tolist() == [False, False, False, True, False, False, False, True]
    assert out.non_tensor_batch["uid"].tolist() == ["a", "a", "b", "a", "b", "c", "c", "b"]
