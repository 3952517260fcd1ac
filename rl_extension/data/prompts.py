"""Prompt datasets → left-padded DataProto batches, and synthetic tasks to train on.

Files are parquet or jsonl with one prompt per row. The columns this module uses:

    prompt       a string, or a list of chat messages ({"role": ..., "content": ...})
    answer       the ground truth the reward function compares the response with
    data_source  which task the row belongs to; `rewards.RewardManager` picks a scorer by it

Dotted keys reach into nested columns, so files preprocessed for verl work as they are
(`answer_key="reward_model.ground_truth"`).

    train, test = make_task_splits("addition", "/tmp/data", n_train=2048, n_test=256)
    loader = PromptLoader(PromptDataset(train, tokenizer, max_prompt_length=16), batch_size=32)
    for batch in loader:      # one epoch; a DataProto with input_ids, attention_mask, position_ids
        ...
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from spmdcall.data import DataProto

if TYPE_CHECKING:
    from rl_extension.config import DataConfig

__all__ = [
    "datasets_from_config",
    "prompt_loaders",
    "TASKS",
    "PromptDataset",
    "PromptLoader",
    "make_addition_dataset",
    "make_sorting_dataset",
    "make_task_splits",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- synthetic tasks
def _addition_row(rng: np.random.Generator, num_digits: int = 3) -> dict:
    # Both operands have exactly num_digits digits (0-9 for one digit): "3-digit addition" adds two
    # numbers from 100-999, so every problem has the same shape.
    if num_digits < 1:
        raise ValueError(f"num_digits must be at least 1, got {num_digits}")
    low = 10 ** (num_digits - 1) if num_digits > 1 else 0
    a, b = (int(x) for x in rng.integers(low, 10**num_digits, size=2))
    return {"prompt": f"{a}+{b}=", "answer": str(a + b), "data_source": "addition"}


def _sorting_row(rng: np.random.Generator, num_items: int = 12) -> dict:
    # Two-digit numbers, so with the character tokenizer every item is exactly 3 tokens
    # ("12 ") and the answer is 3 * num_items - 1 tokens: 35 for the default 12 items.
    numbers = [int(x) for x in rng.integers(10, 100, size=num_items)]
    return {
        "prompt": "sort: " + " ".join(map(str, numbers)) + " =",
        "answer": " ".join(map(str, sorted(numbers))),
        "data_source": "sorting",
    }


def _calc_row(rng: np.random.Generator, num_digits: int = 6, op: str = "+") -> dict:
    # Arithmetic for the `calc` tool (rl_extension.agents): two num_digits-digit operands, added
    # ("+") or multiplied ("*"), graded by the `calc` scorer on the answer after the last tool result.
    if op not in ("+", "*"):
        raise ValueError(f"the calc task's op must be '+' or '*', got {op!r}")
    row = _addition_row(rng, num_digits)
    if op == "*":
        a, b = (int(x) for x in row["prompt"][:-1].split("+"))
        row = {"prompt": f"{a}*{b}=", "answer": str(a * b)}
    return {**row, "data_source": "calc"}


# Task name -> row generator `(rng, **task_kwargs) -> row`. The name is also the rows'
# data_source and the name of the scorer in `rewards` that grades them.
TASKS: dict[str, Callable[..., dict]] = {
    "addition": _addition_row,
    "sorting": _sorting_row,
    "calc": _calc_row,
}


def _generate_rows(task: str, n: int, seed: int, **task_kwargs: Any) -> list[dict]:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; available: {sorted(TASKS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    rows, seen = [], set()
    # Enough draws for any n up to about the number of distinct prompts; more means too few exist.
    for _ in range(100 * n + 1000):
        if len(rows) == n:
            break
        row = TASKS[task](rng, **task_kwargs)
        # Distinct prompts, so a train/test split drawn from one stream cannot overlap.
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    if len(rows) < n:
        raise ValueError(f"could not draw {n} distinct {task!r} prompts with {task_kwargs}; too few exist")
    return rows


def _write_parquet(rows: list[dict], path: str | os.PathLike) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("prompt", pa.string()), ("answer", pa.string()), ("data_source", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def make_addition_dataset(path: str | os.PathLike, n: int, num_digits: int = 3, seed: int = 0) -> str:
    """Write `n` distinct addition problems ("123+456=" → "579") to a parquet file.

    Args:
        path: the parquet file to write (parent directories are created).
        n: number of rows.
        num_digits: both operands have exactly this many digits, drawn uniformly (100-999 for 3;
            0-9 for 1).
        seed: the same seed gives the same rows.

    Returns:
        `path` as a string.

    Example:
        >>> make_addition_dataset("/tmp/add.parquet", n=100, num_digits=2, seed=1)
        '/tmp/add.parquet'
    """
    return _write_parquet(_generate_rows("addition", n, seed, num_digits=num_digits), path)


def make_sorting_dataset(path: str | os.PathLike, n: int, num_items: int = 12, seed: int = 0) -> str:
    """Write `n` distinct sorting problems ("sort: 53 12 87 =" → "12 53 87") to a parquet file.

    The long task: with the character tokenizer of `models.build_tiny_model` an answer is
    3 * num_items - 1 tokens (35 for 12 items), plus the eos token.

    Args:
        path: the parquet file to write (parent directories are created).
        n: number of rows.
        num_items: how many two-digit numbers (10-99, repeats allowed) to sort.
        seed: the same seed gives the same rows.

    Returns:
        `path` as a string.

    Example:
        >>> make_sorting_dataset("/tmp/sort.parquet", n=100, num_items=4)
        '/tmp/sort.parquet'
    """
    return _write_parquet(_generate_rows("sorting", n, seed, num_items=num_items), path)


def make_task_splits(
    task: str, out_dir: str | os.PathLike, n_train: int, n_test: int, seed: int = 0, **task_kwargs: Any
) -> tuple[str, str]:
    """Write `out_dir/train.parquet` and `out_dir/test.parquet` for a synthetic task.

    Both splits come from one stream of distinct prompts, so no test prompt appears in train.

    Args:
        task: a name in `TASKS` ("addition" or "sorting").
        out_dir: directory for the two files.
        n_train: rows in train.parquet.
        n_test: rows in test.parquet.
        seed: the same seed gives the same files.
        **task_kwargs: passed to the task (`num_digits` for addition, `num_items` for sorting).

    Returns:
        (train_path, test_path).

    Example:
        >>> train, test = make_task_splits("addition", "/tmp/add", 1000, 100, num_digits=2)
    """
    rows = _generate_rows(task, n_train + n_test, seed, **task_kwargs)
    out_dir = Path(out_dir)
    return (
        _write_parquet(rows[:n_train], out_dir / "train.parquet"),
        _write_parquet(rows[n_train:], out_dir / "test.parquet"),
    )


# ---------------------------------------------------------------- prompt dataset
def _read_rows(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected .parquet or .jsonl")


def _lookup(row: dict, key: str, path: Path) -> Any:
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{path}: a row has no column {key!r} (columns: {sorted(row)})")
        value = value[part]
    return value


class PromptDataset:
    """Prompts from parquet/jsonl files, formatted and tokenized once, overlong ones filtered.

    Each item is a dict: `input_ids` (list of ints), `raw_prompt` (the text those ids encode,
    chat template included), `ground_truth` (str), `data_source` (str) and `index`
    (the row's position among the kept rows).

    Args:
        files: one path or a list of paths (.parquet or .jsonl); rows are concatenated in order.
        tokenizer: a Hugging Face tokenizer.
        prompt_key: column holding the prompt: a string or a list of chat messages.
        answer_key: column holding the ground truth (dotted for nested, "reward_model.ground_truth").
        data_source_key: column naming the task; rows without it get "unknown".
        demonstration_key: column with a demonstration response (item ``demonstration``); "" for none.
        max_prompt_length: longest prompt, in tokens, that the rollout accepts.
        apply_chat_template: format with `tokenizer.apply_chat_template` (a string prompt becomes
            one user message) and add the assistant generation prompt; otherwise tokenize the
            string as it is, with the tokenizer's usual special tokens (a bos, if it has one).
        filter_overlong: drop prompts longer than max_prompt_length (the count is logged);
            if False, keep their last max_prompt_length tokens instead.
        tools: function schemas the chat template announces to the model (multi-turn rollouts with tools).

    Example:
        >>> ds = PromptDataset("/tmp/add/train.parquet", tok, max_prompt_length=16)
        >>> ds[0]["raw_prompt"], ds[0]["ground_truth"]
        ('123+456=', '579')
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        data_source_key: str = "data_source",
        demonstration_key: str = "",
        max_prompt_length: int = 256,
        apply_chat_template: bool = False,
        filter_overlong: bool = True,
        tools: list[dict] | None = None,
    ) -> None:
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("apply_chat_template=True but the tokenizer has no chat_template")
        paths = [Path(files)] if isinstance(files, (str, os.PathLike)) else [Path(f) for f in files]
        if not paths:
            raise ValueError("files is empty")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.tools = tools

        texts, answers, sources, demos = [], [], [], []
        for path in paths:
            for row in _read_rows(path):
                prompt = _lookup(row, prompt_key, path)
                texts.append(self._format(prompt, apply_chat_template, path))
                answers.append(str(_lookup(row, answer_key, path)))
                sources.append(str(row.get(data_source_key, "unknown")))
                demos.append(str(_lookup(row, demonstration_key, path)) if demonstration_key else None)
        self._items, num_overlong = self._tokenized(
            texts,
            answers,
            sources,
            demos,
            add_special_tokens=not apply_chat_template,
            filter_overlong=filter_overlong,
        )
        self.num_filtered = num_overlong if filter_overlong else 0
        if num_overlong:
            logger.warning(
                "%s %d of %d prompts longer than max_prompt_length=%d",
                "dropped" if filter_overlong else "left-truncated",
                num_overlong,
                len(texts),
                max_prompt_length,
            )
        if not self._items:
            raise ValueError(
                f"no prompts left in {[str(p) for p in paths]} "
                f"(rows read: {len(texts)}, max_prompt_length={max_prompt_length})"
            )

    def _tokenized(
        self,
        texts: list[str],
        answers: list[str],
        sources: list[str],
        demos: list[str | None],
        *,
        add_special_tokens: bool,
        filter_overlong: bool,
    ) -> tuple[list[dict], int]:
        """The prompts' items, overlong ones dropped or left-truncated, and how many were overlong."""
        # A chat template already spells out its special tokens; a raw prompt gets the usual ones.
        encoded = self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"] if texts else []
        items: list[dict] = []
        num_overlong = 0
        for text, ids, answer, source, demo in zip(texts, encoded, answers, sources, demos):
            if len(ids) > self.max_prompt_length:
                num_overlong += 1
                if filter_overlong:
                    continue
                ids = ids[-self.max_prompt_length :]  # the question is at the end; keep it
                text = self.tokenizer.decode(ids)
            items.append(
                {
                    "input_ids": list(ids),
                    "raw_prompt": text,
                    "ground_truth": answer,
                    "data_source": source,
                    "index": len(items),
                    **({"demonstration": demo} if demo is not None else {}),
                }
            )
        return items, num_overlong

    def _format(self, prompt: Any, apply_chat_template: bool, path: Path) -> str:
        if not apply_chat_template:
            if not isinstance(prompt, str):
                raise ValueError(
                    f"{path}: prompt is {type(prompt).__name__}, not a string; "
                    "chat messages need apply_chat_template=True"
                )
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=True
        )

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> dict:
        return self._items[index]


# ---------------------------------------------------------------- loader
class PromptLoader:
    """Batches of a PromptDataset as DataProto, over seeded epochs, resumable mid-epoch.

    Each batch holds tensors `input_ids`, `attention_mask`, `position_ids` (int64, left-padded,
    so every prompt ends in the last column and generation continues from there) and numpy
    columns `raw_prompt`, `ground_truth`, `data_source` and `uid` ("<epoch>-<index>", unique
    per prompt and epoch: GRPO groups a prompt's samples by it).

    Iterating yields the rest of the current epoch; the next `for` loop starts the next epoch
    (reshuffled with `seed` and the epoch number). `state_dict()` records how far iteration got;
    a fresh loader given that state yields exactly the batches the original would have.

    Args:
        dataset: the prompts.
        batch_size: prompts per batch.
        shuffle: permute the rows each epoch (seeded); otherwise dataset order.
        seed: the shuffle seed.
        drop_last: drop the last, smaller batch of an epoch.
        pad_to_max_length: pad every batch to dataset.max_prompt_length columns (fixed shapes);
            otherwise to the longest prompt in the batch (less compute).

    Example:
        >>> loader = PromptLoader(dataset, batch_size=8, seed=1)
        >>> batch = next(iter(loader))
        >>> batch.batch["input_ids"].shape, loader.state_dict()["position"]
        (torch.Size([8, 16]), 1)
    """

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        pad_to_max_length: bool = True,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and batch_size > len(dataset):
            raise ValueError(
                f"batch_size={batch_size} exceeds the dataset ({len(dataset)} prompts) "
                "and drop_last=True: no batch would be produced"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad_to_max_length = pad_to_max_length
        pad_id = dataset.tokenizer.pad_token_id
        self.pad_token_id = dataset.tokenizer.eos_token_id if pad_id is None else pad_id
        self.epoch = 0
        self.position = 0  # batches of `epoch` already handed out

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[DataProto]:
        if self.position >= len(self):  # state saved just after an epoch's last batch
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order(self.epoch)
        while self.position < len(self):
            start = self.position * self.batch_size
            # Count the batch as consumed before handing it out, so a checkpoint written while
            # the caller trains on it resumes with the next one.
            self.position += 1
            yield self._collate(order[start : start + self.batch_size], self.epoch)
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict:
        """Where iteration stands: {"epoch", "position", "seed", "batch_size", "num_prompts"}."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_prompts": len(self.dataset),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()` of an earlier loader over the same dataset and batch size.

        Args:
            state: the dict `state_dict()` returned.
        """
        for key in ("batch_size", "num_prompts"):
            if key in state and state[key] != self.state_dict()[key]:
                raise ValueError(
                    f"cannot resume: the saved loader had {key}={state[key]}, "
                    f"this one has {self.state_dict()[key]}"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.seed = int(state.get("seed", self.seed))

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        # Seeded by (seed, epoch) rather than by a running generator, so any epoch's order can be
        # recomputed on resume without replaying the earlier ones.
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def _collate(self, indices: np.ndarray, epoch: int) -> DataProto:
        items = [self.dataset[int(i)] for i in indices]
        longest = max(len(item["input_ids"]) for item in items)
        width = self.dataset.max_prompt_length if self.pad_to_max_length else longest
        input_ids = torch.full((len(items), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            ids = item["input_ids"]
            if ids:
                input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                attention_mask[row, width - len(ids) :] = 1
        # Positions count real tokens only, so a left-padded prompt gets the same positions as the
        # unpadded one; pads sit at 0 (masked out anyway).
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        return DataProto.from_dict(
            tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
            non_tensors={
                "raw_prompt": np.array([item["raw_prompt"] for item in items], dtype=object),
                "ground_truth": np.array([item["ground_truth"] for item in items], dtype=object),
                "data_source": np.array([item["data_source"] for item in items], dtype=object),
                "uid": np.array([f"{epoch}-{item['index']}" for item in items], dtype=object),
                **(
                    {"demonstration": np.array([item["demonstration"] for item in items], dtype=object)}
                    if "demonstration" in items[0]
                    else {}
                ),
            },
        )


def datasets_from_config(
    cfg: DataConfig, tokenizer: Any, data_dir: str | os.PathLike, tools: list[dict] | None = None
) -> tuple[PromptDataset, list[DataProto]]:
    """The training set and the validation batches a DataConfig describes (SFT and PPO alike).

    ``tools`` (function schemas) go to the chat template, for multi-turn rollouts with tools.

    Without ``train_files`` the synthetic task is written under ``data_dir`` first (its test split
    validates unless ``val_files`` are given). Validation batches are ``val_batch_size`` rows (0: all).
    """
    train_files, val_files = list(cfg.train_files), list(cfg.val_files)
    if not train_files:
        s = cfg.synthetic
        train, test = make_task_splits(
            s.task, Path(data_dir), s.num_train, s.num_val, seed=s.seed, **s.task_kwargs
        )
        train_files, val_files = [train], val_files or [test]

    def dataset(files: list[str], demonstration_key: str = "") -> PromptDataset:
        return PromptDataset(
            files,
            tokenizer,
            prompt_key=cfg.prompt_key,
            answer_key=cfg.answer_key,
            data_source_key=cfg.data_source_key,
            demonstration_key=demonstration_key,
            max_prompt_length=cfg.max_prompt_length,
            apply_chat_template=cfg.apply_chat_template,
            filter_overlong=cfg.filter_overlong,
            tools=tools,
        )

    val_batches: list[DataProto] = []
    if val_files:
        val_set = dataset(val_files)
        val_batches = list(
            PromptLoader(
                val_set,
                cfg.val_batch_size or len(val_set),
                shuffle=False,
                drop_last=False,
                pad_to_max_length=cfg.pad_to_max_length,
            )
        )
    return dataset(train_files, cfg.demonstration_key), val_batches


def prompt_loaders(
    cfg: DataConfig,
    tokenizer: Any,
    data_dir: str | os.PathLike,
    *,
    seed: int,
    tools: list[dict] | None = None,
) -> tuple[PromptLoader, list[DataProto]]:
    """A PPO run's prompts (``datasets_from_config``): the training loader, data.train_batch_size prompts
    a batch shuffled with ``seed``, and the validation batches, marked ``validate`` in their meta_info
    (the rollout samples them as rollout.val_* say)."""
    train_set, val_batches = datasets_from_config(cfg, tokenizer, data_dir, tools=tools)
    loader = PromptLoader(
        train_set,
        cfg.train_batch_size,
        shuffle=cfg.shuffle,
        seed=seed,
        pad_to_max_length=cfg.pad_to_max_length,
    )
    return loader, [dataclasses.replace(b, meta_info={"validate": True}) for b in val_batches]
