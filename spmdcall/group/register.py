"""``@register``: how a worker method is dispatched, executed and collected."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from spmdcall.group.modes import Dispatch, DispatchMode, Execute, resolve_dispatch_mode, resolve_execute_mode
from spmdcall.runtime.specs import SPEC_ATTR, MethodSpec, method_spec, public_methods

__all__ = ["MethodSpec", "ResolvedSpec", "method_spec", "public_methods", "register", "resolve_spec"]

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class ResolvedSpec:
    """A :class:`MethodSpec` with its modes looked up: what a group call runs with."""

    dispatch_mode: DispatchMode
    execute_mode: Execute
    blocking: bool
    materialize_futures: bool
    timeout: float | None
    warn_after: float | None = None
    on_timeout: str | None = None


def resolve_spec(spec: MethodSpec) -> ResolvedSpec:
    """Look up the modes of ``spec``. Names are resolved when a group binds the method, so a mode may
    be registered after the class that uses it is defined (or come from a plugin package)."""
    dispatch = Dispatch.ONE_TO_ALL if spec.dispatch_mode is None else spec.dispatch_mode
    return ResolvedSpec(
        resolve_dispatch_mode(dispatch),
        resolve_execute_mode(spec.execute_mode),
        spec.blocking,
        spec.materialize_futures,
        spec.timeout,
        spec.warn_after,
        spec.on_timeout,
    )


def check_seconds(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` (the argument ``name``) is None or a positive number."""
    if value is not None and not (
        isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    ):
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")


ON_TIMEOUT = ("leave", "interrupt", "restart")


def check_on_timeout(value: Any, allow_none: bool) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``on_timeout`` policy (or None, if allowed)."""
    if not (isinstance(value, str) and value in ON_TIMEOUT) and not (allow_none and value is None):
        expected = " or ".join(repr(p) for p in ON_TIMEOUT) + (" or None" if allow_none else "")
        raise ValueError(f"on_timeout must be {expected}, got {value!r}")


def _checked_spec(
    dispatch_mode: Any,
    execute_mode: Any,
    blocking: bool,
    materialize_futures: bool,
    timeout: float | None,
    max_concurrency: int | None,
    warn_after: float | None,
    on_timeout: str | None,
) -> MethodSpec:
    """The MethodSpec of ``@register(...)``'s arguments, each checked (a malformed mode fails here,
    at decoration time)."""
    check_seconds("timeout", timeout)
    check_seconds("warn_after", warn_after)
    check_on_timeout(on_timeout, allow_none=True)
    if max_concurrency is not None and not (
        isinstance(max_concurrency, int) and not isinstance(max_concurrency, bool) and max_concurrency >= 1
    ):
        raise ValueError(f"max_concurrency must be an int >= 1 or None, got {max_concurrency!r}")
    spec = MethodSpec(
        dispatch_mode,
        execute_mode,
        bool(blocking),
        bool(materialize_futures),
        timeout,
        max_concurrency,
        warn_after,
        on_timeout,
    )
    if isinstance(dispatch_mode, (DispatchMode, dict)):
        resolve_dispatch_mode(dispatch_mode)  # fail at decoration time on a malformed mode
    resolve_execute_mode(execute_mode)
    return spec


def _check_method(fn: Any, max_concurrency: int | None) -> None:
    if not callable(fn):
        raise TypeError(f"@register decorates a method, got {type(fn).__name__}")
    if max_concurrency is not None and not inspect.iscoroutinefunction(fn):
        raise ValueError(
            f"max_concurrency={max_concurrency} is for async def methods; {getattr(fn, '__qualname__', fn)} "
            f"is a plain method, and calls to it run one at a time"
        )


def register(
    dispatch_mode: DispatchMode | str | dict = Dispatch.ALL_TO_ALL,
    execute_mode: Execute | str = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
    timeout: float | None = None,
    max_concurrency: int | None = None,
    warn_after: float | None = None,
    on_timeout: str | None = None,
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
            rank (None: ``runtime.specs.DEFAULT_MAX_CONCURRENCY``, 1000, as for Ray's async actors; 1: one at a
            time, in order). Sync methods always run one at a time.
        warn_after: seconds after which a call still running logs where every rank is, once
            (``logging.getLogger("spmdcall")``, WARNING), and goes on (None: the group's
            ``warn_after``). See ``WorkerGroup.status()`` for the report it logs.
        on_timeout: what the call's deadline does to the ranks still running it, after their
            reports are taken: ``"leave"`` (the call goes on), ``"interrupt"`` (``CallInterrupted``
            is raised in the thread running it), ``"restart"`` (the ranks are restarted); None: the
            group's ``on_timeout``. An ``async def`` call is cancelled under every policy but
            ``"restart"``. See docs/reliability.md.

    Example:
        >>> class Counter:
        ...     @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        ...     def add(self, k): ...
    """
    spec = _checked_spec(
        dispatch_mode,
        execute_mode,
        blocking,
        materialize_futures,
        timeout,
        max_concurrency,
        warn_after,
        on_timeout,
    )

    def decorate(fn: _F) -> _F:
        _check_method(fn, max_concurrency)
        target: Any = fn  # a function object takes new attributes; Callable does not declare them
        setattr(target, SPEC_ATTR, spec)
        return fn

    return decorate
