"""spmdcall: turn any Python class into an SPMD worker group driven from one single controller.

    import spmdcall as sc

    class Counter(sc.Worker):
        def __init__(self, start): self.n = start
        @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
        def add(self, k): self.n += k; return self.n

    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter, start=1)) as wg:
        wg.add(3)   # [4, 4]

This module imports neither torch nor Ray: ``DataProto`` loads torch on first use, the ``ray``
backend loads Ray when a group asks for it.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from spmdcall.backends import (
    Backend,
    Call,
    Capabilities,
    RankFuture,
    available_backends,
    backend_capabilities,
    register_backend,
)
from spmdcall.distributed import build_device_mesh, init_distributed
from spmdcall.errors import (
    CallInterrupted,
    CallTimeoutError,
    ResourceInsufficientError,
    SpmdError,
    WorkerDiedError,
    WorkerError,
)
from spmdcall.group.modes import (
    Chunks,
    Dispatch,
    DispatchMode,
    Execute,
    MeshLayout,
    available_dispatch_modes,
    nd_dispatch,
    register_dispatch_mode,
    split_data,
)
from spmdcall.group.register import register
from spmdcall.group.stats import TransferStats
from spmdcall.group.worker_group import GroupFuture, GroupMethod, WorkerGroup
from spmdcall.resource_pool import ResourcePool
from spmdcall.runtime.reports import RankReport
from spmdcall.runtime.roles import Colocated, colocate
from spmdcall.tracing import trace
from spmdcall.worker import ClassWithInitArgs, MeshRole, SPMDContext, Worker

if TYPE_CHECKING:
    from spmdcall.data import DataProto, WeightChecksumError, WeightGeneration, WeightStore

__version__ = "0.1.0"

__all__ = [
    # defining workers and their methods
    "Worker",
    "register",
    "Dispatch",
    "Execute",
    "DispatchMode",
    "register_dispatch_mode",
    "available_dispatch_modes",
    "split_data",
    "Chunks",
    "nd_dispatch",
    "MeshRole",
    "MeshLayout",
    # building and driving groups
    "ResourcePool",
    "ClassWithInitArgs",
    "WorkerGroup",
    "GroupFuture",
    "GroupMethod",
    "TransferStats",
    "colocate",
    "Colocated",
    "SPMDContext",
    "init_distributed",
    "build_device_mesh",
    # data
    "DataProto",
    "WeightStore",
    "WeightGeneration",
    "WeightChecksumError",
    # backends
    "Backend",
    "Capabilities",
    "Call",
    "RankFuture",
    "register_backend",
    "available_backends",
    "backend_capabilities",
    # errors
    "SpmdError",
    "WorkerError",
    "WorkerDiedError",
    "CallInterrupted",
    "CallTimeoutError",
    "ResourceInsufficientError",
    # observability
    "trace",
    "RankReport",
]
# DataProto needs torch and tensordict (the [torch] extra): without them `from spmdcall import *`
# leaves it out, and `sc.DataProto` says which extra to install.
_NEEDS_TORCH = ("DataProto", "WeightStore", "WeightGeneration", "WeightChecksumError")
if not all(importlib.util.find_spec(package) for package in ("torch", "tensordict")):
    __all__ = [name for name in __all__ if name not in _NEEDS_TORCH]


def __getattr__(name: str) -> Any:
    # DataProto and the weight store need torch; load them only when someone asks for them.
    if name in _NEEDS_TORCH:
        import spmdcall.data

        return getattr(spmdcall.data, name)
    raise AttributeError(f"module 'spmdcall' has no attribute {name!r}")


def __dir__() -> list[str]:
    # What dir(), help() and tab completion show: the public API and the module's own dunders, not
    # the names this file imports to build it, nor the submodules importing them made attributes.
    return sorted([*__all__, *(name for name in globals() if name.startswith("__"))])
