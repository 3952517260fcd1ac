"""What ``@register`` records on a worker method, and which methods a group exposes.

A spec is recorded on the function itself (``SPEC_ATTR``), so it travels with the class to every
process. Its modes stay as the user gave them (an object, a name or a dict): the group resolves
them when it binds the method, so that a mode may be registered after the class is defined.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from spmdcall.runtime.roles import Colocated
from spmdcall.worker import Worker

SPEC_ATTR = "__spmd_method__"

# How many calls of one async def method may run at once on a rank, unless register() says.
DEFAULT_MAX_CONCURRENCY = 1000


@dataclass(frozen=True)
class MethodSpec:
    """What ``@register`` recorded for one method.

    ``dispatch_mode`` and ``execute_mode`` are a mode object, its name or a dict, resolved by the
    group; ``dispatch_mode=None`` is an unregistered public method (the same arguments to every
    rank, one result per rank).
    """

    dispatch_mode: Any = None
    execute_mode: Any = "ALL"
    blocking: bool = True
    materialize_futures: bool = True
    timeout: float | None = None
    max_concurrency: int | None = None
    warn_after: float | None = None
    on_timeout: str | None = None


UNREGISTERED = MethodSpec()


def _helpers_of_base_classes() -> set[str]:
    # Worker-side helpers the SDK's own base classes define (e.g. Worker.register_mesh): a group
    # does not expose them as group methods.
    return {
        n
        for base in (Worker, Colocated)
        for n, v in vars(base).items()
        if callable(v) and not n.startswith("_")
    }


def method_spec(cls: type, name: str) -> MethodSpec | None:
    """The spec of ``cls.name`` if it is a public method (registered or not), else None."""
    if name.startswith("_"):
        return None
    if name in _helpers_of_base_classes() and not _overridden(cls, name):
        return None
    try:
        attr = inspect.getattr_static(cls, name)
    except AttributeError:
        return None
    fn: Any = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
    if not callable(fn) or isinstance(attr, property):
        return None
    return getattr(fn, SPEC_ATTR, UNREGISTERED)


def _overridden(cls: type, name: str) -> bool:
    owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
    return owner not in (Worker, Colocated)


def public_methods(cls: type) -> list[str]:
    """Names of every public method of ``cls`` a group exposes, sorted."""
    return sorted(n for n in dir(cls) if method_spec(cls, n) is not None)
