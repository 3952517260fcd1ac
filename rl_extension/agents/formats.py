"""Tool-call formats: how the model writes a call, and how a tool's result is written back to it.

A model turn ends at an eos token (``<|im_end|>`` for a chat model), whatever it holds. The format
reads the turn: calls in it mean "run these tools, append their results, let the model go on"; no
call means the turn is the answer. A result goes back as *observation* text, tokens the model did
not generate (masked out of the loss).

- ``QwenFormat`` (``qwen``): Qwen2.5's chat template (also Hermes-style models'). A call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; results come back in a user
  turn, each in ``<tool_response>...</tool_response>``, then a new assistant turn opens. The tokens
  are exactly what ``tokenizer.apply_chat_template(messages, tools=...)`` writes for the same
  conversation.
- ``TagFormat`` (``tags``): a plain one for models without a chat template, such as the tiny
  character-level one: ``<call>calc 12+34</call>``, result ``<result>46</result>``. Arguments are
  a JSON object, or, for a tool of one argument, the bare text.

``format_for(tokenizer, "auto")`` picks ``qwen`` when the tokenizer's chat template mentions
``<tool_call>``, else ``tags``. A format of your own subclasses ``ToolCallFormat`` and registers
with ``@register_tool_format(name)``; ``rollout.multi_turn.format=name`` then picks it. Declaring its
``call_start`` and ``result_end`` lets grading (``final_answer``, the ``calc`` scorer's call count)
read its trajectories too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rl_extension.registry import Registry

__all__ = [
    "FORMATS",
    "QwenFormat",
    "TagFormat",
    "ToolCall",
    "ToolCallFormat",
    "count_calls",
    "final_answer",
    "format_for",
    "register_tool_format",
]


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the tool's name and its arguments, or why it could not be read.

    Attributes:
        name: the tool the model named ("" when even that could not be read).
        arguments: the decoded arguments (a dict when well-formed).
        error: why the call is malformed, or "" for a well-formed call.
    """

    name: str
    arguments: Any = None
    error: str = ""


class ToolCallFormat:
    """How calls are written and results given back. Subclasses define the four methods below."""

    name = ""
    """The name it is registered under (set by ``register_tool_format``)."""
    call_start = ""
    """The text that opens a call, e.g. ``<call>`` (grading counts calls by it)."""
    result_end = ""
    """The text that closes a tool result, e.g. ``</result>`` (grading reads the answer after the last)."""

    def parse(self, text: str, tools: dict[str, Any]) -> list[ToolCall]:
        """The calls written in one model turn, in order (an empty list: the turn is an answer)."""
        raise NotImplementedError

    def render_call(self, name: str, arguments: dict) -> str:
        """How the model writes a call (for demonstrations): ``parse`` reads it back."""
        raise NotImplementedError

    def observation(self, results: list[str]) -> str:
        """The text appended after a turn's calls: their results, in order, and whatever leads into
        the model's next turn."""
        raise NotImplementedError

    def observation_pattern(self) -> re.Pattern:
        """A regex matching one observation inside a whole trajectory's text (demonstrations, grading)."""
        raise NotImplementedError

    def observation_spans(self, text: str) -> list[tuple[int, int]]:
        """Where the observations are in a trajectory's text, as (start, end) character offsets."""
        return [m.span() for m in self.observation_pattern().finditer(text)]


def _json_arguments(text: str) -> tuple[Any, str]:
    try:
        return json.loads(text), ""
    except ValueError as exc:
        return None, f"arguments are not valid JSON ({exc.msg} at character {exc.pos})"


FORMATS: Registry[type[ToolCallFormat]] = Registry("tool-call format", "available: auto, {listed}")
"""The registry: format name -> class; ``rollout.multi_turn.format`` names one (or ``auto``)."""


def register_tool_format(name: str) -> Callable[[type[ToolCallFormat]], type[ToolCallFormat]]:
    """Register a ``ToolCallFormat`` subclass under ``name`` (a class decorator).

    Registering a name again replaces the earlier class.

    Example:
        >>> @register_tool_format("brackets")
        ... class BracketFormat(TagFormat):
        ...     call_start, result_end = "[call]", "[/result]"
        >>> format_for(None, "brackets").name
        'brackets'
    """

    def decorator(cls: type[ToolCallFormat]) -> type[ToolCallFormat]:
        cls.name = name
        return FORMATS.register(cls, name)

    return decorator


@register_tool_format("tags")
class TagFormat(ToolCallFormat):
    """``<call>NAME ARGS</call>`` / ``<result>TEXT</result>``: for models without a chat template.

    ARGS is a JSON object, or, for a tool with exactly one parameter, its value as bare text.

    Example:
        >>> TagFormat().parse("<call>calc 1+2</call>", {"calc": get_tool("calc")})  # doctest: +SKIP
        [ToolCall(name='calc', arguments={'expression': '1+2'}, error='')]
    """

    call_start, result_end = "<call>", "</result>"
    _CALL = re.compile(r"<call>(.*?)</call>", re.DOTALL)
    _RESULT = re.compile(r"<result>.*?</result>", re.DOTALL)

    def parse(self, text: str, tools: dict[str, Any]) -> list[ToolCall]:
        calls = []
        for body in self._CALL.findall(text):
            name, _, args = body.strip().partition(" ")
            tool_ = tools.get(name)
            if tool_ is None:  # running it says so, and which tools there are
                calls.append(ToolCall(name, args))
            elif args.lstrip().startswith("{"):
                arguments, error = _json_arguments(args)
                calls.append(ToolCall(name, arguments, error))
            elif len(tool_.parameters.get("properties", {})) == 1:
                calls.append(ToolCall(name, {next(iter(tool_.parameters["properties"])): args}))
            else:
                calls.append(ToolCall(name, None, "arguments must be a JSON object"))
        if "<call>" in self._CALL.sub("", text):
            calls.append(ToolCall("", None, "a <call> without its </call>"))
        return calls

    def render_call(self, name: str, arguments: dict) -> str:
        if len(arguments) == 1 and isinstance(next(iter(arguments.values())), str):
            return f"<call>{name} {next(iter(arguments.values()))}</call>"
        return f"<call>{name} {json.dumps(arguments)}</call>"

    def observation(self, results: list[str]) -> str:
        return "".join(f"<result>{r}</result>" for r in results)

    def observation_pattern(self) -> re.Pattern:
        # One turn's results are adjacent: one observation.
        return re.compile(r"(?:<result>.*?</result>)+", re.DOTALL)


@register_tool_format("qwen")
class QwenFormat(ToolCallFormat):
    """Qwen2.5's (and Hermes') ``<tool_call>`` / ``<tool_response>`` chat format.

    A turn may hold text and then one or more calls; the results come back as one user turn:

        <|im_start|>assistant\\n<tool_call>\\n{"name": "calc", "arguments": {"expression": "1+2"}}\\n</tool_call><|im_end|>
        \\n<|im_start|>user\\n<tool_response>\\n3\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
    """

    call_start, result_end = "<tool_call>", "</tool_response>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, tools: dict[str, Any]) -> list[ToolCall]:
        calls = []
        for body in self._CALL.findall(text):
            call, error = _json_arguments(body.strip())
            if error:
                calls.append(ToolCall("", None, f"the call is not valid JSON ({error.split('(', 1)[1]}"))
            elif not isinstance(call, dict) or not isinstance(call.get("name"), str):
                calls.append(ToolCall("", None, 'a call must be {"name": ..., "arguments": {...}}'))
            else:
                arguments = call.get("arguments", {})
                if isinstance(arguments, str):  # some models write the arguments as a JSON string
                    arguments, error = _json_arguments(arguments)
                calls.append(ToolCall(call["name"], arguments, error))
        if "<tool_call>" in self._CALL.sub("", text):
            calls.append(ToolCall("", None, "a <tool_call> without its </tool_call>"))
        return calls

    def render_call(self, name: str, arguments: dict) -> str:
        # As the chat template writes it: '{"name": "' + name + '", "arguments": ' + arguments|tojson + '}'
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'

    def observation(self, results: list[str]) -> str:
        responses = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
        return f"\n<|im_start|>user{responses}<|im_end|>\n<|im_start|>assistant\n"

    def observation_pattern(self) -> re.Pattern:
        return re.compile(
            r"\n<\|im_start\|>user(?:\n<tool_response>\n.*?\n</tool_response>)+<\|im_end\|>\n<\|im_start\|>assistant\n",
            re.DOTALL,
        )


def format_for(tokenizer: Any, name: str = "auto") -> ToolCallFormat:
    """The format named ``name``; ``auto``: ``qwen`` if the tokenizer's chat template writes ``<tool_call>``, else ``tags``."""
    if name == "auto":
        name = "qwen" if "<tool_call>" in (getattr(tokenizer, "chat_template", None) or "") else "tags"
    return FORMATS.lookup(name)()


def final_answer(text: str) -> str:
    """What a trajectory's text says after its last tool result (all of it when there is none), in
    any registered format that declares its ``result_end``, with or without its special tokens.

    Example:
        >>> final_answer("<call>calc 1+2</call><result>3</result>3")
        '3'
    """
    result_ends = "|".join(re.escape(f.result_end) for f in FORMATS.values() if f.result_end)
    # A result's end, and what leads into the next model turn (the chat tokens may have been
    # skipped when the text was decoded).
    observation_end = rf"(?:{result_ends})(?:<\|im_end\|>)?(?:\n(?:<\|im_start\|>)?assistant\n)?"
    ends = [m.end() for m in re.finditer(observation_end, text)]
    return text[ends[-1] :] if ends else text


def count_calls(text: str) -> int:
    """The tool calls a trajectory's text writes, in any registered format that declares its ``call_start``.

    Example:
        >>> count_calls("<call>calc 1+2</call><result>3</result>3")
        1
    """
    return sum(text.count(f.call_start) for f in FORMATS.values() if f.call_start)
