"""How one rank runs the calls it is sent: plain methods one at a time, in the order they were
made; ``async def`` methods as tasks on the rank's event loop, so that many of them overlap.

A worker class with a public ``async def`` method (in any of its colocated roles) is served by an
event loop, as a Ray actor with an async method is. Its plain methods then run on the loop's
thread too, blocking it while they run, so they never interleave with a coroutine's steps. Each
call starts in turn: a coroutine runs up to its first ``await`` before the next call begins.
``register(max_concurrency=n)`` bounds how many calls of one async method run at once on a rank.
A class without async methods is served by a plain loop, which costs less per call.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from spmdcall.runtime import resize
from spmdcall.runtime.reports import RunningCalls
from spmdcall.runtime.specs import DEFAULT_MAX_CONCURRENCY, method_spec
from spmdcall.worker import ClassWithInitArgs


def runs_on_event_loop(cls_with_init: ClassWithInitArgs) -> bool:
    """Whether the workers of ``cls_with_init`` need an event loop (a role has an async method)."""
    classes = [cls_with_init.cls, *(role.cls for role in cls_with_init.roles.values())]
    return any(
        inspect.iscoroutinefunction(inspect.getattr_static(cls, name, None))
        for cls in classes
        for name in dir(cls)
        if not name.startswith("_")
    )


_GROUP_CALLS: dict[str, Callable[..., Any]] = {
    resize.CAN_RESIZE: resize.can_resize,
    resize.RESIZE: resize.resize,
}


class CallRunner:
    """Runs the calls of one rank on ``instance`` (a colocated worker: on its roles), and keeps
    the ones running in ``running`` (for the rank's reports: ``runtime/reports.py``)."""

    def __init__(self, instance: Any):
        self.instance = instance
        self.running = RunningCalls()
        self._is_async: dict[tuple[str | None, str], bool] = {}
        self._limits: dict[tuple[str | None, str], asyncio.Semaphore] = {}

    def target(self, role: str | None) -> Any:
        return self.instance if role is None else self.instance.role(role)

    def is_async(self, role: str | None, method: str) -> bool:
        key = (role, method)
        found = self._is_async.get(key)
        if found is None:
            fn = inspect.getattr_static(type(self.target(role)), method, None)
            found = self._is_async[key] = inspect.iscoroutinefunction(fn)
        return found

    def run(self, role: str | None, method: str, args: tuple, kwargs: dict) -> Any:
        """Run a plain method (a traceback of its error has this frame above the method's)."""
        key = self.running.begin(method)
        try:
            if method in _GROUP_CALLS:  # the group's own calls around a resize (runtime/resize.py)
                return _GROUP_CALLS[method](self.instance, *args)
            return getattr(self.target(role), method)(*args, **kwargs)
        finally:
            self.running.end(key)

    async def run_async(self, role: str | None, method: str, args: tuple, kwargs: dict) -> Any:
        """Run an ``async def`` method, within its ``max_concurrency`` on this rank."""
        key = (role, method)
        limit = self._limits.get(key)
        if limit is None:
            target_cls = type(self.target(role))
            spec = method_spec(target_cls, method)
            n = spec.max_concurrency if spec is not None and spec.max_concurrency else DEFAULT_MAX_CONCURRENCY
            limit = self._limits[key] = asyncio.Semaphore(n)
        async with limit:
            running = self.running.begin(method, asyncio.current_task())
            try:
                return await getattr(self.target(role), method)(*args, **kwargs)
            finally:
                self.running.end(running)
