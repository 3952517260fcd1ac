"""The ``rollout.multi_turn`` section: the agent loop (rl_extension.agents), its tools and their call format."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rl_extension.config.ranges import NonNegativeInt, PositiveFloat, PositiveInt
from rl_extension.config.schema import Section

__all__ = ["MultiTurnConfig"]


@dataclass(kw_only=True)
class MultiTurnConfig(Section):
    """Multi-turn, tool-using rollouts: generate, call a tool, append its result, go on (docs/rl/agents.md)."""

    enable: bool = False
    """Run the agent loop instead of one response per prompt. Tool results stay in the sequence but are masked out of the loss, the KL and the entropy."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call: names in the registry (calc) or module:function of a function made with @tool."""
    format: str = "auto"
    """Tool-call format: auto (qwen where the tokenizer's chat template has <tool_call>, else tags), qwen, tags, or a format registered with @register_tool_format (rl_extension.agents.formats)."""
    max_turns: PositiveInt = 4
    """Model turns per trajectory; the tool calls of the last one are not run."""
    max_tokens_per_turn: NonNegativeInt = 0
    """Tokens one turn may generate; 0: what is left of rollout.max_new_tokens, the budget of the whole response (tool results included)."""
    max_observation_tokens: PositiveInt = 64
    """A tool result longer than this many tokens is cut to it."""
    tool_timeout_s: PositiveFloat = 10.0
    """A tool call still running after this many seconds becomes a timeout message the model sees."""
    max_parallel_tools: NonNegativeInt = 0
    """Tool calls running at once over all trajectories; 0: no limit."""
    mode: Literal["concurrent", "lockstep"] = "concurrent"
    """concurrent: every trajectory goes at its own pace (some generate while others wait on tools); lockstep: turn by turn, each turn waiting for its slowest tool call (for comparison)."""

    def check(self, prefix: str = "") -> None:
        """Raise ValueError when the loop is on without a tool to call."""
        super().check(prefix)
        if self.enable and not self.tools:
            raise ValueError(f"{prefix}enable=true needs at least one tool in {prefix}tools (e.g. [calc])")
