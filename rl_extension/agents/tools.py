"""Tools the model may call during a rollout: declaring one, the registry configs name, and running a call.

A tool is a plain function, sync or ``async def``, with a name, a description and a JSON schema of
its arguments (derived from its signature unless given):

    from rl_extension.agents import tool

    @tool(description="Look a word up in the dictionary.")
    async def define(word: str) -> str:
        async with session.get(f"{DICT_URL}/{word}") as r:   # an async client: calls overlap freely
            return await r.text()

``@tool`` registers it under its name, so ``rollout.multi_turn.tools=[define]`` finds it once its
module is imported; ``module.path:define`` (or ``/path/file.py:define``) imports the module first.

Running a call (``call_tool``) never raises: a tool that raises, runs past its timeout, gets
arguments that do not fit its schema, or does not exist gives a ``ToolResult`` with ``error=True``
whose text the model reads as its observation. Async tools run on the agent loop's event loop;
sync tools run in a thread pool, so calls of different trajectories overlap either way. A sync
tool that hangs keeps its thread until it returns (a thread cannot be stopped): give a tool that
may hang an ``async def`` or a timeout of its own.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import json
import operator
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rl_extension.registry import Registry
from rl_extension.user_code import load_function

__all__ = ["TOOLS", "Tool", "ToolResult", "calc", "call_tool", "get_tool", "register_tool", "tool"]

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True)
class Tool:
    """A function the model may call.

    Attributes:
        name: what the model writes to call it.
        fn: the function, sync or ``async def``, called with the arguments as keywords; its result
            becomes text (``str(result)``, or JSON for a dict or list).
        description: one line for the model (chat templates put it in the system prompt).
        parameters: JSON schema of the arguments (``{"type": "object", "properties": ..., "required": ...}``).
    """

    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}, "required": []})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function itself (a decorated tool stays callable as before)."""
        return self.fn(*args, **kwargs)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def schema(self) -> dict:
        """The OpenAI-style function schema chat templates take (``tools=[...]``)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


TOOLS: Registry[Tool] = Registry("tool", "registered: {names}, or 'module.path:function'")
"""The registry: tool name -> Tool. ``@tool`` and ``register_tool`` add to it."""


def _parameters_of(fn: Callable[..., Any]) -> dict:
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        annotation = param.annotation
        if isinstance(annotation, str):  # postponed annotations: "str", "int", ...
            annotation = {
                "str": str,
                "int": int,
                "float": float,
                "bool": bool,
                "list": list,
                "dict": dict,
            }.get(annotation, annotation)
        properties[name] = {"type": _JSON_TYPES.get(annotation, "string")}
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


def register_tool(tool_: Tool, *, overwrite: bool = False) -> Tool:
    """Add a tool to the registry under its name.

    Args:
        tool_: the tool.
        overwrite: replace a tool of the same name (else that raises ValueError).
    """
    existing = TOOLS.get(tool_.name)
    if existing is not None and existing.fn is not tool_.fn and not overwrite:
        raise ValueError(
            f"a tool named {tool_.name!r} is already registered; pass overwrite=True to replace it"
        )
    return TOOLS.register(tool_, tool_.name)


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: dict | None = None,
) -> Any:
    """Declare a function as a tool and register it; usable as ``@tool`` or ``@tool(name=..., ...)``.

    Args:
        fn: the function (sync or ``async def``).
        name: the name the model calls it by; default the function's name.
        description: default the first line of its docstring.
        parameters: JSON schema of its arguments; default derived from its signature.

    Returns:
        The ``Tool`` (call ``.fn`` for the function itself).

    Example:
        >>> @tool
        ... def shout(text: str) -> str:
        ...     "Upper-cases a text."
        ...     return text.upper()
        >>> shout.name, shout.parameters["required"]
        ('shout', ['text'])
    """

    def make(f: Callable[..., Any]) -> Tool:
        doc = (inspect.getdoc(f) or "").strip().splitlines()
        return register_tool(
            Tool(
                name=name or f.__name__,
                fn=f,
                description=description if description is not None else (doc[0] if doc else ""),
                parameters=parameters or _parameters_of(f),
            ),
            overwrite=True,  # re-running a module (a notebook cell, a worker import) re-registers
        )

    return make(fn) if fn is not None else make


def get_tool(name: str) -> Tool:
    """The registered tool ``name``, or the ``@tool`` function ``module:function`` / ``/path/file.py:function``.

    Example:
        >>> get_tool("calc").fn("2+3*4")
        '14'
    """
    if ":" in name and name not in TOOLS:
        found = load_function(name, "tool")
        return found if isinstance(found, Tool) else tool(found)
    return TOOLS.lookup(name)


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: the text the model sees, and whether it is an error message."""

    text: str
    error: bool = False


def _check_arguments(tool_: Tool, arguments: Any) -> str | None:
    """Why ``arguments`` do not fit the tool's schema, or None when they do."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    properties = tool_.parameters.get("properties", {})
    missing = [k for k in tool_.parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(missing)}"
    unknown = [k for k in arguments if k not in properties]
    if unknown:
        return (
            f"unknown argument(s) {', '.join(unknown)}; {tool_.name} takes {', '.join(properties) or 'none'}"
        )
    return None


def _as_text(value: Any) -> str:
    return (
        value
        if isinstance(value, str)
        else json.dumps(value)
        if isinstance(value, (dict, list))
        else str(value)
    )


# Sync tools run here, so a slow one never holds the event loop; bounded, so a flood of hung calls
# cannot start thousands of threads.
_EXECUTOR = ThreadPoolExecutor(max_workers=64, thread_name_prefix="rl-tool")


async def call_tool(tool_: Tool | None, arguments: Any, *, timeout_s: float, name: str = "") -> ToolResult:
    """Run one call; every failure becomes an error result the model sees, never an exception.

    Args:
        tool_: the tool, or None when the model named one that does not exist (``name``).
        arguments: the decoded arguments (a dict when well-formed).
        timeout_s: give up after this many seconds (the result says so).
        name: the name the model used, for the message about an unknown tool.

    Example:
        >>> asyncio.run(call_tool(get_tool("calc"), {"expression": "1/0"}, timeout_s=1)).text
        'error: ZeroDivisionError: division by zero'
    """
    if tool_ is None:
        return ToolResult(f"error: unknown tool {name!r}; available: {', '.join(sorted(TOOLS))}", True)
    problem = _check_arguments(tool_, arguments)
    if problem is not None:
        return ToolResult(f"error: {tool_.name}: {problem}", True)
    try:
        if tool_.is_async:
            value = await asyncio.wait_for(tool_.fn(**arguments), timeout_s)
        else:
            call = functools.partial(tool_.fn, **arguments)
            value = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(_EXECUTOR, call), timeout_s
            )
    except asyncio.TimeoutError:
        return ToolResult(f"error: {tool_.name} timed out after {timeout_s:g} s", True)
    except Exception as exc:  # a tool's failure is the model's observation, not the trainer's crash
        return ToolResult(f"error: {type(exc).__name__}: {exc}", True)
    return ToolResult(_as_text(value))


# -- built-in tools ------------------------------------------------------------------------------

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers, + - * / // % and parentheses are allowed")


@tool(description="Evaluate an arithmetic expression (numbers, + - * / // % and parentheses).")
def calc(expression: str) -> str:
    """Evaluate an arithmetic expression: ``calc("123456+654321")`` is ``'777777'``."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
