"""Test helpers for the rl tests: prompt batches as ``rl_extension.data.prompts.PromptLoader`` makes them,
and a small model to run them on."""

from __future__ import annotations

import numpy as np
import torch

from rl_extension.agents import ToolCall, ToolCallFormat, register_tool_format
from rl_extension.models import build_tiny_model
from spmdcall.data import DataProto

# The smallest model and synthetic data a real run (PPO or SFT) needs: a 1-layer, 32-wide model,
# 40 training prompts, 4 held out. Config overrides, to put beside a run's own.
SMALLEST_RUN = [
    "model.tiny.num_layers=1",
    "model.tiny.hidden_size=32",
    "model.tiny.num_heads=1",
    "model.tiny.intermediate_size=64",
    "data.synthetic.num_train=40",
    "data.synthetic.num_val=4",
]


def prompt_batch(tokenizer, texts: list[str]) -> DataProto:
    """Left-padded prompts (``input_ids``, ``attention_mask``, ``position_ids``) with a ``uid`` each."""
    ids = [tokenizer(text)["input_ids"] for text in texts]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, row_ids in enumerate(ids):
        input_ids[row, width - len(row_ids) :] = torch.tensor(row_ids)
        attention_mask[row, width - len(row_ids) :] = 1
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        },
        {"uid": np.array([f"p{i}" for i in range(len(ids))], dtype=object)},
    )


def with_meta(batch: DataProto, **meta) -> DataProto:
    """The same rows with ``meta_info`` set to ``meta`` (per-call options such as ``validate``)."""
    return DataProto(batch=batch.batch, non_tensor_batch=dict(batch.non_tensor_batch), meta_info=meta)


def build_small_model(path) -> str:
    """A 2-layer, 64-wide tiny model at ``path``: quick to build and to train in a test."""
    return build_tiny_model(path, num_layers=2, hidden_size=64, num_heads=2, intermediate_size=128)


@register_tool_format("every_turn")
class EveryTurnCalls(ToolCallFormat):
    """A format for tests with a random model (which writes no calls of its own): every turn calls
    every tool (in name order) with the turn's text as its one argument, until max_turns."""

    def parse(self, text, tools):
        return [
            ToolCall(name, {next(iter(t.parameters["properties"])): text})
            for name, t in sorted(tools.items())
        ]

    def render_call(self, name, arguments):
        return f"<call>{name} {next(iter(arguments.values()))}</call>"

    def observation(self, results):
        return "".join(f"[{r}]" for r in results)
