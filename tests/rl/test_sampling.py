"""Dynamic sampling (``algorithm.dynamic_sampling``): rounds of rollouts joined into one batch, and the
trainer refilling a step's batch with informative groups; guidance (``algorithm.guide_failed_groups``):
the ground truth written into groups that found no right answer.

Run: python -m pytest tests/rl/test_sampling.py -q
"""

import numpy as np
import pytest
import torch

from rl_extension.agents import TagFormat
from rl_extension.agents.calc import write_calc_demonstrations
from rl_extension.algorithms.advantages import compute_advantages
from rl_extension.algorithms.core import failed_group_rows
from rl_extension.config import PPOConfig, load_config
from rl_extension.data.prompts import make_task_splits
from rl_extension.roles.rollout import concat_rollouts, replace_responses, rollout_batch
from rl_extension.trainers.metrics import read_jsonl
from rl_extension.trainers.ppo import PPOTrainer
from spmdcall.data import DataProto

PAD, EOS = 0, 9
EOS_TEXT = "<|endoftext|>"  # the tiny tokenizer's eos
TINY_RUN = [  # a 2-layer, 64-wide model, 4 prompts x 4 samples a step, 2 steps
    "model.tiny.num_layers=2",
    "model.tiny.hidden_size=64",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=128",
    "data.synthetic.num_train=200",
    "data.synthetic.num_val=12",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=4",
    "trainer.total_steps=2",
    "trainer.val_every=2",
    "trainer.save_every=2",
    "trainer.loggers=[jsonl]",
    "trainer.progress=none",
    # Guidance and the supervised term off (as in tiny-cpu; tiny-cpu-guided has both): a test turns on what it tests.
    "algorithm.guide_failed_groups=false",
    "actor.sft_loss_coef=0",
]


def _inline_config(tmp_path, preset: str, *overrides: str) -> PPOConfig:
    """A TINY_RUN of ``preset`` on one inline worker (the controller's process)."""
    return load_config(
        PPOConfig,
        preset,
        [
            f"trainer.run_dir={tmp_path / 'run'}",
            *TINY_RUN,
            "trainer.backend=inline",
            "trainer.num_workers=1",
            *overrides,
        ],
    )


def _rollout(prompts: list[list[int]], uid: list[str], responses: list[list[int]] | None = None) -> DataProto:
    """A generate output for left-padded prompts, each answered with [5, EOS] unless ``responses`` say."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts]).unsqueeze(1)).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    data = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": positions},
        {"uid": np.array(uid, dtype=object)},
    )
    return rollout_batch(data, torch.tensor(responses or [[5, EOS, PAD]] * len(prompts)), [EOS])


def test_concat_rollouts_left_pads_the_narrower_prompts():
    narrow, wide = _rollout([[1, 2], [3]], ["a", "b"]), _rollout([[4, 5, 6, 7]], ["c"])
    joined = concat_rollouts([narrow, wide], PAD)
    assert joined.non_tensor_batch["uid"].tolist() == ["a", "b", "c"]
    assert joined.batch["input_ids"].tolist() == [
        [PAD, PAD, 1, 2, 5, EOS, PAD],
        [PAD, PAD, PAD, 3, 5, EOS, PAD],
        [4, 5, 6, 7, 5, EOS, PAD],
    ]
    assert joined.batch["attention_mask"][1].tolist() == [0, 0, 0, 1, 1, 1, 0]
    # Positions count real tokens, so padding more on the left changes none of them.
    assert joined.batch["position_ids"][0, 2:].tolist() == narrow.batch["position_ids"][0].tolist()
    assert joined.batch["prompts"][0].tolist() == [PAD, PAD, 1, 2]
    assert torch.equal(
        joined.batch["responses"], torch.cat([narrow.batch["responses"], wide.batch["responses"]])
    )
    assert narrow.batch["input_ids"].shape[1] == 5  # the inputs are left as they were
    assert concat_rollouts([wide], PAD) is wide


@pytest.mark.timeout(120)
def test_dynamic_sampling_samples_more_rounds_until_the_batch_is_full(tmp_path):
    # A random model answers nothing right, so every group is uniform: each step samples the most
    # rounds allowed and still keeps a full batch (uniform groups fill it).
    config = _inline_config(
        tmp_path,
        "tiny-cpu",
        "algorithm.drop_uniform_groups=false",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_sample_rounds=3",
    )
    with PPOTrainer(config) as trainer:
        trainer.fit()
        position = trainer.train_loader.state_dict()["position"]
    records = read_jsonl(trainer.run_dir / "metrics.jsonl")[1:]
    assert [r["sampling/rounds"] for r in records] == [3, 3]
    assert [r["sampling/informative_group_frac"] for r in records] == [0.0, 0.0]
    assert all(r["actor/update_row_frac"] == 1.0 for r in records)
    assert position == 6  # 2 steps x 3 prompt batches


def test_replace_responses_writes_them_as_the_sampler_would():
    batch = _rollout([[1, 2], [3]], ["a", "b"])
    batch.batch["rollout_log_prob"] = torch.full(batch.batch["responses"].shape, -0.5)
    replace_responses(batch, [1], [[7, 8, EOS]], PAD)
    assert batch.batch["responses"].tolist() == [[5, EOS, PAD], [7, 8, EOS]]
    assert batch.batch["input_ids"][1].tolist() == [PAD, 3, 7, 8, EOS]
    assert batch.batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch.batch["attention_mask"][1].tolist() == [0, 1, 1, 1, 1]
    assert batch.batch["rollout_log_prob"].tolist() == [[-0.5] * 3, [0.0] * 3]
    sampled = _rollout([[1, 2], [3]], ["a", "b"], [[5, EOS, PAD], [7, 8, EOS]])
    for key in ("prompts", "responses", "input_ids", "response_mask", "attention_mask", "position_ids"):
        assert torch.equal(batch.batch[key], sampled.batch[key]), key
    with pytest.raises(ValueError, match="4 tokens does not fit the batch's 3 columns"):
        replace_responses(batch, [0], [[7, 7, 7, EOS]], PAD)


def test_failed_group_rows_are_the_first_of_groups_without_a_right_answer():
    scores = torch.tensor([0.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.2, 1.0])
    uid = np.array(["a", "a", "b", "b", "c", "c", "d", "d"], dtype=object)
    assert failed_group_rows(scores, uid).tolist() == [0, 4]
    assert failed_group_rows(scores[:0], uid[:0]).tolist() == []


@pytest.mark.timeout(120)
def test_guidance_writes_the_ground_truth_into_every_group_that_found_none(tmp_path):
    # A random model answers nothing right: every group gets one ground-truth response, scored 1,
    # and then every group is informative, so the update keeps all of them.
    config = _inline_config(
        tmp_path,
        "tiny-cpu",
        "trainer.total_steps=1",
        "algorithm.drop_uniform_groups=true",
        "algorithm.guide_failed_groups=true",
        "rollout.compute_log_probs=true",
    )
    with PPOTrainer(config) as trainer:
        batch, metrics = trainer._generate_and_score(trainer._prompt_batches())
        trainer.fit()
    assert metrics["reward/accuracy"] == 0.0  # what was sampled
    assert metrics["guidance/guided_group_frac"] == 1.0
    guided = batch.non_tensor_batch["guided"]
    assert guided.tolist() == [True, False, False, False] * 4  # the first sample of each group
    scores = batch.batch["token_level_scores"].sum(-1)
    assert scores[guided].tolist() == [1.0] * 4 and scores[~guided].max() < 1
    tokenizer = trainer.tokenizer
    for row in np.flatnonzero(guided):
        length = int(batch.batch["response_mask"][row].sum())
        ids = batch.batch["responses"][row, :length].tolist()
        assert ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(ids[:-1]) == batch.non_tensor_batch["ground_truth"][row]
    records = read_jsonl(trainer.run_dir / "metrics.jsonl")[1:]
    assert [r["guidance/guided_group_frac"] for r in records] == [1.0]
    assert [r["actor/update_row_frac"] for r in records] == [1.0]
    assert records[0]["rollout/log_prob_gap_mean"] < 1e-3  # the written rows are left out of the gap


@pytest.mark.timeout(120)
def test_the_demo_presets_pairs_a_guided_pair_teaches_and_its_demonstration_joins_the_update(tmp_path):
    # tiny-cpu samples 2 responses a prompt. A random model gets both wrong, so guidance writes the
    # ground truth over the first: every pair then holds a right and a wrong answer, whose GRPO
    # advantages are +-1/sqrt(2), and the update keeps every sampled row plus one demonstration
    # row per prompt for the supervised term.
    config = _inline_config(
        tmp_path,
        "tiny-cpu",
        "trainer.total_steps=1",
        "rollout.n=2",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "algorithm.drop_uniform_groups=true",
        "algorithm.guide_failed_groups=true",
        "actor.sft_loss_coef=1.0",
    )
    with PPOTrainer(config) as trainer:
        batch, metrics = trainer._generate_and_score(trainer._prompt_batches())
        compute_advantages(batch, trainer.config.algorithm, trainer.kl_ctrl)
        rows = trainer._actor_batch(batch)
    assert metrics["guidance/guided_group_frac"] == 1.0
    guided = batch.non_tensor_batch["guided"]
    assert guided.tolist() == [True, False] * 4
    advantages = batch.batch["advantages"][:, 0]
    assert torch.allclose(advantages[guided], torch.full((4,), 0.5**0.5), atol=1e-4)
    assert torch.allclose(advantages[~guided], torch.full((4,), -(0.5**0.5)), atol=1e-4)
    demonstration = rows.batch["sft_mask"].sum(-1) > 0
    assert len(rows) == 8 + 4 and int(demonstration.sum()) == 4
    assert rows.batch["response_mask"][demonstration].sum() == 0  # out of the policy loss


@pytest.mark.timeout(180)
def test_guidance_with_multi_turn_writes_a_demonstration_with_its_tool_results_masked(tmp_path):
    # calc with the tool: the random model writes no call, so every group gets the demonstration
    # trajectory of data.demonstration_key, scored like a sampled one, its tool result out of the mask.
    train, test = make_task_splits(
        "calc", tmp_path / "data", n_train=40, n_test=4, seed=0, num_digits=2, op="*"
    )
    demos = write_calc_demonstrations(
        train, tmp_path / "demos.parquet", TagFormat(), EOS_TEXT, "demonstration"
    )
    config = _inline_config(
        tmp_path,
        "calc-cpu",
        "trainer.total_steps=1",
        f"data.train_files=[{demos}]",
        f"data.val_files=[{test}]",
        "data.demonstration_key=demonstration",
        "algorithm.guide_failed_groups=true",
    )
    with PPOTrainer(config) as trainer:
        batch, metrics = trainer._generate_and_score(trainer._prompt_batches())
        trainer.fit()
    assert metrics["guidance/guided_group_frac"] == 1.0
    guided = batch.non_tensor_batch["guided"]
    scores = batch.batch["token_level_scores"].sum(-1)
    assert scores[guided].tolist() == [1.0] * 4
    width = batch.batch["prompts"].shape[1]
    for row in np.flatnonzero(guided):
        tokens = batch.batch["responses"][row]
        real = batch.batch["attention_mask"][row, width:].bool()
        model = batch.batch["response_mask"][row].bool()
        a, b = batch.non_tensor_batch["raw_prompt"][row].removesuffix("=").split("*")
        product = int(a) * int(b)
        observed = trainer.tokenizer.decode(tokens[real & ~model].tolist())
        assert observed == f"<result>{product}</result>"
        written = trainer.tokenizer.decode(tokens[model].tolist(), skip_special_tokens=True)
        assert written == f"<call>calc {a}*{b}</call>{product}"
    assert read_jsonl(trainer.run_dir / "metrics.jsonl")[-1]["guidance/guided_group_frac"] == 1.0


def test_sft_loss_adds_a_demonstration_row_per_prompt_and_trains_on_it(tmp_path):
    # A random model answers nothing right, so every advantage is 0 and the policy loss moves
    # nothing: what lowers the demonstrations' loss from step to step is the supervised term alone.
    config = _inline_config(
        tmp_path,
        "tiny-cpu",
        "trainer.total_steps=3",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "actor.sft_loss_coef=1.0",
        "actor.ppo_mini_batch_size=4",  # one mini-batch: no old_log_prob forward before the update
        "actor.lr=1e-2",
        "actor.lr_schedule=constant",
    )
    with PPOTrainer(config) as trainer:
        batch, metrics = trainer._generate_and_score(trainer._prompt_batches())
        compute_advantages(batch, trainer.config.algorithm, trainer.kl_ctrl)
        rows = trainer._actor_batch(batch)
        trainer.fit()
    assert metrics["reward/accuracy"] == 0.0
    sampled, demos = rows.slice(0, len(rows) - 4), rows.slice(len(rows) - 4)  # one worker: demos last
    assert not sampled.batch["sft_mask"].any()
    assert not demos.batch["response_mask"].any() and not demos.batch["advantages"].any()
    firsts = sorted(np.unique(batch.non_tensor_batch["uid"], return_index=True)[1].tolist())
    for i, row in enumerate(firsts):
        length = int(demos.batch["sft_mask"][i].sum())
        ids = demos.batch["responses"][i, :length].tolist()
        assert ids[-1] == trainer.tokenizer.eos_token_id
        assert trainer.tokenizer.decode(ids[:-1]) == batch.non_tensor_batch["ground_truth"][row]
        width = batch.batch["prompts"].shape[1]
        assert torch.equal(demos.batch["input_ids"][i, :width], batch.batch["prompts"][row])
    steps = [r for r in read_jsonl(trainer.run_dir / "metrics.jsonl") if "actor/pg_loss" in r]
    losses = [r["actor/sft_loss"] for r in steps]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses


def test_sft_loss_with_multi_turn_needs_a_demonstration_column(tmp_path):
    with pytest.raises(ValueError, match="actor.sft_loss_coef with rollout.multi_turn.enable=true needs"):
        _inline_config(tmp_path, "calc-cpu", "actor.sft_loss_coef=0.1").validate()
