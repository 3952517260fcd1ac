"""Valid ranges of numeric config keys, declared in the field's type and checked by name.

A numeric field of a config dataclass says which values it accepts in its annotation, so the
schema, the check and the reference docs read from one place:

    @dataclass(kw_only=True)
    class ActorConfig:
        lr: NonNegativeFloat = 1e-6
        top_p: Annotated[float, Range(gt=0, le=1)] = 1.0

    check_ranges(ActorConfig(lr=-1e-4), "actor.")   # ValueError: actor.lr must be >= 0, got -0.0001

The annotation is ``typing.Annotated``, so type checkers and ``typing.get_type_hints`` see a plain
``float``; only ``check_ranges`` and the docs generator look at the ``Range``. List fields may
annotate their items (``list[Annotated[float, Range(ge=0, lt=1)]]``).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Annotated, Any

__all__ = [
    "Fraction",
    "NonNegativeFloat",
    "NonNegativeInt",
    "PositiveFloat",
    "PositiveInt",
    "Range",
    "check_ranges",
    "describe_ranges",
    "range_of",
]


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: bounds (any of ge, gt, le, lt) plus special values outside them.

    Example:
        >>> 0 in Range(ge=1, also=(-1,)), -1 in Range(ge=1, also=(-1,)), str(Range(gt=0, le=1))
        (False, True, '> 0 and <= 1')
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple[float, ...] = ()
    """Values accepted outside the bounds, each with a documented meaning (fsdp_size=-1: every rank)."""

    def __contains__(self, value: float) -> bool:
        if value in self.also:
            return True
        # Written as "not (value < bound)" would let NaN through; each test is one a NaN fails.
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def __str__(self) -> str:
        bounds = [
            f"{op} {_number(bound)}"
            for op, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            if bound is not None
        ]
        return " and ".join(bounds) + "".join(f" or {_number(v)}" for v in self.also)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


PositiveInt = Annotated[int, Range(ge=1)]
"""A count of at least one (steps, workers, samples, rows per micro-batch)."""
NonNegativeInt = Annotated[int, Range(ge=0)]
"""A count where 0 has a documented meaning (never, none, all, automatic), or a seed."""
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]
Fraction = Annotated[float, Range(ge=0, le=1)]


def range_of(hint: Any) -> Range | None:
    """The Range declared in a type hint (``Annotated[int, Range(...)]``), or None."""
    if typing.get_origin(hint) is Annotated:
        return next((m for m in hint.__metadata__ if isinstance(m, Range)), None)
    return None


def check_ranges(config: Any, prefix: str = "") -> None:
    """Raise ValueError naming the first key of one config section outside its Range.

    The sections inside it are left alone: each checks itself (``Section.check``).

    Args:
        config: a config dataclass instance.
        prefix: the dotted place of ``config`` in its root (``"actor."``), used in the message.

    Example:
        >>> check_ranges(ActorConfig(lr=-1e-4), "actor.")  # doctest: +SKIP
        ValueError: actor.lr must be >= 0, got -0.0001
    """
    for name, hint in _hints(type(config)).items():
        key, value = f"{prefix}{name}", getattr(config, name)
        if (bounds := range_of(hint)) is not None:
            _check(key, value, bounds)
        elif typing.get_origin(hint) is list and (item := range_of(typing.get_args(hint)[0])) is not None:
            for i, v in enumerate(value):
                _check(f"{key}[{i}]", v, item)


def describe_ranges(cls: type) -> dict[str, str]:
    """The declared range of each numeric field of one dataclass, as the reference docs show it.

    Example:
        >>> describe_ranges(ActorConfig)["lr"], describe_ranges(ActorConfig)["betas"]  # doctest: +SKIP
        ('>= 0', 'each >= 0 and < 1')
    """
    out = {}
    for name, hint in _hints(cls).items():
        if (bounds := range_of(hint)) is not None:
            out[name] = str(bounds)
        elif typing.get_origin(hint) is list and (item := range_of(typing.get_args(hint)[0])) is not None:
            out[name] = f"each {item}"
    return out


def _check(key: str, value: Any, bounds: Range) -> None:
    if value not in bounds:
        raise ValueError(f"{key} must be {bounds}, got {value!r}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}
