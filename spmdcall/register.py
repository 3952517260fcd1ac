"""``@register``: how a worker method is dispatched, executed and collected."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from spmdcall.modes import Dispatch, DispatchMode, Execute, resolve_dispatch_mode, resolve_execute_mode

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class MethodSpec:
    """What ``@register`` recorded for one method."""

    dispatch_mode: DispatchMode | str | dict
    execute_mode: Execute | str = Execute.ALL
    blocking: bool = True
    materialize_futures: bool = True
    timeout: float | None = None
    max_concurrency: int | None = None

    def resolved(self) -> ResolvedSpec:
        # Names are resolved when a group binds the method, so a mode may be registered after the
        # class that uses it is defined (or come from a plugin package).
        return ResolvedSpec(
            resolve_dispatch_mode(self.dispatch_mode),
            resolve_execute_mode(self.execute_mode),
            self.blocking,
            self.materialize_futures,
            self.timeout,
        )


@dataclass(frozen=True)
class ResolvedSpec:
    """A :class:`MethodSpec` with its modes looked up: what a group call runs with."""

    dispatch_mode: DispatchMode
    execute_mode: Execute
    blocking: bool
    materialize_futures: bool
    timeout: float | None


# How many calls of one async def method may run at once on a rank, unless register() says.
DEFAULT_MAX_CONCURRENCY = 1000

# Unregistered public methods: the same arguments to every rank, one result per rank.
DEFAULT_SPEC = MethodSpec(Dispatch.ONE_TO_ALL)


def register(
    dispatch_mode: DispatchMode | str | dict = Dispatch.ALL_TO_ALL,
    execute_mode: Execute | str = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
    timeout: float | None = None,
    max_concurrency: int | None = None,
) -> Callable[[_F], _F]:
    """Declare how a worker method is called on a group. verl's parameter names.

    Calls to one rank run one at a time, in the order they were made, except calls to ``async def``
    methods: those run as tasks on the worker's event loop, so up to ``max_concurrency`` of them
    overlap on every rank (while one awaits, the next starts; they still start in order).

    Args:
        dispatch_mode: how arguments are split across ranks and results merged.
        execute_mode: ``Execute.ALL`` (every rank) or ``Execute.RANK_ZERO`` (rank 0's result, uncollected).
        blocking: ``False`` makes the group call return a ``GroupFuture`` at once.
        materialize_futures: resolve ``GroupFuture`` arguments before dispatching them.
        timeout: seconds after which the call raises ``CallTimeoutError`` (None: wait forever),
            counted from the moment the call is made.
        max_concurrency: for an ``async def`` method, how many calls of it may run at once on one
            rank (None: ``DEFAULT_MAX_CONCURRENCY``, 1000, as for Ray's async actors; 1: one at a
            time, in order). Sync methods always run one at a time.

    Example:
        >>> class Counter:
        ...     @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        ...     def add(self, k): ...
    """
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if max_concurrency is not None and not (
        isinstance(max_concurrency, int) and not isinstance(max_concurrency, bool) and max_concurrency >= 1
    ):
        raise ValueError(f"max_concurrency must be an int >= 1 or None, got {max_concurrency!r}")
    spec = MethodSpec(
        dispatch_mode, execute_mode, bool(blocking), bool(materialize_futures), timeout, max_concurrency
    )
    if isinstance(dispatch_mode, (DispatchMode, dict)):
        resolve_dispatch_mode(dispatch_mode)  # fail at decoration time on a malformed mode
    resolve_execute_mode(execute_mode)

    def decorate(fn: _F) -> _F:
        if not callable(fn):
            raise TypeError(f"@register decorates a method, got {type(fn).__name__}")
        if max_concurrency is not None and not inspect.iscoroutinefunction(fn):
            raise ValueError(
                f"max_concurrency={max_concurrency} is for async def methods; {getattr(fn, '__qualname__', fn)} "
                f"is a plain method, and calls to it run one at a time"
            )
        target: Any = fn  # a function object takes new attributes; Callable does not declare them
        target.__spmd_method__ = spec
        return fn

    return decorate


def _helpers_of_base_classes() -> set[str]:
    # Worker-side helpers the SDK's own base classes define (e.g. Worker.register_mesh): a group
    # does not expose them as group methods.
    from spmdcall.colocate import Colocated
    from spmdcall.worker import Worker

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
    return getattr(fn, "__spmd_method__", DEFAULT_SPEC)


def _overridden(cls: type, name: str) -> bool:
    from spmdcall.colocate import Colocated
    from spmdcall.worker import Worker

    owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
    return owner not in (Worker, Colocated)


def public_methods(cls: type) -> list[str]:
    """Names of every public method of ``cls`` a group exposes, sorted."""
    return sorted(n for n in dir(cls) if method_spec(cls, n) is not None)
