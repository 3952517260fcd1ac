"""Scorers, the scorer registry and RewardManager (CPU, fast, no processes).

Run: python -m pytest tests/rl/test_rewards.py -q
"""

import numpy as np
import pytest
import torch

from rl_extension.data.rewards import RewardManager
from rl_extension.data.scorers import (
    SCORERS,
    arithmetic_score,
    exact_match_score,
    extract_gsm8k_answer,
    get_scorer,
    gsm8k_score,
    sorting_score,
)
from rl_extension.models import build_tiny_tokenizer
from spmdcall.data import DataProto


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


# ---------------------------------------------------------------- scorers
def test_exact_match():
    assert exact_match_score("12 15 23", "12 15 23") == 1.0
    assert exact_match_score("  12\t15 \n 23\n", "12 15 23") == 1.0
    assert exact_match_score("12 15 24", "12 15 23") == 0.0
    assert exact_match_score("1215", "12 15") == 0.0


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("#### 1,234,567.", "1234567"),
        ("####-5", "-5"),
        ("so the loss is #### -1,000", "-1000"),
        ("#### $18", "18"),
        ("#### 3.75", "3.75"),
        ("#### 12\nwait, no\n#### 13", "13"),  # the last answer counts
        ("The answer is 72", None),
        ("#### seventy", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_gsm8k_score():
    solution = "She has 16 - 3 - 4 = 9 eggs and makes 9 * 2 = $18.\n#### 18"
    assert gsm8k_score("9 eggs, 9 * 2 = 18\n#### 18", solution) == 1.0
    assert gsm8k_score("#### 18.00", "18") == 1.0
    assert gsm8k_score("#### 1,000", "1000") == 1.0
    assert gsm8k_score("#### -7", "-7") == 1.0
    assert gsm8k_score("#### 17", solution) == 0.0
    assert gsm8k_score("#### 17", solution, format_score=0.1) == 0.1
    assert gsm8k_score("18", solution, format_score=0.1) == 0.0  # no #### answer: no format credit
    assert gsm8k_score("#### 18", "eighteen") == 0.0


def test_arithmetic_score():
    assert arithmetic_score("579", "579") == 1.0
    assert arithmetic_score(" 579 then 12+3=15", "579") == 1.0  # only the first number counts
    assert arithmetic_score("-12", "-12") == 1.0
    assert arithmetic_score("1,234", "1234") == 1.0
    assert arithmetic_score("12 579", "579") == 0.0
    assert arithmetic_score("578", "579", format_score=0.1) == 0.1
    assert arithmetic_score("no idea", "579", format_score=0.1) == 0.0
    assert arithmetic_score("", "579") == 0.0


def test_sorting_score():
    assert sorting_score("12 15 23", "12 15 23") == 1.0
    assert sorting_score(" 12  15 23\n", "12 15 23") == 1.0
    assert sorting_score("15 12 23", "12 15 23") == 0.0
    assert sorting_score("15 12 23", "12 15 23", format_score=0.1) == 0.1
    assert sorting_score("12 15", "12 15 23", format_score=0.1) == 0.0
    assert sorting_score("12 23 15 40", "12 15 23", partial_credit=True) == 0.25
    assert sorting_score("12 15 99", "12 15 23", partial_credit=True) == pytest.approx(2 / 3)
    assert sorting_score("", "12 15 23", partial_credit=True) == 0.0


# ---------------------------------------------------------------- registry
def test_get_scorer_by_name_and_kwargs():
    assert get_scorer("gsm8k") is gsm8k_score
    assert get_scorer("addition") is arithmetic_score and get_scorer("sorting") is sorting_score
    assert get_scorer("arithmetic", format_score=0.5)("1", "2") == 0.5
    with pytest.raises(ValueError) as info:
        get_scorer("math500")
    for name in SCORERS:
        assert name in str(info.value)


def test_get_scorer_loads_user_functions(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def shout(response, ground_truth, bonus=0.0):\n"
        "    return float(response.upper() == ground_truth) + bonus\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_scorer("my_rewards:shout")("abc", "ABC") == 1.0
    assert get_scorer(f"{tmp_path}/my_rewards.py:shout", bonus=0.5)("abc", "x") == 0.5
    with pytest.raises(ValueError, match="no function 'whisper'"):
        get_scorer("my_rewards:whisper")
    with pytest.raises(ValueError, match="does not exist"):
        get_scorer(f"{tmp_path}/missing.py:shout")
    with pytest.raises(ModuleNotFoundError):
        get_scorer("no_such_module_xyz:shout")


# ---------------------------------------------------------------- reward manager
def _response_batch(tokenizer, texts, ground_truths, width=8, data_sources=None, use_attention_mask=False):
    """Right-padded responses, each closed by eos when there is room, like a rollout's output."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    responses = torch.full((len(texts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(texts), width), dtype=torch.long)
    for row, text in enumerate(texts):
        ids = (tokenizer(text)["input_ids"] + [eos])[:width]
        responses[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[row, : len(ids)] = 1
    non_tensors = {"ground_truth": np.array(ground_truths, dtype=object)}
    if data_sources is not None:
        non_tensors["data_source"] = np.array(data_sources, dtype=object)
    if use_attention_mask:
        prompt = torch.ones((len(texts), 3), dtype=torch.long)
        tensors = {"responses": responses, "attention_mask": torch.cat([prompt, mask], dim=1)}
    else:
        tensors = {"responses": responses, "response_mask": mask}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors), mask


@pytest.mark.parametrize("use_attention_mask", [False, True])
def test_reward_manager_puts_the_score_on_the_last_valid_token(tokenizer, use_attention_mask):
    texts = ["579", "57", "12345678", "", "5790"]
    batch, mask = _response_batch(
        tokenizer, texts, ["579", "579", "12345678", "1", "5790"], use_attention_mask=use_attention_mask
    )
    result = RewardManager(tokenizer, "exact_match")(batch, return_responses=True)

    # Lengths with eos: 4, 3, 8 (eos cut off), 1 (eos only), 5.
    assert mask.sum(dim=1).tolist() == [4, 3, 8, 1, 5]
    assert result.scores.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert result.accuracy.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert result.responses == texts  # special tokens (eos) skipped
    expected = torch.zeros(5, 8)
    expected[0, 3] = expected[2, 7] = expected[4, 4] = 1.0
    assert torch.equal(result.token_level_scores, expected)
    assert result.token_level_scores.dtype == torch.float32


def test_reward_manager_rows_without_tokens_and_without_text(tokenizer):
    batch, _ = _response_batch(tokenizer, ["7", "7"], ["7", "7"])
    batch.batch["response_mask"][1] = 0  # an empty response: scored, but on no token
    result = RewardManager(tokenizer, get_scorer("arithmetic"))(batch)
    assert result.responses is None
    assert result.scores.tolist() == [1.0, 0.0]
    assert result.token_level_scores.sum(dim=1).tolist() == [1.0, 0.0]


def test_reward_manager_picks_scorers_by_data_source(tokenizer):
    batch, _ = _response_batch(
        tokenizer,
        ["579x", "12 15", "#### 7"],
        ["579", "12 15", "7"],
        width=10,
        data_sources=["addition", "sorting", "openai/gsm8k"],
    )
    result = RewardManager(tokenizer)(batch)
    assert result.scores.tolist() == [1.0, 1.0, 1.0]
    assert result.metrics(prefix="val/") == {
        "val/score": 1.0,
        "val/accuracy": 1.0,
        "val/accuracy/addition": 1.0,
        "val/accuracy/openai/gsm8k": 1.0,
        "val/accuracy/sorting": 1.0,
    }
    unknown, _ = _response_batch(tokenizer, ["1"], ["1"], data_sources=["mystery"])
    with pytest.raises(ValueError, match="unknown scorer 'mystery'"):
        RewardManager(tokenizer)(unknown)


def test_reward_manager_metrics_and_errors(tokenizer):
    batch, _ = _response_batch(tokenizer, ["1", "2", "3", "9"], ["1", "2", "3", "4"])
    result = RewardManager(tokenizer, "arithmetic")(batch)
    metrics = result.metrics()
    assert metrics["reward/accuracy"] == 0.75 and metrics["reward/accuracy/unknown"] == 0.75

    with pytest.raises(ValueError, match="no 'answer' column"):
        RewardManager(tokenizer, "arithmetic", ground_truth_key="answer")(batch)
    with pytest.raises(ValueError, match="no scorer given"):
        RewardManager(tokenizer)(batch)
    with pytest.raises(TypeError, match="expected a float"):
        RewardManager(tokenizer, lambda response, truth: "yes")(batch)
    no_mask = DataProto.from_dict(
        tensors={"responses": batch.batch["responses"]},
        non_tensors={"ground_truth": batch.non_tensor_batch["ground_truth"]},
    )
    with pytest.raises(ValueError, match="response_mask"):
        RewardManager(tokenizer, "arithmetic")(no_mask)
