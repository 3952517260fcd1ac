"""The Worker base class, its SPMD context, and ClassWithInitArgs (what a group instantiates)."""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property
from typing import Any


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

    @cached_property
    def _env_items(self) -> tuple[tuple[str, str], ...]:
        return tuple(self.env().items())

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


# The inline backend builds every rank in one process, so it cannot use os.environ to tell them
# apart; it sets this while it constructs (and calls) one rank. Other backends leave it unset. A
# context variable: each thread (and each asyncio task) sees its own.
_active_context: ContextVar[SPMDContext | None] = ContextVar("spmdcall_active_context", default=None)


def current_context() -> SPMDContext:
    """The SPMD context of the worker being built or run in this process."""
    ctx = _active_context.get()
    return ctx if ctx is not None else SPMDContext.from_env()


class active_context:  # lower-case, as contextlib.suppress: used as ``with active_context(ctx):``
    """Make ``ctx`` the current context (and its variables the environment) for the block. The
    environment is the process's: callers that run ranks from several threads hold a lock. Only the
    variables that differ are written, and only those are put back after the block. (A class rather
    than a generator: the inline backend enters one for every call on every rank.)"""

    __slots__ = ("ctx", "saved", "token")

    def __init__(self, ctx: SPMDContext):
        self.ctx = ctx

    def __enter__(self) -> None:
        environ = os.environ
        saved: dict[str, str | None] = {}
        for key, value in self.ctx._env_items:
            old = environ.get(key)
            if old != value:
                saved[key] = old
                environ[key] = value
        self.saved = saved
        self.token = _active_context.set(self.ctx)

    def __exit__(self, *exc_info: object) -> None:
        _active_context.reset(self.token)
        environ = os.environ
        for key, old in self.saved.items():
            if old is not None:
                environ[key] = old
            else:
                try:
                    del environ[key]
                except KeyError:  # the block removed it
                    pass


def adopt_context(worker: Any, ctx: SPMDContext) -> None:
    """Give a built worker its new place after its group resized: a :class:`Worker`'s ``rank``,
    ``world_size`` and friends follow ``ctx``, and so do this process's ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``... variables, unless a backend sets the context for each call (inline: its
    ranks share the controller's process, and the backend's own contexts hold it)."""
    if isinstance(worker, Worker):
        worker._spmd = ctx
    if _active_context.get() is None:
        os.environ.update(ctx.env())


# The fused worker of ``sc.colocate`` sets this while it builds its roles, so that each role (a
# Worker) keeps a link to the colocation it belongs to: the one of its own rank, also on the inline
# backend, where every rank's colocation lives in this one process.
_building_colocation: ContextVar[Any] = ContextVar("spmdcall_building_colocation", default=None)


@contextlib.contextmanager
def building_colocation(colocation: Any) -> Iterator[None]:
    """Within the block, every Worker built is a role of ``colocation`` (its ``sibling()`` looks
    there). For the fused worker of ``sc.colocate`` (``runtime/roles.py``), while it builds its roles."""
    token = _building_colocation.set(colocation)
    try:
        yield
    finally:
        _building_colocation.reset(token)


@dataclass(frozen=True)
class MeshRole:
    """One rank's place in a named mesh: its dp rank, the dp size, and whether it reports results."""

    dp_rank: int
    dp_size: int
    is_collect: bool


class Worker:
    """Optional base class for workers: gives ``self.rank``, ``self.world_size`` and friends.

    Any class can be a worker; subclassing ``Worker`` only adds the SPMD context, which is captured
    when the instance is created (so ``__init__`` needs no ``super().__init__()`` call).

    Example:
        >>> class Hello(Worker):
        ...     def hello(self): return f"rank {self.rank} of {self.world_size}"
    """

    _spmd: SPMDContext
    _spmd_meshes: dict[str, MeshRole]
    _spmd_colocation: weakref.ref | None  # the colocation this instance is a role of (weak: no cycle)

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self._spmd = current_context()
        self._spmd_meshes = {}
        colocation = _building_colocation.get()
        self._spmd_colocation = None if colocation is None else weakref.ref(colocation)
        return self

    def sibling(self, role: str) -> Any:
        """The object playing ``role`` beside this one in its colocation: same rank, same process.

        Roles fused with ``sc.colocate`` reach each other through this, in process and without the
        controller (a rollout taking the actor's weights, say). Roles are built in the order given
        to ``sc.colocate``; in ``__init__`` only the ones built before this one exist.

        Args:
            role: the sibling's role name, as given to ``sc.colocate``.

        Raises:
            RuntimeError: this worker is not a role of a colocation (its group was not built from
                ``sc.colocate``), or the sibling is not built yet.
            ValueError: the colocation has no role of that name.

        Example:
            >>> class Rollout(Worker):
            ...     def sync_weights(self):
            ...         self.model.load_state_dict(self.sibling("actor").model.state_dict())
        """
        colocation = self._spmd_colocation() if self._spmd_colocation is not None else None
        if colocation is None:
            raise RuntimeError(
                f"{type(self).__qualname__} is not a role of a colocation, so it has no sibling {role!r}: "
                f"build its group from sc.colocate({{{role!r}: ..., ...}}) to run it beside that role"
            )
        return colocation.role(role)

    def register_mesh(
        self,
        name: str,
        *,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        is_collect: bool | None = None,
        mesh: Any = None,
        dp_axis: str = "dp",
    ) -> MeshRole:
        """Declare this rank's place in the mesh ``name`` for ``sc.nd_dispatch(name)``.

        Either give the numbers, or a ``torch.distributed.DeviceMesh`` and the name of its dp axis
        (the collect rank of each dp rank is then the one at local rank 0 on every other axis).

        Args:
            name: the mesh name used in ``nd_dispatch(name)``.
            dp_rank: this rank's data-parallel rank.
            dp_size: how many data-parallel ranks the mesh has.
            is_collect: whether this rank's result is kept (one per dp rank).
            mesh: a DeviceMesh to read the three numbers from instead.
            dp_axis: the DeviceMesh axis that is data parallel.

        Example:
            >>> self.register_mesh("actor", dp_rank=self.rank // 2, dp_size=2, is_collect=self.rank % 2 == 0)  # doctest: +SKIP
        """
        if mesh is not None:
            names = list(mesh.mesh_dim_names or ())
            if dp_axis not in names:
                raise ValueError(f"mesh axes are {names}; dp_axis {dp_axis!r} is not one of them")
            dp_rank, dp_size = mesh.get_local_rank(dp_axis), mesh.size(names.index(dp_axis))
            is_collect = all(mesh.get_local_rank(a) == 0 for a in names if a != dp_axis)
        if not (isinstance(dp_rank, int) and isinstance(dp_size, int) and 0 <= dp_rank < dp_size):
            raise ValueError(
                f"mesh {name!r}: need 0 <= dp_rank < dp_size, got dp_rank={dp_rank!r}, dp_size={dp_size!r}"
            )
        if not isinstance(is_collect, bool):
            raise TypeError(f"mesh {name!r}: is_collect must be True or False, got {is_collect!r}")
        role = MeshRole(dp_rank, dp_size, is_collect)
        existing = self._spmd_meshes.get(name)
        if existing is not None and existing != role:
            raise ValueError(
                f"rank {self.rank} already declared mesh {name!r} as {existing}; conflicting new declaration {role}"
            )
        self._spmd_meshes[name] = role
        return role

    def on_resize(self, rank: int, world_size: int) -> None:
        """Called on every live rank after its group grew or shrank (``WorkerGroup.resize``), once
        ``self.rank``, ``self.world_size`` and the ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
        ``LOCAL_WORLD_SIZE`` variables say the rank's new place. Does nothing by default.

        A rank that joined torch.distributed cannot resize with this default: its process group
        still has the old ranks. Override it to rebuild the group (``destroy_process_group()``,
        then ``init_process_group()`` with the new variables, on every rank at once); a group
        refuses to resize while a rank has a process group and keeps this default.

        Example:
            >>> class Trainer(Worker):
            ...     def on_resize(self, rank, world_size):
            ...         torch.distributed.destroy_process_group()  # doctest: +SKIP
            ...         torch.distributed.init_process_group("gloo")  # doctest: +SKIP
        """

    def _spmd_mesh_role(self, name: str) -> MeshRole | None:
        return self._spmd_meshes.get(name)

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

    ``roles`` is empty for a class that plays one role. A class that plays several on each rank (what
    :func:`spmdcall.colocate` builds, or a subclass of ``sc.Colocated``) lists them there, role name
    -> the ClassWithInitArgs of each; its instances answer ``role(name)``, and
    ``WorkerGroup.spawn`` gives one view per role.

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
        self.roles: dict[str, ClassWithInitArgs] = {}

    def __call__(self) -> Any:
        return self.cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"ClassWithInitArgs({self.cls.__qualname__})"
