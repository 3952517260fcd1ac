"""Rule-based rewards: scorers that grade one response string, and the manager that grades a batch.

A scorer is any function `(response: str, ground_truth: str) -> float`; 1.0 means correct.
Built-in scorers are found by name (`get_scorer("gsm8k")`); the names include the synthetic
tasks of `rl_extension.data`, so a batch can be graded row by row by its `data_source`.

Bringing your own reward function: write a function with that signature in a module or file,

    # my_rewards.py
    def length_penalised(response: str, ground_truth: str) -> float:
        return float(response.strip() == ground_truth) - 0.001 * len(response)

and pass `"my_rewards:length_penalised"` (module importable from the workers' sys.path) or
`"/abs/path/my_rewards.py:length_penalised"` wherever a scorer name is accepted
(`get_scorer`, `RewardManager`). Extra keyword arguments given to `get_scorer` are bound with
`functools.partial`, e.g. `get_scorer("gsm8k", format_score=0.1)`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spmdcall.data import DataProto

__all__ = [
    "SCORERS",
    "RewardManager",
    "RewardResult",
    "Scorer",
    "arithmetic_score",
    "calc_score",
    "exact_match_score",
    "extract_gsm8k_answer",
    "get_scorer",
    "gsm8k_score",
    "sorting_score",
]

Scorer = Callable[[str, str], float]

# A number: optional minus, digits with optional thousands commas ("1,234"), optional decimals.
# Commas must group exactly three digits, so "3,4" reads as two numbers, not 34.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_GSM8K_ANSWER_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_INTEGER_RE = re.compile(r"-?\d+")


def _to_float(number: str) -> float:
    return float(number.replace(",", ""))


def exact_match_score(response: str, ground_truth: str) -> float:
    """1.0 if the response equals the ground truth up to whitespace, else 0.0.

    Runs of whitespace count as one space; leading and trailing whitespace is ignored.

    Args:
        response: the decoded model response.
        ground_truth: the expected text.

    Example:
        >>> exact_match_score("  12  15\\n", "12 15")
        1.0
    """
    return float(" ".join(response.split()) == " ".join(ground_truth.split()))


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last `####` in `text`, commas removed; None if there is none.

    Args:
        text: a GSM8K solution or a model response ("... #### 1,234").

    Example:
        >>> extract_gsm8k_answer("She pays 3 * 6 = 18 dollars.\\n#### -1,234.")
        '-1234'
    """
    matches = _GSM8K_ANSWER_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def gsm8k_score(response: str, ground_truth: str, format_score: float = 0.0) -> float:
    """GSM8K grading: the `#### <number>` answer of the response equals the ground truth.

    Args:
        response: the decoded model response; its answer must follow `####`.
        ground_truth: a bare number ("72", "1,234") or a full GSM8K solution ending in `#### 72`.
        format_score: given for a `####` answer that is wrong (0.0: only correct answers count).

    Example:
        >>> gsm8k_score("48 + 24 = 72\\n#### 72", "#### 72"), gsm8k_score("#### 71", "72", format_score=0.1)
        (1.0, 0.1)
    """
    predicted = extract_gsm8k_answer(response)
    if predicted is None:
        return 0.0
    expected = extract_gsm8k_answer(ground_truth) if "####" in ground_truth else ground_truth.strip()
    try:
        correct = _to_float(predicted) == _to_float(expected)
    except ValueError:  # a ground truth that is not a number cannot be matched
        correct = False
    return 1.0 if correct else format_score


def arithmetic_score(response: str, ground_truth: str, format_score: float = 0.0) -> float:
    """1.0 if the first number in the response equals the ground truth number.

    Only the first number counts, so a model that keeps generating after its answer
    ("579 and then 12") is still graded on its answer.

    Args:
        response: the decoded model response.
        ground_truth: the expected number as text ("579").
        format_score: given when the response has a number but the wrong one.

    Example:
        >>> arithmetic_score(" 579<junk>", "579"), arithmetic_score("578", "579", format_score=0.1)
        (1.0, 0.1)
    """
    match = _NUMBER_RE.search(response)
    if match is None:
        return 0.0
    return 1.0 if _to_float(match.group()) == _to_float(ground_truth.strip()) else format_score


def sorting_score(
    response: str, ground_truth: str, format_score: float = 0.0, partial_credit: bool = False
) -> float:
    """1.0 if the integers in the response are exactly the ground truth's, in the same order.

    Args:
        response: the decoded model response ("12 15 23").
        ground_truth: the sorted numbers separated by spaces.
        format_score: given when the response has the right count of numbers, wrongly ordered.
        partial_credit: instead score the fraction of positions that hold the right number
            (over the longer of the two lists), a denser signal for a hard task; still 1.0
            only for an exact match.

    Example:
        >>> sorting_score("12 15 23", "12 15 23"), sorting_score("12 23 15 40", "12 15 23", partial_credit=True)
        (1.0, 0.25)
    """
    predicted = [int(x) for x in _INTEGER_RE.findall(response)]
    expected = [int(x) for x in _INTEGER_RE.findall(ground_truth)]
    if predicted == expected:
        return 1.0
    score = format_score if len(predicted) == len(expected) else 0.0
    if partial_credit and predicted:
        hits = sum(p == e for p, e in zip(predicted, expected))
        score = max(score, hits / max(len(predicted), len(expected)))
    return score


def calc_score(response: str, ground_truth: str, tool_call_penalty: float = 0.0) -> float:
    """The calc task: 1.0 if what the response says after its last tool result is the ground truth.

    The model's own answer counts, not the tool's: a response that stops after the result scores 0.
    Optionally ``tool_call_penalty`` is taken off per tool call (a reward over the whole trajectory;
    a right answer then scores below 1.0, which `RewardResult.accuracy` does not count).

    Args:
        response: the decoded trajectory: the model's turns and the tool results between them.
        ground_truth: the expected number as text.
        tool_call_penalty: subtracted once per ``<call>`` / ``<tool_call>`` in the response.

    Example:
        >>> calc_score("<call>calc 1+2</call><result>3</result>3", "3")
        1.0
    """
    from rl_extension.agents.formats import final_answer  # the agents package imports this module

    score = exact_match_score(final_answer(response), ground_truth)
    calls = response.count("<call>") + response.count("<tool_call>")
    return score - tool_call_penalty * calls


# Name -> scorer. Task names from rl_extension.data ("addition", "sorting") and verl's GSM8K
# data_source ("openai/gsm8k") are included so rows can be graded by their data_source.
SCORERS: dict[str, Scorer] = {
    "exact_match": exact_match_score,
    "arithmetic": arithmetic_score,
    "addition": arithmetic_score,
    "gsm8k": gsm8k_score,
    "openai/gsm8k": gsm8k_score,
    "sorting": sorting_score,
    "calc": calc_score,
}


def get_scorer(name: str, **kwargs: Any) -> Scorer:
    """Look a scorer up by name, or import a user function given as "module:function".

    Args:
        name: a key of `SCORERS`, "package.module:function", or "/path/to/file.py:function".
        **kwargs: bound to the scorer with functools.partial (e.g. format_score=0.1).

    Example:
        >>> get_scorer("sorting", partial_credit=True)("12 40", "12 15")
        0.5
    """
    if ":" in name:
        scorer = _load_user_function(name)
    elif name in SCORERS:
        scorer = SCORERS[name]
    else:
        raise ValueError(
            f"unknown scorer {name!r}; valid names: {sorted(SCORERS)}, "
            "or 'module.path:function_name' for your own"
        )
    return functools.partial(scorer, **kwargs) if kwargs else scorer


def _load_user_function(spec: str) -> Scorer:
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise ValueError(f"reward function {spec!r} must look like 'module.path:function_name'")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"reward function file {path} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"{module_name} has no function {function_name!r}")
    return function


@dataclass
class RewardResult:
    """What `RewardManager` returns for a batch of n responses of width response_len.

    Attributes:
        token_level_scores: (n, response_len) float32; each row's score on its last valid
            response token, zeros elsewhere (the layout `algorithms` expects).
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
