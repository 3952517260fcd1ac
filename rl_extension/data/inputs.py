"""Checks of a run's inputs that fail in a second, before torch is imported or anything is written.

    check_inputs(load_config(PPOConfig, "tiny-cpu", ["model.path=sft/hf_model"]))
    # ValueError: model.path='sft/hf_model': no such directory (/home/me/sft/hf_model), and ...

A checkpoint key (model.path, model.tokenizer_path, ref.path, critic.path, reward.model_path)
names a local directory or a Hugging Face Hub model. A directory must exist (and, for a model,
hold a config.json). Any other value must be a Hub name (``name`` or ``namespace/name``) that is
in the local Hub cache or that the Hub knows: one lookup with a short timeout, and none at all
with HF_HUB_OFFLINE set, so a mistyped path never turns into a minute of download retries in
every worker. Data files (data.train_files, data.val_files) must exist, be .parquet or .jsonl,
and hold the data.prompt_key and data.answer_key columns.

The trainers call ``check_inputs`` before they write to the run dir; ``spmdcall-rl train|sft``
call it before importing torch. Only the standard library, pyarrow and huggingface_hub load here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rl_extension.config import DataConfig, PPOConfig, SFTConfig

__all__ = ["HUB_LOOKUP_TIMEOUT_S", "check_checkpoint", "check_data_file", "check_inputs"]

# One Hub lookup waits at most this long for an answer; transformers would retry for about a minute.
HUB_LOOKUP_TIMEOUT_S = 5.0

# What a directory must hold to be loaded as a model (a tokenizer directory only has to exist).
_MODEL_FILE = "config.json"


def check_inputs(config: PPOConfig | SFTConfig) -> None:
    """Raise ValueError naming the key and the path of the first checkpoint or data file that is missing.

    Args:
        config: a validated PPOConfig or SFTConfig; only the checkpoints the run uses are checked.

    Example:
        >>> check_inputs(load_config(SFTConfig, "sft-tiny-cpu", ["data.train_files=[nope.parquet]"]))
        Traceback (most recent call last):
        ValueError: data.train_files[0]='nope.parquet': no such file (/home/me/nope.parquet)
    """
    for key, value, marker in _checkpoints(config):
        check_checkpoint(key, value, marker)
    data = config.data
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for i, file in enumerate(files):
            check_data_file(f"{key}[{i}]", file, data)


def _checkpoints(config: PPOConfig | SFTConfig) -> list[tuple[str, str, str | None]]:
    """(key, value, the file a directory must hold) of each checkpoint the run loads."""
    model = config.model
    used = [
        ("model.path", "" if model.path == "tiny" else model.path, _MODEL_FILE),
        ("model.tokenizer_path", model.tokenizer_path, None),
    ]
    if isinstance(config, PPOConfig):
        used += [
            ("ref.path", config.ref.path if config.use_reference else "", _MODEL_FILE),
            ("critic.path", config.critic.path if config.use_critic else "", _MODEL_FILE),
            ("reward.model_path", config.reward.model_path, _MODEL_FILE),
        ]
    return [(key, value, marker) for key, value, marker in used if value]


def check_checkpoint(key: str, value: str, marker: str | None = _MODEL_FILE) -> None:
    """Raise ValueError unless ``value`` is a checkpoint directory (holding ``marker``) or a reachable Hub name.

    Args:
        key: the config key, for the message (``model.path``).
        value: its value: a directory, or a Hub name such as ``Qwen/Qwen2.5-0.5B``.
        marker: a file the directory must hold (config.json for a model); None: it only has to exist.
    """
    path = Path(value).expanduser()
    if path.is_dir():
        if marker and not (path / marker).is_file():
            raise ValueError(
                f"{key}={value!r}: {path.resolve()} holds no {marker}, so it is not a Hugging Face checkpoint"
            )
        return
    if path.exists():
        raise ValueError(f"{key}={value!r}: {path.resolve()} is a file; expected a checkpoint directory")
    missing = f"{key}={value!r}: no such directory ({path.resolve()})"
    if not _is_hub_name(value):
        raise ValueError(f"{missing}, and it is not a Hub name of the form namespace/name")
    if _in_hub_cache(value):
        return
    if _hub_offline():
        raise ValueError(
            f"{missing}, and the Hub model {value!r} is not in the local cache (HF_HUB_OFFLINE is set)"
        )
    problem = _hub_lookup(value)
    if problem:
        raise ValueError(f"{missing}, and {problem}")


def _is_hub_name(value: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _in_hub_cache(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return any(
        isinstance(try_to_load_from_cache(name, file), str)
        for file in (_MODEL_FILE, "tokenizer_config.json", "tokenizer.json")
    )


def _hub_offline() -> bool:
    # Read at each call (huggingface_hub reads it once, at import), with huggingface_hub's spelling of true.
    return any(
        os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _hub_lookup(name: str) -> str | None:
    """None if the Hub has the model (or answers in a way only the loader can judge); else what is wrong."""
    from huggingface_hub import constants, model_info
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        model_info(name, timeout=HUB_LOOKUP_TIMEOUT_S)
    except GatedRepoError:
        return None  # it exists; the loader says how to get access
    except RepositoryNotFoundError:
        return f"the Hub has no model {name!r} (or it is private: log in with `hf auth login`)"
    except HfHubHTTPError:
        return None  # the Hub answered, with an error the loader will report in full
    except Exception as exc:  # no answer at all: DNS, connection refused, timeout
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return f"the Hub ({constants.ENDPOINT}) cannot be reached to look it up: {reason}"
    return None


def check_data_file(key: str, file: str, data: DataConfig) -> None:
    """Raise ValueError unless ``file`` is a .parquet or .jsonl file holding the prompt and answer columns.

    Args:
        key: the config key, for the message (``data.train_files[0]``).
        file: the path.
        data: the data section (prompt_key and answer_key, dotted for nested columns).
    """
    path = Path(file).expanduser()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "no such file"
        raise ValueError(f"{key}={file!r}: {what} ({path.resolve()})")
    if path.suffix not in (".parquet", ".jsonl"):
        raise ValueError(
            f"{key}={file!r}: expected a .parquet or .jsonl file, got {path.suffix or 'no suffix'}"
        )
    try:
        columns = _parquet_columns(path) if path.suffix == ".parquet" else _jsonl_columns(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{key}={file!r}: cannot read it as {path.suffix[1:]}: {exc}") from None
    for column_key, column in (("data.prompt_key", data.prompt_key), ("data.answer_key", data.answer_key)):
        if not _has_column(columns, column):
            raise ValueError(
                f"{key}={file!r} has no column {column!r} ({column_key}); its columns: {', '.join(sorted(columns))}"
            )


def _parquet_columns(path: Path) -> dict[str, Any]:
    """Column names, nested for struct columns: {"prompt": None, "reward_model": {"ground_truth": None}}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def names(fields: Any) -> dict[str, Any]:
        return {f.name: names(list(f.type)) if pa.types.is_struct(f.type) else None for f in fields}

    return names(list(pq.read_schema(path)))


def _jsonl_columns(path: Path) -> dict[str, Any]:
    """The first row's keys, nested for mapping values."""
    with open(path, encoding="utf-8") as f:
        line = next((line for line in f if line.strip()), None)
    if line is None:
        raise ValueError("it holds no rows")
    row = json.loads(line)
    if not isinstance(row, dict):
        raise ValueError(f"its first row is {type(row).__name__}, not an object")

    def names(value: dict) -> dict[str, Any]:
        return {k: names(v) if isinstance(v, dict) else None for k, v in value.items()}

    return names(row)


def _has_column(columns: dict[str, Any], dotted: str) -> bool:
    level: Any = columns
    for part in dotted.split("."):
        if not isinstance(level, dict) or part not in level:
            return False
        level = level[part]
    return True
