"""The calc task's demonstrations: how a model uses the ``calc`` tool, as text to fine-tune on.

The task (``data.synthetic.task=calc``) adds or multiplies two numbers; the demo's, two 4-digit
numbers multiplied, is one a tiny model does not learn in its head. With the tool it only has to
copy: the problem into a call, the result into its answer. A demonstration is the whole
trajectory, e.g. with the tag format

    1234*5678=  <call>calc 1234*5678</call><eos><result>7006652</result>7006652

and ``tokenize_demonstration`` gives its tokens with the observation (the tool's result) masked
out of the loss, as the agent loop masks it in RL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rl_extension.agents.formats import ToolCallFormat
from rl_extension.agents.tools import get_tool

__all__ = ["calc_demonstration", "tokenize_demonstration", "write_calc_demonstrations"]


def calc_demonstration(prompt: str, fmt: ToolCallFormat, eos_token: str) -> str:
    """The trajectory a calc expert writes for ``prompt`` (``"A+B="``), up to its final answer (no final eos).

    Example:
        >>> calc_demonstration("1+2=", TagFormat(), "<eos>")
        '<call>calc 1+2</call><eos><result>3</result>3'
    """
    expression = prompt.strip().rstrip("=")
    result = get_tool("calc").fn(expression)
    return (
        fmt.render_call("calc", {"expression": expression}) + eos_token + fmt.observation([result]) + result
    )


def write_calc_demonstrations(
    rows_file: str | Path, out_file: str | Path, fmt: ToolCallFormat, eos_token: str, column: str = "answer"
) -> str:
    """Rewrite a calc data file with each row's demonstration in ``column``: ``answer`` for SFT, or
    another column beside the answer for GRPO's guidance (``data.demonstration_key``)."""
    table = pq.read_table(rows_file).to_pylist()
    rows = [{**row, column: calc_demonstration(row["prompt"], fmt, eos_token)} for row in table]
    Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out_file)
    return str(out_file)


def tokenize_demonstration(tokenizer: Any, text: str, fmt: ToolCallFormat) -> tuple[list[int], list[int]]:
    """Token ids of a demonstration and a loss mask: 0 on the observations, 1 on the model's text.

    Each piece is tokenized on its own, so no token straddles a model/observation boundary.
    """
    ids: list[int] = []
    mask: list[int] = []
    start = 0
    for begin, end in [*fmt.observation_spans(text), (len(text), len(text))]:
        for piece, trained in ((text[start:begin], 1), (text[begin:end], 0)):
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids += piece_ids
                mask += [trained] * len(piece_ids)
        start = end
    return ids, mask
