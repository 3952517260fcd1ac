"""verl's ``single_controller.ray``: resource pools, classes with init args, worker groups and
colocation, on top of :class:`spmdcall.WorkerGroup` and any backend."""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
import warnings
from collections.abc import Iterable
from typing import Any, cast

import spmdcall as sc
from spmdcall.backends import backend_capabilities
from spmdcall.compat.verl.worker import FusedWorker
from spmdcall.group.detached import attach
from spmdcall.group.modes import collect_all_to_all

_IGNORED_GROUP_OPTIONS = ("master_addr", "master_port", "profile_steps", "worker_nsight_options")
# What verl sets in every worker's environment itself, and spmdcall too (SPMDContext.env()).
_PROTECTED_ENV = {"WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR"}
_PROTECTED_ENV |= {"MASTER_PORT", "WG_PREFIX", "WG_BACKEND", "RAY_LOCAL_WORLD_SIZE"}
_default_backend: str | sc.Backend | None = None


# -- backends ------------------------------------------------------------------------------------


def set_default_backend(backend: str | sc.Backend | None) -> None:
    """Choose the backend of every ``RayWorkerGroup`` built without ``backend=``.

    Args:
        backend: a backend name (``"process"``, ``"ray"``, ``"inline"``, a registered one), a
            Backend instance, or None to go back to the automatic choice (:func:`default_backend`).

    Example:
        >>> set_default_backend("process")   # run a verl-style driver without a Ray cluster
        >>> default_backend()
        'process'
        >>> set_default_backend(None)
    """
    global _default_backend
    if backend is not None and not isinstance(backend, (str, sc.Backend)):
        raise TypeError(f"backend must be a backend name, a Backend or None, got {type(backend).__name__}")
    _default_backend = backend


def default_backend() -> str | sc.Backend:
    """The backend a ``RayWorkerGroup`` uses when none is given: the one chosen with
    :func:`set_default_backend`, else ``"ray"`` if Ray is installed, else ``"process"``."""
    if _default_backend is not None:
        return _default_backend
    return "ray" if importlib.util.find_spec("ray") is not None else "process"


# -- resources and classes -----------------------------------------------------------------------


class RayResourcePool(sc.ResourcePool):
    """verl's ``RayResourcePool``: an :class:`spmdcall.ResourcePool` with verl's defaults.

    ``use_gpu`` defaults to True, as in verl, and is passed on as given. On the ``ray`` backend each
    worker then reserves its share of a GPU, so on a machine without GPUs placement fails with
    ``ResourceInsufficientError`` (after the backend's ``placement_timeout``) just as verl's would
    wait for GPUs that never come: pass ``use_gpu=False`` there, as verl's own CPU tests do (or
    start Ray with logical GPUs, ``ray.init(num_gpus=8)``). The ``process`` backend reserves
    nothing; with ``use_gpu=True`` it only records that workers use ``cuda:LOCAL_RANK``.

    ``max_colocate_count`` defaults to 10 (verl's value): up to ten groups may share the pool's
    devices, each taking a tenth of a bundle on the ray backend.

    Args:
        process_on_nodes: worker processes per node, e.g. ``[2]`` or ``[8, 8]``.
        use_gpu: each worker uses a GPU.
        name_prefix: accepted for verl's signature; spmdcall names its Ray objects itself (unique).
        max_colocate_count: how many groups may share the devices.
        detached: every group on this pool outlives its driver (ray backend only).
        accelerator_type: not supported (a warning if set).
        **options: more :class:`spmdcall.ResourcePool` arguments (``placement_strategy``,
            ``num_cpus_per_worker``).

    Example:
        >>> RayResourcePool([2, 2], use_gpu=False).world_size
        4
    """

    def __init__(
        self,
        process_on_nodes: list[int] | None = None,
        use_gpu: bool = True,
        name_prefix: str | None = None,
        max_colocate_count: int = 10,
        detached: bool = False,
        accelerator_type: str | None = None,
        **options: Any,
    ):
        if process_on_nodes is None:
            raise TypeError(
                "RayResourcePool needs process_on_nodes, the number of worker processes per node, e.g. [2]"
            )
        if accelerator_type is not None:
            warnings.warn(
                f"RayResourcePool(accelerator_type={accelerator_type!r}) is ignored by spmdcall; "
                "pass resources_per_worker={...} to RayWorkerGroup on the ray backend instead",
                stacklevel=2,
            )
        super().__init__(process_on_nodes, use_gpu=use_gpu, max_colocate_count=max_colocate_count, **options)
        self.name_prefix = name_prefix
        self.detached = bool(detached)

    @property
    def store(self) -> list[int]:
        """Processes per node (verl's name for ``process_on_nodes``)."""
        return self.process_on_nodes

    def get_placement_groups(
        self, strategy: str = "STRICT_PACK", name: str | None = None, device_name: str = "cuda"
    ) -> list:
        """The Ray placement groups the groups on this pool run in, one per node.

        spmdcall places a pool when its first group starts and frees it when the last one is
        shut down, so this is ``[]`` while no group runs on the pool (verl creates them here).
        """
        if "ray" not in sys.modules:
            return []
        import ray

        if not ray.is_initialized():
            return []
        from spmdcall.backends.ray import placement as ray_placement

        return ray_placement.placement_groups(self)


def mesh_info(group: RayWorkerGroup, mesh_name: str, what: str) -> list:
    """verl's per-mesh facts of ``group``'s ranks, asked from the workers once and kept on the group:
    each rank's dp rank (``what="dispatch"``) or whether it is a collect rank (``"collect"``), from
    the ``Worker._register_dispatch_collect_info`` each rank made (for
    ``make_nd_compute_dataproto_dispatch_fn``)."""
    cache = group._dispatch_info if what == "dispatch" else group._collect_info
    if mesh_name not in cache:
        cache[mesh_name] = sc.WorkerGroup.execute_all(group, f"_query_{what}_info", mesh_name)
    return cache[mesh_name]


def split_resource_pool(resource_pool: sc.ResourcePool, split_size: int | list[int]) -> list[sc.ResourcePool]:
    """verl's ``split_resource_pool``: :meth:`spmdcall.ResourcePool.split`, parts of consecutive
    ranks that keep their devices (``split_size``: the size of every part, or a list of sizes).

    Example:
        >>> [p.world_size for p in split_resource_pool(RayResourcePool([4, 4]), [2, 6])]
        [2, 6]
    """
    return resource_pool.split(split_size)


def merge_resource_pool(rp1: sc.ResourcePool, rp2: sc.ResourcePool) -> sc.ResourcePool:
    """verl's ``merge_resource_pool``: :meth:`spmdcall.ResourcePool.merge` of the two pools.

    Example:
        >>> merge_resource_pool(RayResourcePool([4]), RayResourcePool([4])).world_size
        8
    """
    if getattr(rp1, "detached", False) != getattr(rp2, "detached", False):
        raise ValueError("a detached RayResourcePool cannot be merged with one that is not")
    return sc.ResourcePool.merge([rp1, rp2])


def _unwrap_ray_remote(cls: Any) -> Any:
    # ray.remote(cls) returns an ActorClass that keeps the user's class here; spmdcall's backends
    # build the plain class (the ray backend makes its own actor around it).
    return getattr(cls, "__ray_actor_class__", cls)


class RayClassWithInitArgs(sc.ClassWithInitArgs):
    """verl's ``RayClassWithInitArgs``: a class (plain or ``@ray.remote``) and its constructor arguments.

    Example:
        >>> RayClassWithInitArgs(cls=dict, a=1)()
        {'a': 1}
    """

    # verl code sets this on classes made by create_colocated_worker_raw_cls; spmdcall sees that
    # from the class itself.
    fused_worker_used = False

    def __init__(self, cls: Any, *args: Any, **kwargs: Any):
        super().__init__(_unwrap_ray_remote(cls), *args, **kwargs)
        if issubclass(self.cls, FusedWorker):  # its roles, for RayWorkerGroup.spawn and fuse
            self.roles = dict(self.cls.role_classes)

    def update_options(self, options: dict) -> None:
        """Not supported: Ray actor options do not apply to spmdcall's workers (a warning)."""
        warnings.warn(
            f"RayClassWithInitArgs.update_options({options!r}) is ignored by spmdcall; pass backend options "
            "to RayWorkerGroup instead (e.g. runtime_env=..., env=... on the ray backend)",
            stacklevel=2,
        )

    def set_additional_resource(self, additional_resource: dict) -> None:
        """Not supported (a warning): use ``RayWorkerGroup(..., resources_per_worker=...)`` on the ray backend."""
        warnings.warn(
            f"RayClassWithInitArgs.set_additional_resource({additional_resource!r}) is ignored by spmdcall; "
            "pass resources_per_worker={...} to RayWorkerGroup on the ray backend instead",
            stacklevel=2,
        )


def create_colocated_worker_cls(class_dict: dict[str, sc.ClassWithInitArgs]) -> sc.ClassWithInitArgs:
    """verl's colocation: :func:`spmdcall.colocate`. One process per rank holds every role.

    ``RayWorkerGroup(pool, create_colocated_worker_cls(d)).spawn(prefix_set=d.keys())`` returns one
    group per role, each with the role's own method names.

    Example:
        >>> fused = create_colocated_worker_cls({"actor": RayClassWithInitArgs(cls=dict)})
        >>> sorted(fused.roles)
        ['actor']
    """
    return sc.colocate(dict(class_dict))


# verl's newer fused variant; spmdcall's colocation is already one fused class.
create_colocated_worker_cls_fused = create_colocated_worker_cls


def create_colocated_worker_raw_cls(class_dict: dict[str, sc.ClassWithInitArgs]) -> type[FusedWorker]:
    """verl's fused worker class: subclass it to add methods that use several roles at once
    (``self.actor``, ``self.critic``); ``RayWorkerGroup.fuse(roles)`` then gives the group one
    attribute per role.

    Example:
        >>> Fused = create_colocated_worker_raw_cls({"actor": RayClassWithInitArgs(cls=dict)})
        >>> Fused.__name__
        'FusedWorker_actor'
    """
    for name, cls_with_init in class_dict.items():
        if not (isinstance(name, str) and name.isidentifier()):
            raise ValueError(f"role names must be identifiers, got {name!r}")
        if not isinstance(cls_with_init, sc.ClassWithInitArgs):
            raise TypeError(
                f"role {name!r} must be a RayClassWithInitArgs, got {type(cls_with_init).__name__}"
            )
    name = "_".join(["FusedWorker", *class_dict])
    return type(name, (FusedWorker,), {"role_classes": dict(class_dict)})


# -- groups --------------------------------------------------------------------------------------


class ObjectRefs(list):
    """What a non-blocking call returns on the ray backend, as in verl: a list of Ray ObjectRefs,
    one per rank, that ``ray.get`` turns into the results (and Ray resolves when they are passed
    on). ``.get()`` does the same, so code written for a GroupFuture runs unchanged."""

    def get(self, timeout: float | None = None) -> list:
        import ray

        return ray.get(list(self), timeout=timeout)

    def done(self) -> bool:
        import ray

        return len(ray.wait(list(self), num_returns=len(self), timeout=0)[0]) == len(self)


def _warn_of_ignored_options(
    resource_pool: sc.ResourcePool,
    kwargs: dict[str, Any],
    bin_pack: bool,
    ray_wait_register_center_timeout: int,
    device_name: str,
) -> None:
    """Warn of each verl option spmdcall does not use, and take it out of ``kwargs``."""
    use_gpu = kwargs.pop("use_gpu", None)
    if use_gpu is not None and bool(use_gpu) != resource_pool.use_gpu:
        warnings.warn(
            f"RayWorkerGroup(use_gpu={use_gpu}) is ignored: the resource pool's use_gpu="
            f"{resource_pool.use_gpu} decides",
            stacklevel=3,
        )
    for key in _IGNORED_GROUP_OPTIONS:
        value = kwargs.pop(key, None)
        if value is not None:
            warnings.warn(f"RayWorkerGroup({key}={value!r}) is ignored by spmdcall", stacklevel=3)
    if not bin_pack and resource_pool.placement_strategy == "STRICT_PACK":
        warnings.warn(
            "RayWorkerGroup(bin_pack=False) is ignored: pass placement_strategy='PACK' to the resource pool",
            stacklevel=3,
        )
    if ray_wait_register_center_timeout != 300:  # verl's default: the caller set it
        warnings.warn(
            "RayWorkerGroup(ray_wait_register_center_timeout=...) is ignored: pass start_timeout=... "
            "(seconds for the workers to start) instead",
            stacklevel=3,
        )
    if device_name not in ("cuda", "cpu"):
        warnings.warn(
            f"RayWorkerGroup(device_name={device_name!r}) is ignored: workers use cuda:LOCAL_RANK when "
            "the pool has use_gpu=True, the CPU otherwise",
            stacklevel=3,
        )


class RayWorkerGroup(sc.WorkerGroup):
    """verl's ``RayWorkerGroup``: an :class:`spmdcall.WorkerGroup` on any backend.

    Non-blocking calls (``execute_all``, ``execute_all_async``, methods registered with
    ``blocking=False`` whose results are a list) return what verl returns on the ray backend: Ray
    ObjectRefs (``ray.get`` them, or call ``.get()``; ``execute_rank_zero*_async``: one
    ObjectRef). On other backends they return a GroupFuture (``.get()``). ``DP_COMPUTE_PROTO``
    and other data-joining methods return a GroupFuture everywhere (verl: a DataProtoFuture).
    ObjectRef arguments reach the workers as values: Ray resolves them on the ray backend; on
    the others the controller fetches them first.

    Args:
        resource_pool: a ``RayResourcePool`` (or any ``spmdcall.ResourcePool``).
        ray_cls_with_init: a ``RayClassWithInitArgs``, or what ``create_colocated_worker_cls`` returned.
        bin_pack: verl's packing switch; spmdcall takes the pool's ``placement_strategy``
            (``"STRICT_PACK"`` by default). ``False`` only warns.
        name_prefix: a readable name for the group (made unique).
        detached: the workers outlive the driver (ray backend only); another driver reaches them
            with :meth:`from_detached`, given this group's ``worker_names``.
        worker_names: not supported here: use :meth:`from_detached`.
        worker_handles: not supported, as ``worker_names``.
        ray_wait_register_center_timeout: not used (set ``start_timeout=`` instead); a warning
            if changed.
        backend: where the workers run; :func:`default_backend` when None.
        device_name: ``"cuda"`` or ``"cpu"``; devices come from the pool's ``use_gpu``.
        worker_env: extra environment variables for every worker; the ones spmdcall and verl set
            themselves (``WORLD_SIZE``, ``RANK``, ...) are refused with a ValueError.
        **kwargs: :class:`spmdcall.WorkerGroup` keywords (``default_timeout``) and backend options
            (``start_timeout``, ``runtime_env``, ...). verl's ``master_addr``, ``master_port``,
            ``profile_steps`` and ``worker_nsight_options`` are ignored with a warning.

    Example:
        >>> wg = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(cls=Actor))  # doctest: +SKIP
        >>> wg.execute_all_sync("init_model")  # doctest: +SKIP
    """

    _dispatch_info: dict[str, list[int]]
    _collect_info: dict[str, list[bool]]
    _fused: dict[str, RayWorkerGroup]

    def __init__(
        self,
        resource_pool: sc.ResourcePool | None = None,
        ray_cls_with_init: sc.ClassWithInitArgs | None = None,
        bin_pack: bool = True,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: list[str] | None = None,
        worker_handles: list | None = None,
        ray_wait_register_center_timeout: int = 300,
        *,
        backend: str | sc.Backend | None = None,
        device_name: str = "cuda",
        worker_env: dict[str, str] | None = None,
        name: str | None = None,
        **kwargs: Any,
    ):
        if worker_names is not None or worker_handles is not None:
            raise TypeError(
                "RayWorkerGroup(worker_names=..., worker_handles=...) is not supported: to reach the workers "
                "of a detached group from another driver, use RayWorkerGroup.from_detached(worker_names=...)"
            )
        if resource_pool is None or ray_cls_with_init is None:
            raise TypeError("RayWorkerGroup needs a resource_pool and a ray_cls_with_init")
        _warn_of_ignored_options(
            resource_pool, kwargs, bin_pack, ray_wait_register_center_timeout, device_name
        )
        conflicts = sorted(_PROTECTED_ENV & set(worker_env or {}))
        if conflicts:
            raise ValueError(
                f"Cannot override protected system env: {conflicts} (spmdcall sets them for every worker)"
            )
        backend = default_backend() if backend is None else backend
        # What the backend declares; its options apply only to one given by name.
        by_name, declared = isinstance(backend, str), backend_capabilities(backend)
        if by_name and declared.env:
            # verl's workers also find how many ranks share their node here (verl: the first node's count).
            env = {"RAY_LOCAL_WORLD_SIZE": str(resource_pool.process_on_nodes[0]), **dict(worker_env or {})}
            kwargs["env"] = {**env, **kwargs.get("env", {})}
        elif worker_env:
            kwargs["env"] = {**dict(worker_env), **kwargs.get("env", {})}
        if detached or getattr(resource_pool, "detached", False):
            if not (by_name and declared.detached):
                raise ValueError(
                    f"detached groups need a backend that takes detached= (ray does); this group runs on {backend!r}"
                )
            kwargs["detached"] = True
        super().__init__(resource_pool, ray_cls_with_init, backend, name=name or name_prefix, **kwargs)

    @classmethod
    def from_detached(
        cls,
        name_prefix: str | None = None,
        worker_names: list[str] | None = None,
        worker_handles: list | None = None,
        ray_cls_with_init: sc.ClassWithInitArgs | None = None,
        **kwargs: Any,
    ) -> RayWorkerGroup:
        """The group whose workers are ``worker_names`` (another driver's ``wg.worker_names``),
        driven from here. The group must have been built with ``detached=True`` (ray backend).

        Example:
            >>> wg = RayWorkerGroup.from_detached(worker_names=names)  # doctest: +SKIP
        """
        names = list(worker_names or [])
        groups = {re.sub(r":rank\d+(\.\d+)?$", "", name) for name in names}
        if worker_handles is not None or len(groups) != 1:
            raise ValueError(
                f"from_detached needs worker_names, the worker_names of one detached group, got {worker_names!r}"
            )
        group_name = groups.pop()
        try:
            return cast(RayWorkerGroup, attach(group_name, group_cls=cls))
        except ValueError as exc:
            raise ValueError(
                f"{exc}. from_detached reaches groups built with detached=True (their workers outlive their "
                "driver); build the group with RayWorkerGroup(..., detached=True)"
            ) from None

    @property
    def worker_names(self) -> list[str]:
        """One name per rank: the Ray actor's on the ray backend (see :meth:`from_detached`)."""
        return [info.get("actor_name") or f"{self.name}:rank{info['rank']}" for info in self.worker_info()]

    # The overrides below keep verl's signatures and return types on purpose (verl drivers call
    # them that way), so they differ from the core WorkerGroup's.

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, RayWorkerGroup]:  # type: ignore[override]
        """One group per role of a colocated or fused group (verl: ``wg.spawn(prefix_set=class_dict.keys())``)."""
        return cast("dict[str, RayWorkerGroup]", super().spawn(set(prefix_set)))

    def fuse(self, prefix_set: Iterable[str]) -> None:
        """Make every role of a fused group an attribute of it: ``wg.actor.update(...)`` (verl's ``fuse``)."""
        self._fused = self.spawn(prefix_set)

    def __getattr__(self, name: str) -> Any:
        if name in _VERL_STATE:  # verl's caches of this group, made on first use (views start empty)
            self.__dict__[name] = {}
            return self.__dict__[name]
        fused = self.__dict__.get("_fused", {})
        if name in fused:
            return fused[name]
        method = _VerlMethod(self, cast(sc.GroupMethod, super().__getattr__(name)))
        self.__dict__[name] = method  # found there from now on, as the core keeps its own
        return method

    # -- calls ----------------------------------------------------------------------------------

    def _takes_object_refs(self) -> bool:
        """Whether this group's backend resolves Ray ObjectRefs itself (its declared ``refs``)."""
        ray, refs = sys.modules.get("ray"), self.capabilities.refs
        return ray is not None and refs is not None and issubclass(ray.ObjectRef, refs)

    def _verl_call(self, method: sc.GroupMethod, args: tuple, kwargs: dict) -> Any:
        """A call as verl makes it: a non-blocking method whose results are a list returns the
        ObjectRefs of the results on the ray backend; on others, ObjectRef arguments are fetched."""
        if not self._takes_object_refs():
            args, kwargs = _fetch_object_refs(args, kwargs)
        elif not method.blocking and method.dispatch_mode.collect_fn is collect_all_to_all:
            refs = method.submit_refs(*args, **kwargs)
            return refs[0] if method.execute_mode is sc.Execute.RANK_ZERO else ObjectRefs(refs)
        return method(*args, **kwargs)

    # verl's execute_* family: list arguments of length world_size are split across the ranks.

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Run ``method_name`` on every rank without waiting (verl: an alias of ``execute_all_async``)."""
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Run ``method_name`` on every rank and return at once (ObjectRefs on the ray backend,
        else a GroupFuture).

        As in verl: when every argument is a list of length ``world_size``, rank i receives entry i
        of each; otherwise every rank receives the arguments as given.

        Example:
            >>> wg.execute_all_async("set_seed", [1, 2]).get()   # rank 0 gets 1, rank 1 gets 2  # doctest: +SKIP
            [None, None]
        """
        split = _all_per_rank_lists(args, kwargs, self.world_size)
        mode = sc.Dispatch.ALL_TO_ALL if split else sc.Dispatch.ONE_TO_ALL
        method = self.bind(method_name, dispatch_mode=mode, execute_mode=sc.Execute.ALL, blocking=False)
        return self._verl_call(method, args, kwargs)

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """``execute_all_async(...)`` and wait: one result per rank."""
        return self.execute_all_async(method_name, *args, **kwargs).get()

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Run ``method_name`` on rank 0 without waiting (verl: an alias of ``execute_rank_zero_async``)."""
        return self.execute_rank_zero_async(method_name, *args, **kwargs)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method_name`` on rank 0 with the arguments as given; an ObjectRef on the ray
        backend, else a GroupFuture (``.get()`` is rank 0's result)."""
        method = self.bind(
            method_name,
            dispatch_mode=sc.Dispatch.ONE_TO_ALL,
            execute_mode=sc.Execute.RANK_ZERO,
            blocking=False,
        )
        return self._verl_call(method, args, kwargs)

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """``execute_rank_zero_async(...)`` and wait: rank 0's result."""
        pending = self.execute_rank_zero_async(method_name, *args, **kwargs)
        return pending.get() if isinstance(pending, sc.GroupFuture) else ObjectRefs([pending]).get()[0]


_VERL_STATE = ("_dispatch_info", "_collect_info", "_fused")


class _VerlMethod:
    """A worker method of a RayWorkerGroup: ``sc.GroupMethod`` called as verl calls it
    (:meth:`RayWorkerGroup._verl_call`); ``submit`` still returns a GroupFuture."""

    def __init__(self, group: RayWorkerGroup, method: sc.GroupMethod):
        self._group, self._method = group, method
        functools.update_wrapper(self, method, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._group._verl_call(self._method, args, kwargs)

    def submit(self, *args: Any, **kwargs: Any) -> sc.GroupFuture:
        if not self._group._takes_object_refs():
            args, kwargs = _fetch_object_refs(args, kwargs)
        return self._method.submit(*args, **kwargs)

    def __repr__(self) -> str:
        return repr(self._method)


def _all_per_rank_lists(args: tuple, kwargs: dict, world_size: int) -> bool:
    # verl's rule, kept as is: lists only (not tuples), all of them world_size long.
    values = [*args, *kwargs.values()]
    return all(isinstance(v, list) and len(v) == world_size for v in values)


def _fetch_object_refs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Ray ObjectRefs among the arguments (and in list arguments) fetched with one ``ray.get``: a
    backend other than ray has no Ray worker to resolve them."""
    ray = sys.modules.get("ray")
    if ray is None:
        return args, kwargs
    refs = {
        id(v): v
        for value in (*args, *kwargs.values())
        for v in (value if isinstance(value, list) else [value])
        if isinstance(v, ray.ObjectRef)
    }
    if not refs:
        return args, kwargs
    values = dict(zip(refs, ray.get(list(refs.values()))))

    def fetched(value: Any) -> Any:
        if isinstance(value, list):
            return [values.get(id(v), v) for v in value]
        return values.get(id(value), value)

    return tuple(map(fetched, args)), {k: fetched(v) for k, v in kwargs.items()}


__all__ = [
    "ObjectRefs",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
    "default_backend",
    "merge_resource_pool",
    "set_default_backend",
    "split_resource_pool",
]
