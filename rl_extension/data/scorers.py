"""Rule-based scorers: functions that grade one response string, and their registry.

A scorer is any function ``(response: str, ground_truth: str) -> float``; 1.0 means correct.
``@register_scorer(name, *aliases)`` makes one findable by name wherever a scorer is accepted
(``reward.scorer``, ``eval_scorer``, ``get_scorer``); the built-in names include the synthetic tasks
of ``rl_extension.data.prompts`` and verl's GSM8K ``data_source``, so a batch can be graded row by row by its
``data_source``:

    from rl_extension.data.scorers import register_scorer

    @register_scorer("length_penalised")
    def length_penalised(response: str, ground_truth: str) -> float:
        return float(response.strip() == ground_truth) - 0.001 * len(response)

then ``reward.scorer=length_penalised`` once the module is imported. A function in a module or file
may also be named without registering it: ``"my_rewards:length_penalised"`` (importable from the
workers' sys.path) or ``"/abs/path/my_rewards.py:length_penalised"``. Extra keyword arguments given
to ``get_scorer`` (``reward.scorer_kwargs``) are bound with ``functools.partial``, e.g.
``get_scorer("gsm8k", format_score=0.1)``.

Only the standard library loads here, so the config checks a scorer's name before torch is imported.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from rl_extension.registry import Registry
from rl_extension.user_code import load_function

__all__ = [
    "SCORERS",
    "Scorer",
    "arithmetic_score",
    "calc_score",
    "exact_match_score",
    "extract_gsm8k_answer",
    "get_scorer",
    "gsm8k_score",
    "register_scorer",
    "sorting_score",
]

Scorer = Callable[[str, str], float]

SCORERS: Registry[Scorer] = Registry(
    "scorer", "valid names: {names}, or 'module.path:function_name' for your own"
)
"""The registry: scorer name -> function. ``@register_scorer`` adds to it."""


def register_scorer(name: str, *aliases: str) -> Callable[[Scorer], Scorer]:
    """Register a scorer under ``name`` (and ``aliases``, e.g. a dataset's ``data_source``).

    Registering a name again replaces the earlier function (re-running a module re-registers).

    Args:
        name: what ``reward.scorer`` (or a row's ``data_source``) says to pick it.
        *aliases: further names for the same function.

    Returns:
        A decorator that registers the function and returns it unchanged.

    Example:
        >>> @register_scorer("starts_right")
        ... def starts_right(response: str, ground_truth: str) -> float:
        ...     return float(response.startswith(ground_truth))
        >>> get_scorer("starts_right")("12 and more", "12")
        1.0
    """

    def decorator(fn: Scorer) -> Scorer:
        return SCORERS.register(fn, name, *aliases)

    return decorator


def get_scorer(name: str, **kwargs: Any) -> Scorer:
    """Look a scorer up by name, or import a user function given as "module:function".

    Args:
        name: a registered name (see `SCORERS`), "package.module:function", or "/path/to/file.py:function".
        **kwargs: bound to the scorer with functools.partial (e.g. format_score=0.1).

    Raises:
        ValueError: an unknown name, naming the registered ones.

    Example:
        >>> get_scorer("sorting", partial_credit=True)("12 40", "12 15")
        0.5
    """
    scorer = load_function(name, "reward function") if ":" in name else SCORERS.lookup(name)
    return functools.partial(scorer, **kwargs) if kwargs else scorer


# A number: optional minus, digits with optional thousands commas ("1,234"), optional decimals.
# Commas must group exactly three digits, so "3,4" reads as two numbers, not 34.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_GSM8K_ANSWER_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_INTEGER_RE = re.compile(r"-?\d+")


def _to_float(number: str) -> float:
    return float(number.replace(",", ""))


@register_scorer("exact_match")
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


@register_scorer("gsm8k", "openai/gsm8k")
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


@register_scorer("arithmetic", "addition")
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


@register_scorer("sorting")
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


@register_scorer("calc")
def calc_score(response: str, ground_truth: str, tool_call_penalty: float = 0.0) -> float:
    """The calc task: 1.0 if what the response says after its last tool result is the ground truth.

    The model's own answer counts, not the tool's: a response that stops after the result scores 0.
    Optionally ``tool_call_penalty`` is taken off per tool call (a reward over the whole trajectory;
    a right answer then scores below 1.0, which `RewardResult.accuracy` does not count).

    Args:
        response: the decoded trajectory: the model's turns and the tool results between them.
        ground_truth: the expected number as text.
        tool_call_penalty: subtracted once per tool call the response writes, in any registered
            tool-call format (``<call>``, ``<tool_call>``, ...).

    Example:
        >>> calc_score("<call>calc 1+2</call><result>3</result>3", "3")
        1.0
    """
    # Imported here: the agents package loads torch, and the config reads this module before it.
    from rl_extension.agents.formats import count_calls, final_answer

    return exact_match_score(final_answer(response), ground_truth) - tool_call_penalty * count_calls(response)
