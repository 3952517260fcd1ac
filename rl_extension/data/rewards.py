"""Rule-based rewards for a batch: the manager that decodes each response and grades it with a scorer.

The scorers themselves (one response string against its ground truth) and their registry,
``@register_scorer``, are in ``rl_extension.data.scorers``; ``get_scorer`` is there too (also importable
from here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rl_extension.algorithms.core import uniform_group_fraction
from rl_extension.config import RewardConfig
from rl_extension.data.scorers import Scorer, get_scorer
from rl_extension.roles.keys import SCORE_KEYS
from spmdcall.data import DataProto

__all__ = ["RewardManager", "RewardResult", "get_scorer", "score_batch"]


@dataclass
class RewardResult:
    """What `RewardManager` returns for a batch of n responses of width response_len.

    Attributes:
        token_level_scores: (n, response_len) float32; each row's score on its last valid
            response token, zeros elsewhere (the layout the advantage estimators expect).
        scores: (n,) float32, the sequence scores.
        accuracy: (n,) float32, 1.0 where the score is exactly 1.0.
        data_sources: (n,) object array of the rows' data_source ("unknown" if the batch has none).
        responses: the decoded responses, if asked for; else None.
    """

    token_level_scores: torch.Tensor
    scores: torch.Tensor
    accuracy: torch.Tensor
    data_sources: np.ndarray
    responses: list[str] | None = None

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Batch means: `<prefix>score`, `<prefix>accuracy`, and `<prefix>accuracy/<data_source>`.

        Args:
            prefix: prepended to every name ("val/" for validation, say).
        """
        out = {f"{prefix}score": self.scores.mean().item(), f"{prefix}accuracy": self.accuracy.mean().item()}
        for source in sorted(set(self.data_sources.tolist())):
            rows = torch.from_numpy(self.data_sources == source)
            out[f"{prefix}accuracy/{source}"] = self.accuracy[rows].mean().item()
        return out


class RewardManager:
    """Decode each response of a batch, score it against its ground truth, place the score.

    The batch is a DataProto with tensors `responses` (n, response_len) token ids, right padded,
    and `response_mask` (n, response_len) — or, without it, `attention_mask` over prompt and
    response, whose last response_len columns are used — plus numpy columns `ground_truth` and,
    when no scorer is given, `data_source`. A response is decoded up to its last valid token,
    special tokens skipped. A response with no valid token still gets a score in `scores`, but
    no token carries it.

    Args:
        tokenizer: the tokenizer that produced the response ids.
        scorer: a scorer function, a name for `get_scorer` (built-in or "module:function"), or
            None to grade each row with the scorer named by its data_source.
        ground_truth_key: the numpy column with ground truths.
        data_source_key: the numpy column with data sources.

    Example:
        >>> manager = RewardManager(tokenizer, "arithmetic")
        >>> result = manager(batch, return_responses=True)
        >>> batch.batch["token_level_scores"] = result.token_level_scores
    """

    def __init__(
        self,
        tokenizer: Any,
        scorer: str | Scorer | None = None,
        *,
        ground_truth_key: str = "ground_truth",
        data_source_key: str = "data_source",
    ) -> None:
        self.tokenizer = tokenizer
        self.scorer = get_scorer(scorer) if isinstance(scorer, str) else scorer
        self.ground_truth_key = ground_truth_key
        self.data_source_key = data_source_key
        self._scorers_by_source: dict[str, Scorer] = {}

    def __call__(self, data: DataProto, return_responses: bool = False) -> RewardResult:
        """Score every row of `data`.

        Args:
            data: the batch described in the class docstring.
            return_responses: keep the decoded strings in the result (for logging samples).
        """
        if data.batch is None or "responses" not in data.batch.keys():
            raise ValueError("the batch has no 'responses' tensor to score")
        responses = data.batch["responses"]
        num_rows, response_len = responses.shape
        mask = self._response_mask(data, response_len).bool()
        # Index of each row's last valid token; -1 for a row with none.
        positions = torch.arange(response_len).expand(num_rows, -1)
        last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values

        if self.ground_truth_key not in data.non_tensor_batch:
            raise ValueError(
                f"the batch has no {self.ground_truth_key!r} column "
                f"(non-tensor columns: {sorted(data.non_tensor_batch)})"
            )
        ground_truths = data.non_tensor_batch[self.ground_truth_key]
        if self.data_source_key in data.non_tensor_batch:
            data_sources = np.asarray(data.non_tensor_batch[self.data_source_key], dtype=object)
        elif self.scorer is None:
            raise ValueError(
                f"no scorer given and the batch has no {self.data_source_key!r} column to pick one"
            )
        else:
            data_sources = np.full(num_rows, "unknown", dtype=object)

        texts = self.tokenizer.batch_decode(
            [responses[i, : int(last[i]) + 1].tolist() for i in range(num_rows)], skip_special_tokens=True
        )
        scores = torch.zeros(num_rows, dtype=torch.float32)
        for i, text in enumerate(texts):
            scorer = self.scorer or self._scorer_for(str(data_sources[i]))
            value = scorer(text, str(ground_truths[i]))
            if not isinstance(value, (int, float, bool, np.number)):
                raise TypeError(f"scorer {scorer!r} returned {type(value).__name__}, expected a float")
            scores[i] = float(value)

        token_level_scores = torch.zeros(num_rows, response_len, dtype=torch.float32)
        has_tokens = last >= 0
        token_level_scores[has_tokens, last[has_tokens]] = scores[has_tokens]
        return RewardResult(
            token_level_scores=token_level_scores,
            scores=scores,
            accuracy=(scores == 1.0).float(),
            data_sources=data_sources,
            responses=texts if return_responses else None,
        )

    def _scorer_for(self, data_source: str) -> Scorer:
        # Looked up once per data source: a "module:function" name imports a module.
        if data_source not in self._scorers_by_source:
            self._scorers_by_source[data_source] = get_scorer(data_source)
        return self._scorers_by_source[data_source]

    @staticmethod
    def _response_mask(data: DataProto, response_len: int) -> torch.Tensor:
        keys = data.batch.keys()
        if "response_mask" in keys:
            mask = data.batch["response_mask"]
        elif "attention_mask" in keys:
            mask = data.batch["attention_mask"][:, -response_len:]
        else:
            raise ValueError("the batch needs 'response_mask' or 'attention_mask' to find response lengths")
        if tuple(mask.shape) != (data.batch["responses"].shape[0], response_len):
            raise ValueError(
                f"response mask has shape {tuple(mask.shape)}, responses have "
                f"{tuple(data.batch['responses'].shape)}"
            )
        return mask


def score_batch(
    batch: DataProto, cfg: RewardConfig, rules: RewardManager, reward_model: Any | None, grouped: bool
) -> dict[str, float]:
    """A generated batch's ``token_level_scores``, in place: reward.rule_weight times the rule-based
    scores (in the controller) plus reward.model_weight times the reward model's. Returns the
    ``reward/`` metrics.

    Args:
        batch: a ``generate`` output with the ``ground_truth`` (and ``uid``, if ``grouped``) columns.
        cfg: the run's reward section.
        rules: the rule-based scorer.
        reward_model: the reward model's group (``compute_rm_score``), or None.
        grouped: the batch holds groups of samples per prompt (``uid``): report the uniform ones' share.
    """
    metrics = {}
    scores = torch.zeros(batch.batch["responses"].shape, dtype=torch.float32)
    if cfg.rule_weight:
        result = rules(batch)
        scores += cfg.rule_weight * result.token_level_scores
        metrics |= result.metrics(prefix="reward/rule_") | {"reward/accuracy": result.accuracy.mean().item()}
    if reward_model is not None:
        only = batch.select(batch_keys=SCORE_KEYS, non_tensor_batch_keys=[])  # what the call reads travels
        rm = reward_model.compute_rm_score(only).batch["rm_scores"]
        scores += cfg.model_weight * rm
        metrics["reward/model_score"] = rm.sum(-1).mean().item()
    batch.batch["token_level_scores"] = scores
    metrics["reward/score"] = scores.sum(-1).mean().item()
    if grouped:
        # Groups whose samples all score alike (all right or all wrong) give GRPO nothing to learn from.
        metrics["reward/uniform_group_frac"] = uniform_group_fraction(
            scores.sum(-1), batch.non_tensor_batch["uid"]
        )
    return metrics
