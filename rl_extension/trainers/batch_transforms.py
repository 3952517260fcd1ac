"""Batch recipes as registered transforms: what the trainer does to a step's batch besides PPO itself.

A transform takes a batch and a ``BatchContext`` and returns the batch (the same one changed, or a
new one) and its metrics. It registers under a name, at one stage of the step, with the config test
that turns it on (its existing config key):

| stage    | the batch                                  | transforms, in the order applied            |
| -------- | ------------------------------------------ | ------------------------------------------- |
| "round"  | each generated batch, once scored          | guide_failed_groups                         |
| "step"   | the step's first round                     | dynamic_sampling                            |
| "update" | the step's batch, before the actor update  | drop_uniform_groups, sft_demonstrations     |

Within a stage transforms run in the order they were registered (a test holds the order above);
``apply_transforms(stage, batch, context)`` runs those the config turns on. Each is tested alone on
a small DataProto (tests/rl/test_batch_transforms.py):

    batch, metrics = apply_transforms("update", batch, BatchContext(config=config, tokenizer=tok, scored=batch))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rl_extension.agents.calc import tokenize_demonstration
from rl_extension.agents.formats import ToolCallFormat
from rl_extension.algorithms.core import failed_group_rows, informative_rows, pick_groups, uniform_groups
from rl_extension.config import PPOConfig
from rl_extension.registry import Registry
from rl_extension.roles.keys import FORWARD_KEYS
from rl_extension.roles.rollout import concat_rollouts, replace_responses
from spmdcall.data import DataProto

__all__ = [
    "BATCH_TRANSFORMS",
    "STAGES",
    "BatchContext",
    "BatchTransform",
    "apply_transforms",
    "register_batch_transform",
]

STAGES = ("round", "step", "update")
"""Where in the step a transform runs (see the module docstring)."""

Metrics = dict[str, float]


@dataclass(frozen=True, kw_only=True)
class BatchContext:
    """What a transform may use besides its batch; the trainer builds one (``sample`` and ``scored``
    for the stages that have them)."""

    config: PPOConfig
    """The run's configuration."""
    tokenizer: Any
    """The run's tokenizer: pad and eos ids, and the demonstrations' tokens."""
    ground_truth_key: str = "ground_truth"
    """The column holding the ground truth: the demonstration where the batch has no ``demonstration`` column."""
    tool_format: ToolCallFormat | None = None
    """With rollout.multi_turn, the tool-call format: demonstrations are trajectories, tool results masked."""
    score: Callable[[DataProto], Metrics] | None = None
    """Scores a batch again, in place (``token_level_scores``), as the trainer does after generation."""
    sample: Callable[[], tuple[DataProto, Metrics]] | None = None
    """Stage "step": generates and scores the next prompt batch ("round" transforms applied)."""
    scored: DataProto | None = None
    """Stage "update": the step's scored batch, every prompt of the step in it."""


@dataclass(frozen=True)
class BatchTransform:
    """A registered transform: its name, its stage, when it is on, and the function."""

    name: str
    stage: str
    enabled: Callable[[PPOConfig], bool]
    fn: Callable[[DataProto, BatchContext], tuple[DataProto, Metrics]]


BATCH_TRANSFORMS: Registry[BatchTransform] = Registry("batch transform")
"""Every batch transform by name, in the order they run within a stage."""


def register_batch_transform(
    name: str, *, stage: str, enabled: Callable[[PPOConfig], bool]
) -> Callable[[Callable[[DataProto, BatchContext], tuple[DataProto, Metrics]]], Any]:
    """Register ``fn(batch, context) -> (batch, metrics)`` as the transform ``name`` of ``stage``, run
    where ``enabled(config)``; it runs after the transforms of its stage registered before it.

    Example:
        >>> @register_batch_transform("no_op", stage="update", enabled=lambda config: False)
        ... def no_op(batch, context):
        ...     return batch, {}
        >>> BATCH_TRANSFORMS.pop("no_op").stage
        'update'
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r} of batch transform {name!r}; expected one of {STAGES}")

    def decorate(fn: Callable[[DataProto, BatchContext], tuple[DataProto, Metrics]]) -> Any:
        BATCH_TRANSFORMS.register(BatchTransform(name, stage, enabled, fn), name)
        return fn

    return decorate


def apply_transforms(stage: str, batch: DataProto, context: BatchContext) -> tuple[DataProto, Metrics]:
    """Run the transforms of ``stage`` that ``context.config`` turns on, in order; their metrics merged."""
    metrics: Metrics = {}
    for transform in BATCH_TRANSFORMS.values():
        if transform.stage == stage and transform.enabled(context.config):
            batch, more = transform.fn(batch, context)
            metrics |= more
    return batch, metrics


# -- the recipes -----------------------------------------------------------------------------------


@register_batch_transform(
    "guide_failed_groups", stage="round", enabled=lambda config: config.algorithm.guide_failed_groups
)
def guide_failed_groups(batch: DataProto, context: BatchContext) -> tuple[DataProto, Metrics]:
    """In each group where no sample scored 1.0, the first sample becomes the group's demonstration
    (marked in the ``guided`` column), and the batch is scored again; in place."""
    assert context.score is not None, "guidance scores the batch again"
    uid = batch.non_tensor_batch["uid"]
    failed = failed_group_rows(batch.batch["token_level_scores"].sum(-1), uid).tolist()
    rows, responses, masks = demonstrations(batch, failed, context)
    guided = np.zeros(len(batch), dtype=bool)
    guided[rows] = True
    batch.non_tensor_batch["guided"] = guided
    if rows:
        replace_responses(batch, rows, responses, context.tokenizer.pad_token_id, masks)
        context.score(batch)
    return batch, {"guidance/guided_group_frac": len(rows) / len(set(uid.tolist()))}


@register_batch_transform(
    "dynamic_sampling", stage="step", enabled=lambda config: config.algorithm.dynamic_sampling
)
def dynamic_sampling(batch: DataProto, context: BatchContext) -> tuple[DataProto, Metrics]:
    """DAPO's dynamic sampling: further prompt batches are sampled (``context.sample``) while fewer
    than data.train_batch_size groups scored unevenly, at most algorithm.max_sample_rounds batches in
    all, and the step keeps train_batch_size groups, informative ones first."""
    assert context.sample is not None, "dynamic sampling samples more rounds"
    num_groups, max_rounds = context.config.data.train_batch_size, context.config.algorithm.max_sample_rounds
    rounds, informative = [batch], _num_informative_groups(batch)
    while informative < num_groups and len(rounds) < max_rounds:
        more, _ = context.sample()  # the step reports its first round's metrics, with or without more
        rounds.append(more)
        informative += _num_informative_groups(more)
    batch = concat_rollouts(rounds, context.tokenizer.pad_token_id)
    keep = pick_groups(batch.batch["token_level_scores"].sum(-1), batch.non_tensor_batch["uid"], num_groups)
    return batch.select_idxs(keep), {
        "sampling/rounds": len(rounds),
        "sampling/informative_group_frac": min(informative, num_groups) / num_groups,
    }


@register_batch_transform(
    "drop_uniform_groups", stage="update", enabled=lambda config: config.algorithm.drop_uniform_groups
)
def drop_uniform_groups(batch: DataProto, context: BatchContext) -> tuple[DataProto, Metrics]:
    """Only the groups whose samples were rewarded unevenly go to the actor; uniform groups are put
    back until the rows split evenly over the workers, at least one mini-batch each."""
    workers = context.config.trainer.num_workers
    keep = informative_rows(
        batch.batch["token_level_rewards"].sum(-1),  # what the advantages come from (KL included)
        batch.non_tensor_batch["uid"],
        multiple_of=workers,  # equal shares: DP dispatch would pad with (double-counted) repeats
        min_rows=workers * context.config.num_actor_mini_batches,
    )
    return batch.select_idxs(keep), {}


@register_batch_transform(
    "sft_demonstrations", stage="update", enabled=lambda config: config.actor.sft_loss_coef > 0
)
def sft_demonstrations(batch: DataProto, context: BatchContext) -> tuple[DataProto, Metrics]:
    """``batch`` plus one row per prompt of the step (``context.scored``) whose response is the
    prompt's demonstration, for actor.sft_loss_coef's supervised term: ``sft_mask`` marks the tokens it
    reads (none of the sampled rows'), and every other column but the forward pass's inputs is 0 in
    them (response mask, advantages, log-probs), so the policy loss, KL and entropy leave them out. As
    many as split evenly over the workers, each worker's share of ``batch`` followed by its share of them."""
    assert context.scored is not None, "the demonstrations are the step's prompts'"
    scored, workers = context.scored, context.config.trainer.num_workers
    firsts = sorted(np.unique(scored.non_tensor_batch["uid"], return_index=True)[1].tolist())
    picked, responses, masks = demonstrations(scored, firsts, context)
    count = len(picked) - len(picked) % workers
    keys = list(batch.batch.keys())
    batch = batch.select()  # new columns stay off the caller's batch
    batch.batch["sft_mask"] = torch.zeros_like(batch.batch["response_mask"])
    if not count:
        return batch, {}
    demos = scored.select_idxs(picked[:count])  # a copy
    replace_responses(
        demos, list(range(count)), responses[:count], context.tokenizer.pad_token_id, masks[:count]
    )
    demos = demos.select(batch_keys=keys)
    demos.batch["sft_mask"] = demos.batch["response_mask"]
    for key in set(demos.batch.keys()) - {*FORWARD_KEYS, "sft_mask"}:
        demos.batch[key] = torch.zeros_like(demos.batch[key])
    return DataProto.concat([p for pair in zip(batch.chunk(workers), demos.chunk(workers)) for p in pair]), {}


# -- helpers ---------------------------------------------------------------------------------------


def demonstrations(
    batch: DataProto, rows: list[int], context: BatchContext
) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """The demonstrations of ``rows``' prompts written as responses: the rows whose demonstration
    fits the batch's response width, their token ids (then eos) and their response masks (a
    trajectory's tool results out). A demonstration is the ``demonstration`` column, else the ground
    truth; one longer than the width could not have been sampled either and is left out."""
    demos = batch.non_tensor_batch.get("demonstration")
    if demos is None:
        demos = batch.non_tensor_batch[context.ground_truth_key]
    tokenizer = context.tokenizer
    width, eos = batch.batch["responses"].shape[1], tokenizer.eos_token_id
    kept, responses, masks = [], [], []
    for row in rows:
        if context.tool_format is not None:
            ids, mask = tokenize_demonstration(tokenizer, str(demos[row]), context.tool_format)
        else:
            ids = tokenizer(str(demos[row]), add_special_tokens=False)["input_ids"]
            mask = [1] * len(ids)
        if len(ids) < width:  # with its eos
            kept.append(row)
            responses.append([*ids, eos])
            masks.append([*mask, 1])
    return kept, responses, masks


def _num_informative_groups(batch: DataProto) -> int:
    """Groups of a scored batch whose samples did not all score alike."""
    uid = batch.non_tensor_batch["uid"]
    uniform = uniform_groups(batch.batch["token_level_scores"].sum(-1), uid).numpy()
    return len(set(uid[~uniform].tolist()))
