"""The ``data`` section: prompt files (or a generated task) and batching."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rl_extension.config.ranges import NonNegativeInt, PositiveInt
from rl_extension.config.schema import Section

__all__ = ["DataConfig", "SyntheticDataConfig"]


@dataclass(kw_only=True)
class SyntheticDataConfig(Section):
    """A synthetic task written to the run dir when data.train_files is empty."""

    task: Literal["addition", "sorting", "calc"] = "addition"
    """Task name from rl_extension.data.prompts.TASKS; it is also the rows' data_source and scorer."""
    num_train: PositiveInt = 20000
    """Training prompts."""
    num_val: NonNegativeInt = 256
    """Held-out prompts (none of them is in the training split)."""
    task_kwargs: dict = field(default_factory=lambda: {"num_digits": 3})
    """Task options: num_digits for addition and calc, num_items for sorting."""
    seed: NonNegativeInt = 0
    """Seed of the generated prompts."""


@dataclass(kw_only=True)
class DataConfig(Section):
    """Prompt files and batching."""

    train_files: list[str] = field(default_factory=list)
    """Parquet/jsonl training prompts; empty means generate data.synthetic into the run dir."""
    val_files: list[str] = field(default_factory=list)
    """Parquet/jsonl held-out prompts for validation; empty means none (or data.synthetic's)."""
    prompt_key: str = "prompt"
    """Column with the prompt (a string, or a list of chat messages)."""
    answer_key: str = "answer"
    """Column with the ground truth; dotted for nested columns (reward_model.ground_truth)."""
    data_source_key: str = "data_source"
    """Column naming each row's task; picks the scorer when reward.scorer is empty."""
    demonstration_key: str = ""
    """Column of the training prompts with a demonstration, the response an expert writes (with
    multi-turn rollouts the whole trajectory in the tool-call format, tool results included), for
    algorithm.guide_failed_groups and actor.sft_loss_coef; empty: the ground truth is the
    demonstration."""
    max_prompt_length: PositiveInt = 512
    """Longest prompt in tokens; longer ones are dropped (see filter_overlong)."""
    filter_overlong: bool = True
    """Drop overlong prompts; false keeps their last max_prompt_length tokens."""
    pad_to_max_length: bool = False
    """Left-pad every batch to max_prompt_length (fixed shapes); false pads to the batch's longest prompt."""
    apply_chat_template: bool = False
    """Format prompts with the tokenizer's chat template (instruct models)."""
    train_batch_size: PositiveInt = 32
    """Prompts per training step (each sampled rollout.n times)."""
    val_batch_size: NonNegativeInt = 0
    """Prompts per validation call; 0 sends the whole held-out set at once."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (seeded by trainer.seed)."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    """The generated task used when train_files is empty."""
