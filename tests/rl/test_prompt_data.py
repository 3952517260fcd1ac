"""Synthetic tasks, PromptDataset and PromptLoader (CPU, fast, no processes).

Run: python -m pytest tests/rl/test_data.py -q
"""

import json
import logging

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from rl_extension.data.prompts import (
    PromptDataset,
    PromptLoader,
    make_addition_dataset,
    make_sorting_dataset,
    make_task_splits,
)
from rl_extension.models import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def addition_file(tmp_path_factory):
    return make_addition_dataset(tmp_path_factory.mktemp("data") / "add.parquet", n=50, num_digits=2, seed=0)


def _rows(path):
    return pq.read_table(path).to_pylist()


# ---------------------------------------------------------------- synthetic tasks
def test_addition_rows_are_correct_and_deterministic(tmp_path):
    a = _rows(make_addition_dataset(tmp_path / "a.parquet", n=200, seed=1))
    b = _rows(make_addition_dataset(tmp_path / "b.parquet", n=200, seed=1))
    c = _rows(make_addition_dataset(tmp_path / "c.parquet", n=200, seed=2))
    assert a == b and a != c
    assert len({row["prompt"] for row in a}) == 200
    for row in a:
        x, y = row["prompt"].removesuffix("=").split("+")
        assert row["answer"] == str(int(x) + int(y)) and 100 <= int(x) <= 999 and 100 <= int(y) <= 999
        assert row["data_source"] == "addition"


@pytest.mark.parametrize("num_digits,low,high", [(1, 0, 9), (2, 10, 99), (4, 1000, 9999)])
def test_addition_operands_have_num_digits_digits(tmp_path, num_digits, low, high):
    rows = _rows(make_addition_dataset(tmp_path / "a.parquet", n=90, num_digits=num_digits, seed=3))
    operands = [int(x) for row in rows for x in row["prompt"].removesuffix("=").split("+")]
    assert all(low <= x <= high for x in operands)
    quarter = (high - low) // 4  # operands come from the whole range, not one end of it
    assert min(operands) < low + quarter and max(operands) > high - quarter


def test_sorting_rows_are_sorted_and_long(tmp_path, tokenizer):
    rows = _rows(make_sorting_dataset(tmp_path / "s.parquet", n=50, seed=0))
    assert rows == _rows(make_sorting_dataset(tmp_path / "s2.parquet", n=50, seed=0))
    for row in rows:
        numbers = [int(x) for x in row["prompt"].removeprefix("sort: ").removesuffix(" =").split()]
        assert len(numbers) == 12 and all(10 <= x <= 99 for x in numbers)
        assert row["answer"] == " ".join(map(str, sorted(numbers)))
        assert len(tokenizer(row["answer"])["input_ids"]) >= 32
        assert row["data_source"] == "sorting"


@pytest.mark.parametrize("task,kwargs", [("addition", {"num_digits": 1}), ("sorting", {"num_items": 4})])
def test_task_splits_do_not_overlap(tmp_path, task, kwargs):
    train, test = make_task_splits(task, tmp_path / task, n_train=60, n_test=20, seed=5, **kwargs)
    train_prompts = [r["prompt"] for r in _rows(train)]
    test_prompts = [r["prompt"] for r in _rows(test)]
    assert (len(train_prompts), len(test_prompts)) == (60, 20)
    assert not set(train_prompts) & set(test_prompts)
    again = make_task_splits(task, tmp_path / "again", n_train=60, n_test=20, seed=5, **kwargs)
    assert [_rows(p) for p in again] == [_rows(train), _rows(test)]


@pytest.mark.parametrize("op", ["+", "*"])
def test_calc_rows_add_or_multiply_two_operands(tmp_path, op):
    train, _ = make_task_splits("calc", tmp_path, n_train=40, n_test=5, seed=1, num_digits=4, op=op)
    for row in _rows(train):
        a, b = (int(x) for x in row["prompt"].removesuffix("=").split(op))
        assert 1000 <= a <= 9999 and 1000 <= b <= 9999
        assert row["answer"] == str(a + b if op == "+" else a * b)
        assert row["data_source"] == "calc"


def test_task_errors(tmp_path):
    with pytest.raises(ValueError, match="distinct"):  # only 100 one-digit sums exist
        make_task_splits("addition", tmp_path, n_train=150, n_test=10, num_digits=1)
    with pytest.raises(ValueError, match="num_digits must be at least 1, got 0"):
        make_task_splits("addition", tmp_path, n_train=5, n_test=5, num_digits=0)
    with pytest.raises(ValueError, match="unknown task"):
        make_task_splits("countdown", tmp_path, 10, 10)
    with pytest.raises(ValueError, match="the calc task's op must be .*, got '-'"):
        make_task_splits("calc", tmp_path, 10, 10, op="-")


# ---------------------------------------------------------------- dataset
def test_dataset_reads_parquet_and_jsonl(tmp_path, tokenizer, addition_file):
    jsonl = tmp_path / "extra.jsonl"
    jsonl.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "2+2=", "answer": 4, "data_source": "addition"},
                {"prompt": "hi", "answer": "there"},
            ]
        )
        + "\n"
    )
    dataset = PromptDataset([addition_file, jsonl], tokenizer, max_prompt_length=16)
    assert len(dataset) == 52
    first = dataset[0]
    row = _rows(addition_file)[0]
    assert first["raw_prompt"] == row["prompt"] and first["ground_truth"] == row["answer"]
    assert first["input_ids"] == tokenizer(row["prompt"])["input_ids"]
    assert dataset[50]["ground_truth"] == "4"  # coerced to str
    assert dataset[51]["data_source"] == "unknown"
    assert [dataset[i]["index"] for i in range(len(dataset))] == list(range(52))


def test_dataset_chat_template_and_nested_keys(tmp_path, tokenizer):
    path = tmp_path / "chat.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}],
                    "reward_model": {"ground_truth": "3"},
                    "data_source": "addition",
                },
                {"prompt": "3+4=", "reward_model": {"ground_truth": "7"}, "data_source": "addition"},
            ]
        )
    )
    dataset = PromptDataset(
        path,
        tokenizer,
        answer_key="reward_model.ground_truth",
        apply_chat_template=True,
        max_prompt_length=64,
    )
    assert dataset[0]["raw_prompt"] == (
        "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    )
    assert dataset[1]["raw_prompt"] == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    assert dataset[1]["input_ids"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert [item["ground_truth"] for item in (dataset[0], dataset[1])] == ["3", "7"]
    with pytest.raises(ValueError, match="apply_chat_template=True"):
        PromptDataset(path, tokenizer, answer_key="reward_model.ground_truth")
    with pytest.raises(ValueError, match="no column 'answer'"):
        PromptDataset(path, tokenizer, apply_chat_template=True)


def test_dataset_filters_or_truncates_overlong_prompts(tmp_path, tokenizer, caplog):
    path = tmp_path / "mixed.jsonl"
    prompts = ["1+1=", "123456+654321=", "9+9="]
    path.write_text("\n".join(json.dumps({"prompt": p, "answer": "x"}) for p in prompts))
    with caplog.at_level(logging.WARNING, logger="rl_extension.data.prompts"):
        dataset = PromptDataset(path, tokenizer, max_prompt_length=8)
    assert [item["raw_prompt"] for item in (dataset[0], dataset[1])] == ["1+1=", "9+9="]
    assert len(dataset) == 2 and dataset.num_filtered == 1
    assert "dropped 1 of 3" in caplog.text
    kept = PromptDataset(path, tokenizer, max_prompt_length=8, filter_overlong=False)
    assert len(kept) == 3 and kept.num_filtered == 0
    assert tokenizer.decode(kept[1]["input_ids"]) == kept[1]["raw_prompt"] == "+654321="  # the end is kept
    with pytest.raises(ValueError, match="no prompts left"):
        PromptDataset(path, tokenizer, max_prompt_length=2)


# ---------------------------------------------------------------- loader
def test_batches_are_left_padded_with_positions(tokenizer, addition_file):
    dataset = PromptDataset(addition_file, tokenizer, max_prompt_length=10)
    loader = PromptLoader(dataset, batch_size=8, seed=0)
    batch = next(iter(loader))
    ids, mask, pos = (batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids"))
    assert ids.shape == mask.shape == pos.shape == (8, 10) and ids.dtype == torch.long
    uids = batch.non_tensor_batch["uid"]
    for row in range(8):
        index = int(uids[row].split("-")[1])
        prompt = dataset[index]["input_ids"]
        n = len(prompt)
        assert mask[row].tolist() == [0] * (10 - n) + [1] * n
        assert ids[row, 10 - n :].tolist() == prompt
        assert (ids[row, : 10 - n] == tokenizer.pad_token_id).all()
        assert pos[row].tolist() == [0] * (10 - n) + list(range(n))
        assert batch.non_tensor_batch["raw_prompt"][row] == dataset[index]["raw_prompt"]
        assert batch.non_tensor_batch["ground_truth"][row] == dataset[index]["ground_truth"]
        assert batch.non_tensor_batch["data_source"][row] == "addition"
    assert len(set(uids)) == 8 and uids[0].startswith("0-")

    narrow = next(iter(PromptLoader(dataset, batch_size=8, seed=0, pad_to_max_length=False)))
    width = narrow.batch["input_ids"].shape[1]
    assert width == max(
        len(dataset[int(u.split("-")[1])]["input_ids"]) for u in narrow.non_tensor_batch["uid"]
    )
    assert torch.equal(narrow.batch["input_ids"], ids[:, 10 - width :])  # same batch, fewer pad columns
    assert (narrow.batch["attention_mask"][:, -1] == 1).all()


def test_epochs_cover_everything_and_reshuffle(tokenizer, addition_file):
    dataset = PromptDataset(addition_file, tokenizer, max_prompt_length=10)
    loader = PromptLoader(dataset, batch_size=16, seed=3, drop_last=False)
    assert len(loader) == 4  # 50 prompts: 16 + 16 + 16 + 2
    epochs = []
    for _ in range(2):
        uids = np.concatenate([b.non_tensor_batch["uid"] for b in loader])
        epochs.append([int(u.split("-")[1]) for u in uids])
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(50))
    assert epochs[0] != epochs[1]
    assert loader.epoch == 2 and loader.position == 0
    ordered = PromptLoader(dataset, batch_size=16, shuffle=False, drop_last=True)
    assert len(ordered) == 3
    assert [int(u.split("-")[1]) for u in next(iter(ordered)).non_tensor_batch["uid"]] == list(range(16))


def _fingerprints(batches):
    return [(b.batch["input_ids"].tolist(), b.non_tensor_batch["uid"].tolist()) for b in batches]


@pytest.mark.parametrize("stop_after", [0, 2, 3, 5, 7])
def test_resume_yields_the_same_batches(tokenizer, addition_file, stop_after):
    dataset = PromptDataset(addition_file, tokenizer, max_prompt_length=10)
    original = PromptLoader(dataset, batch_size=16, seed=11)  # 3 batches per epoch
    expected, state, step = [], None, 0
    for _ in range(3):
        for batch in original:
            expected.append(batch)
            step += 1
            if step == stop_after:
                state = original.state_dict()  # as a checkpoint written after this step
    if stop_after == 0:
        state = PromptLoader(dataset, batch_size=16, seed=11).state_dict()

    resumed = PromptLoader(dataset, batch_size=16, seed=0)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    got = []
    while len(got) < len(expected) - stop_after:
        got.extend(resumed)
    assert _fingerprints(got) == _fingerprints(expected[stop_after:])


def test_resume_rejects_a_different_batch_size(tokenizer, addition_file):
    dataset = PromptDataset(addition_file, tokenizer, max_prompt_length=10)
    state = PromptLoader(dataset, batch_size=16).state_dict()
    with pytest.raises(ValueError, match="batch_size=16"):
        PromptLoader(dataset, batch_size=8).load_state_dict(state)
    with pytest.raises(ValueError, match="no batch"):
        PromptLoader(dataset, batch_size=64)
