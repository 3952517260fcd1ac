"""The Worker base class, its SPMD context, and ClassWithInitArgs (what a group instantiates)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator


@dataclass(frozen=True)
class SPMDContext:
    """Where one worker sits in its group: the torch.distributed environment, as numbers."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def env(self) -> dict[str, str]:
        """The environment variables ``torch.distributed.init_process_group()`` reads."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }

    @classmethod
    def from_env(cls, env: os._Environ | dict | None = None) -> SPMDContext:
        env = os.environ if env is None else env
        if "RANK" not in env:
            return cls()
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            node_rank=int(env.get("GROUP_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# The inline backend builds every rank in one process, so it cannot use os.environ to tell them
# apart; it sets this while it constructs (and calls) one rank. Other backends leave it None.
_active_context: SPMDContext | None = None


def current_context() -> SPMDContext:
    """The SPMD context of the worker being built or run in this process."""
    return _active_context if _active_context is not None else SPMDContext.from_env()


@contextmanager
def active_context(ctx: SPMDContext) -> Iterator[None]:
    """Make ``ctx`` the current context (and its variables the environment) for the block."""
    global _active_context
    saved_ctx, saved_env = _active_context, {k: os.environ.get(k) for k in ctx.env()}
    _active_context = ctx
    os.environ.update(ctx.env())
    try:
        yield
    finally:
        _active_context = saved_ctx
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Worker:
    """Optional base class for workers: gives ``self.rank``, ``self.world_size`` and friends.

    Any class can be a worker; subclassing ``Worker`` only adds the SPMD context, which is captured
    when the instance is created (so ``__init__`` needs no ``super().__init__()`` call).

    Example:
        >>> class Hello(Worker):
        ...     def hello(self): return f"rank {self.rank} of {self.world_size}"
    """

    _spmd: SPMDContext

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self._spmd = current_context()
        return self

    @property
    def rank(self) -> int:
        return self._spmd.rank

    @property
    def world_size(self) -> int:
        return self._spmd.world_size

    @property
    def local_rank(self) -> int:
        return self._spmd.local_rank

    @property
    def local_world_size(self) -> int:
        return self._spmd.local_world_size

    @property
    def node_rank(self) -> int:
        return self._spmd.node_rank

    @property
    def spmd_context(self) -> SPMDContext:
        return self._spmd


class ClassWithInitArgs:
    """A class and the arguments to build it with, once per rank.

    Example:
        >>> ClassWithInitArgs(dict, a=1)()
        {'a': 1}
    """

    def __init__(self, cls: type, *args: Any, **kwargs: Any):
        if not isinstance(cls, type):
            raise TypeError(f"ClassWithInitArgs expects a class, got {cls!r} of type {type(cls).__name__}")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> Any:
        return self.cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"ClassWithInitArgs({self.cls.__qualname__})"
