"""``Registry``: what every extension point of the trainer keeps its entries in.

Advantage estimators, policy losses, scorers, tool-call formats and tools each have one, filled by
their decorator (``@register_adv_estimator``, ``@register_policy_loss``, ``@register_scorer``,
``@register_tool_format``, ``@tool``) and read by name by the config's checks and by the run. A
registry is a dict (name -> entry, aliases included) with a ``lookup`` whose error names the
value and what exists.

Only the standard library loads here: the config reads the registries before torch is imported.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(dict[str, T]):
    """Name -> entry, for one kind of extension (a plain dict besides ``register`` and ``lookup``).

    Not locked: entries are registered at import time, before anything reads them.

    Args:
        kind: what the entries are, for the error message (``"policy loss"``).
        expected: the rest of that message after ``unknown KIND 'name'; ``: ``{names}`` is the sorted
            list of names, ``{listed}`` the same names joined by commas.

    Example:
        >>> losses = Registry("policy loss")
        >>> losses.register(print, "plain", "p")
        <built-in function print>
        >>> losses.lookup("p") is print, losses.names()
        (True, ['p', 'plain'])
        >>> losses.lookup("ppo")
        Traceback (most recent call last):
        ValueError: unknown policy loss 'ppo'; expected one of ['p', 'plain']
    """

    def __init__(self, kind: str, expected: str = "expected one of {names}"):
        super().__init__()
        self.kind = kind
        self.expected = expected

    def register(self, entry: T, name: str, *aliases: str) -> T:
        """Put ``entry`` under ``name`` and each alias, replacing what was there; returns ``entry``."""
        for key in (name, *aliases):
            self[key] = entry
        return entry

    def lookup(self, name: str) -> T:
        """The entry registered as ``name``.

        Raises:
            ValueError: no such name: the message names it and every registered one.
        """
        try:
            return self[name]
        except (KeyError, TypeError):  # TypeError: an unhashable value (a list from a YAML file)
            raise ValueError(self.unknown(name)) from None

    def names(self) -> list[str]:
        """The registered names (aliases included), sorted."""
        return sorted(self)

    def unknown(self, name: object) -> str:
        """The message for a ``name`` that is not registered."""
        names = self.names()
        return f"unknown {self.kind} {name!r}; " + self.expected.format(names=names, listed=", ".join(names))
