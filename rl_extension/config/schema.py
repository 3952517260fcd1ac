"""What every config section shares: the ``Section`` base that checks itself, and reading the schema.

A section is a ``@dataclass(kw_only=True)`` subclass of ``Section``; each field has a type (a
numeric one with its ``Range``), a default and a docstring. ``config_keys`` and ``field_docs`` read
them for the command line and the reference docs.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
import warnings
from collections.abc import Callable
from typing import Any

from rl_extension.config.ranges import check_ranges
from rl_extension.data.scorers import get_scorer

__all__ = [
    "Section",
    "check_registered",
    "check_scorer",
    "config_keys",
    "field_docs",
    "field_types",
    "warn_if_changed",
]


class Section:
    """Base of every config section: ``check`` validates the section's own keys, then the sections inside it.

    A section whose keys constrain each other extends ``check`` (calling ``super().check(prefix)``
    first, so that every value is in its range before the rule reads it).
    """

    def check(self, prefix: str = "") -> None:
        """Raise ValueError naming the first key outside its declared range or at odds with the others.

        Args:
            prefix: the dotted place of this section in its root (``"actor."``), used in messages.

        Example:
            >>> ActorConfig(betas=[0.9]).check("actor.")  # doctest: +SKIP
            ValueError: actor.betas must hold two numbers [beta1, beta2], got [0.9]
        """
        check_ranges(self, prefix)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Section):
                value.check(f"{prefix}{f.name}.")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Each field of a config dataclass and its type (``Annotated`` ranges stripped)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def config_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config class, in declaration order.

    Example:
        >>> "rollout.temperature" in config_keys(PPOConfig)
        True
    """
    keys = []
    for name, tp in field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            keys += config_keys(tp, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The documentation string written under each field of a config dataclass (inherited fields included).

    Example:
        >>> field_docs(RolloutConfig)["n"]
        'Responses sampled per prompt (the GRPO group size).'
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's docstring of a field it redeclares wins
        if dataclasses.is_dataclass(klass):
            docs |= _own_field_docs(klass)
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def check_registered(key: str, name: str, lookup: Callable[[str], object]) -> None:
    """Raise ValueError naming ``key`` when ``lookup`` (a registry's ``get_...``) does not know ``name``.

    The registry is read now, so a name that user code registered before the config was built passes.

    Example:
        >>> check_registered("algorithm.adv_estimator", "ppo", get_advantage_estimator)  # doctest: +SKIP
        ValueError: algorithm.adv_estimator: unknown advantage estimator 'ppo'; expected one of ['gae', ...]
    """
    try:
        lookup(name)
    except ValueError as exc:
        hint = " (a name your own code registers needs its module in imports=[...])"
        raise ValueError(f"{key}: {exc}{hint}") from None


def check_scorer(key: str, name: str) -> None:
    """Raise ValueError naming ``key`` when ``name`` is neither empty, ``module:function``, nor a registered scorer."""
    if name and ":" not in name:
        check_registered(key, name, get_scorer)


def warn_if_changed(section: Any, name: str, reason: str) -> None:
    """Warn, naming the keys, if ``section`` differs from its defaults: the run will ignore them."""
    default = type(section)()
    changed = [
        f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)
    ]
    if changed:
        warnings.warn(f"{', '.join(f'{name}.{k}' for k in changed)} ignored: {reason}", stacklevel=4)
