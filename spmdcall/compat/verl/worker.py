"""verl's ``single_controller.base.worker.Worker``: spmdcall's Worker plus the worker-side API verl's
own workers call (mesh registration, device queries, the ``execute_*`` helpers)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import spmdcall as sc
from spmdcall.compat.verl.decorator import Dispatch, Execute, register


class MeshRegistrationError(ValueError, AssertionError):
    """A mesh registered twice on one worker. A ValueError; also an AssertionError, which is what
    verl raises there and what verl code catches."""


class Worker(sc.Worker):
    """verl's Worker: :class:`spmdcall.Worker` (``self.rank``, ``self.world_size``, ...) with verl's
    constructor and worker-side methods.

    ``super().__init__()`` is optional, as for ``sc.Worker``; it sets verl's ``_rank``,
    ``_world_size``, ``_local_rank``, ``_local_world_size``, ``_master_addr`` and ``_master_port``.

    Args:
        cuda_visible_devices: accepted for verl's signature (verl passes it to workers it places
            next to another); the devices come from the resource pool.

    Example:
        >>> class Actor(Worker):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self._register_dispatch_collect_info("actor", dp_rank=self.rank, is_collect=True)
    """

    _dispatch_dp_rank: dict[str, int]
    _collect_dp_rank: dict[str, bool]

    def __new__(cls, *args: Any, **kwargs: Any):
        self = super().__new__(cls, *args, **kwargs)
        self._dispatch_dp_rank, self._collect_dp_rank = {}, {}
        return self

    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        ctx = self.spmd_context
        self._rank, self._world_size = ctx.rank, ctx.world_size
        self._local_rank, self._local_world_size = ctx.local_rank, ctx.local_world_size
        self._master_addr, self._master_port = ctx.master_addr, str(ctx.master_port)

    # -- verl's mesh registration (its make_nd_compute_dataproto_dispatch_fn reads it) ----------

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this rank's dp rank in ``mesh_name`` and whether its result is collected."""
        if mesh_name in self._dispatch_dp_rank or mesh_name in self._collect_dp_rank:
            raise MeshRegistrationError(f"mesh_name {mesh_name} has been registered")
        self._dispatch_dp_rank[mesh_name] = dp_rank
        self._collect_dp_rank[mesh_name] = is_collect

    def _query_dispatch_info(self, mesh_name: str) -> int:
        if mesh_name not in self._dispatch_dp_rank:
            raise ValueError(f"mesh {mesh_name!r} is not registered in {type(self).__name__}")
        return self._dispatch_dp_rank[mesh_name]

    def _query_collect_info(self, mesh_name: str) -> bool:
        return self.query_collect_info(mesh_name)

    def query_collect_info(self, mesh_name: str) -> bool:
        """Whether this rank's result is collected for ``mesh_name``."""
        if mesh_name not in self._collect_dp_rank:
            raise ValueError(f"mesh {mesh_name!r} is not registered in {type(self).__name__}")
        return self._collect_dp_rank[mesh_name]

    def get_dispatch_collect(self) -> dict[str, dict]:
        """``{"dispatch_dp_rank": {mesh: dp_rank}, "collect_dp_rank": {mesh: is_collect}}``."""
        return {"dispatch_dp_rank": self._dispatch_dp_rank, "collect_dp_rank": self._collect_dp_rank}

    def set_dispatch_collect(
        self, mesh_name: str, dispatch_dp_rank: dict[str, int], collect_dp_rank: dict[str, bool]
    ) -> None:
        """Register ``mesh_name`` from another worker's :meth:`get_dispatch_collect` (as verl: the
        values of the given dicts, the last one winning)."""
        if mesh_name in self._dispatch_dp_rank or mesh_name in self._collect_dp_rank:
            raise MeshRegistrationError(f"{mesh_name} is already registered, {list(self._dispatch_dp_rank)}")
        for dp_rank in dispatch_dp_rank.values():
            self._dispatch_dp_rank[mesh_name] = dp_rank
        for is_collect in collect_dp_rank.values():
            self._collect_dp_rank[mesh_name] = is_collect

    # -- queries ------------------------------------------------------------------------------

    def get_cuda_visible_devices(self) -> str:
        """The GPUs this worker was given, as ``CUDA_VISIBLE_DEVICES`` would list them ("not set").

        On the ray backend these are the ids Ray assigned this rank: that backend shows each rank
        every GPU of its node's ranks in ``CUDA_VISIBLE_DEVICES`` (so ``cuda:LOCAL_RANK`` is its
        own), where verl's workers see only their own.
        """
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
            if gpus:
                return ",".join(str(g) for g in gpus)
        return os.environ.get("CUDA_VISIBLE_DEVICES", "not set")

    def get_master_addr_port(self) -> tuple[str, str]:
        """The torch.distributed rendezvous of this group (``MASTER_ADDR``, ``MASTER_PORT``)."""
        ctx = self.spmd_context
        return ctx.master_addr, str(ctx.master_port)

    # -- verl's execute helpers -----------------------------------------------------------------

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func: Callable, *args: Any, **kwargs: Any) -> Any:
        """``func(self, *chunks)`` on every rank, the DataProto arguments split, results joined."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def execute_func_rank_zero(self, func: Callable, *args: Any, **kwargs: Any) -> Any:
        """``func(*args, **kwargs)`` on rank 0; its result."""
        return func(*args, **kwargs)


class FusedWorker(Worker, sc.Colocated):
    """What ``create_colocated_worker_raw_cls`` returns a subclass of: one instance of every role in
    this process, reachable as ``self.<role>`` (verl's fused worker), and each role's methods
    through ``RayWorkerGroup.fuse``/``spawn``."""

    role_classes: dict[str, sc.ClassWithInitArgs] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        Worker.__init__(self, *args, **kwargs)
        sc.Colocated.__init__(self, self.role_classes)
        self.fused_worker_dict = self.roles

    def __getattr__(self, name: str) -> Any:
        # self.actor, self.critic: the roles (looked up, never set as attributes).
        roles = self.__dict__.get("roles", {})
        if name in roles:
            return roles[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def get_fused_worker_by_name(self, worker_name: str) -> Any:
        return self.roles.get(worker_name)
