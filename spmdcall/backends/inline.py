"""The ``inline`` backend: every rank is an object in the controller's process, called in turn.

Made for debugging: a ``breakpoint()`` inside a worker method stops in your terminal, and a
traceback points at your code. Arguments and results are copied through the same serialisation as
the process backend, so a method that mutates its input behaves the same on every backend, and an
unpicklable argument fails here too. Ranks run one after another, so collectives between ranks
(torch.distributed with world size > 1) need the ``process`` or ``ray`` backend.
"""

from __future__ import annotations

import bdb
import os
import sys
import time
import traceback
from typing import Any

from spmdcall import serialize
from spmdcall.backends import Call
from spmdcall.errors import WorkerError, format_user_traceback
from spmdcall.resource_pool import ResourcePool
from spmdcall.worker import ClassWithInitArgs, SPMDContext, active_context


class _DoneFuture:
    """A call that already ran."""

    def __init__(self, rank: int, method: str, ok: bool, value: Any, started_ns: int, finished_ns: int):
        self.rank, self.method = rank, method
        self.started_ns, self.finished_ns = started_ns, finished_ns
        self._ok, self._value = ok, value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        if not self._ok:
            raise self._value
        return self._value


class InlineBackend:
    """Workers as plain objects in this process. ``copy=False`` passes arguments by reference."""

    name = "inline"
    accepts_rank_futures = False

    def __init__(self, copy: bool = True):
        self.copy = copy
        self._instances: list[Any] = []
        self._contexts: list[SPMDContext] = []

    def start(self, pool: ResourcePool, cls_with_init: ClassWithInitArgs, *, group_name: str) -> None:
        from spmdcall.backends.process import free_port

        self._cls_with_init = cls_with_init
        self._contexts = pool.contexts("127.0.0.1", free_port())
        self._had_process_group = _process_group_initialized()
        self._instances = [self._build(ctx) for ctx in self._contexts]

    def _build(self, ctx: SPMDContext) -> Any:
        with active_context(ctx):
            cls_with_init = _copy_init_args(self._cls_with_init) if self.copy else self._cls_with_init
            try:
                return cls_with_init()
            except Exception as exc:
                raise WorkerError(ctx.rank, "__init__", traceback.format_exc(), type(exc).__name__) from exc

    def submit(self, calls: list[Call]) -> list[_DoneFuture]:
        if self.copy:  # copy (and so check) every argument before running anything
            try:
                copies = [serialize.copy((c.args, c.kwargs)) for c in calls]
                calls = [Call(c.rank, c.method, a, kw, c.role) for c, (a, kw) in zip(calls, copies)]
            except Exception as exc:
                c = calls[0]
                values = {f"argument {i}": a for c in calls for i, a in enumerate(c.args)}
                culprit = serialize.describe_unpicklable(values) or str(exc)
                raise TypeError(f"cannot send {c.method}() to the workers: {culprit}") from exc
        return [self._run(c) for c in calls]

    def _run(self, c: Call) -> _DoneFuture:
        instance = self._instances[c.rank]
        target = instance if c.role is None else instance.role(c.role)
        started = time.time_ns()
        with active_context(self._contexts[c.rank]):
            try:
                ok, value = True, getattr(target, c.method)(*c.args, **c.kwargs)
            except bdb.BdbQuit:
                raise  # "q" in the debugger stops the program, as it would outside a group
            except Exception as exc:
                ok, value = False, WorkerError(c.rank, c.method, format_user_traceback(), type(exc).__name__)
        if ok and self.copy:
            try:
                value = serialize.copy(value)
            except Exception as exc:
                ok, value = (
                    False,
                    TypeError(
                        f"the result of {c.method}() on rank {c.rank} cannot be pickled: {type(exc).__name__}: {exc}"
                    ),
                )
        return _DoneFuture(c.rank, c.method, ok, value, started, time.time_ns())

    def wait(self, futures: list[_DoneFuture], timeout: float | None = None) -> list[Any]:
        return [f.result() for f in futures]

    def worker_info(self) -> list[dict[str, Any]]:
        return [{"rank": ctx.rank, "pid": os.getpid(), "host": "localhost"} for ctx in self._contexts]

    def restart(self, ranks: list[int] | None) -> None:
        for rank in ranks or []:  # inline ranks never die; None restarts nothing
            self._instances[rank] = self._build(self._contexts[rank])

    def shutdown(self) -> None:
        self._instances = []
        # A worker that called init_distributed() made the process group in this very process: a
        # process-backend worker would take it along when it exits, so the inline one goes here.
        if _process_group_initialized() and not getattr(self, "_had_process_group", True):
            import torch.distributed as dist

            dist.destroy_process_group()


def _process_group_initialized() -> bool:
    """Whether torch.distributed has a default process group here (without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _copy_init_args(cls_with_init: ClassWithInitArgs) -> ClassWithInitArgs:
    """A copy of the constructor arguments (each rank gets its own), keeping the class itself:
    copying a class defined in __main__ through cloudpickle would reset its attributes."""
    from spmdcall.colocate import ColocatedClassWithInitArgs, colocate

    if isinstance(cls_with_init, ColocatedClassWithInitArgs):
        return colocate({name: _copy_init_args(role) for name, role in cls_with_init.roles.items()})
    args, kwargs = serialize.copy((cls_with_init.args, cls_with_init.kwargs))
    return ClassWithInitArgs(cls_with_init.cls, *args, **kwargs)
