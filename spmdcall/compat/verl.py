"""verl's single-controller names on top of spmdcall, so a verl-style driver runs after changing only its imports.

    # before: verl
    # from verl import DataProto
    # from verl.single_controller.base import Worker
    # from verl.single_controller.base.decorator import Dispatch, register
    # from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from spmdcall.compat.verl import (
        DataProto, Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register,
    )

Every name maps onto spmdcall's public API (the table is in ``docs/migrating-from-verl.md``).
Groups run on the backend given as ``RayWorkerGroup(..., backend=...)``, else on the module's
default: ``"ray"`` when Ray is installed, ``"process"`` otherwise, or whatever
:func:`set_default_backend` chose. Classes decorated with ``@ray.remote`` are unwrapped, so the
same worker code runs on the ``process`` backend without a Ray cluster.

What this module adds on top of spmdcall, to keep verl's behaviour:

- ``RayWorkerGroup.execute_all*`` split list arguments of length world_size across the ranks,
  as verl's do; ``execute_all`` and ``execute_rank_zero`` are asynchronous (a ``GroupFuture``
  where verl returns Ray ObjectRefs: call ``.get()`` instead of ``ray.get``);
- ``register`` accepts ``async def`` methods (each worker process runs them on one event loop);
- ``RayResourcePool`` keeps verl's defaults (``use_gpu=True``, ``max_colocate_count=10``).

Importing this module loads neither torch nor Ray; ``DataProto`` and the padding helpers load
torch when first used.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import spmdcall as sc
from spmdcall.modes import (
    collect_all_to_all,
    collect_dp_compute_data_proto,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_data_proto,
    dispatch_dp_compute_data_proto_with_func,
    dispatch_one_to_all,
)
from spmdcall.register import MethodSpec

if TYPE_CHECKING:
    from spmdcall.data import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto

__all__ = [
    # workers and their methods
    "Worker",
    "register",
    "Dispatch",
    "Execute",
    "register_dispatch_mode",
    "make_nd_compute_dataproto_dispatch_fn",
    "dispatch_one_to_all",
    "dispatch_all_to_all",
    "dispatch_dp_compute",
    "dispatch_dp_compute_data_proto",
    "dispatch_dp_compute_data_proto_with_func",
    "collect_all_to_all",
    "collect_dp_compute",
    "collect_dp_compute_data_proto",
    # resources and groups
    "RayResourcePool",
    "RayClassWithInitArgs",
    "RayWorkerGroup",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "set_default_backend",
    "default_backend",
    # data
    "DataProto",
    "DataProtoItem",
    "DataProtoFuture",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
]

# verl's base class and modes are spmdcall's own: the parameter names and dispatch/collect
# signatures already match.
Worker = sc.Worker
Dispatch = sc.Dispatch
Execute = sc.Execute
register_dispatch_mode = sc.register_dispatch_mode
# What a ``blocking=False`` method returns (verl: DataProtoFuture). ``.get()`` waits and collects.
DataProtoFuture = sc.GroupFuture
# verl's DP_COMPUTE collect checks the length and returns the list unchanged.
collect_dp_compute = collect_all_to_all

_DATA_NAMES = ("DataProto", "DataProtoItem", "pad_dataproto_to_divisor", "unpad_dataproto")
_VERL_DEFAULT_REGISTER_TIMEOUT = 300
_default_backend: str | sc.Backend | None = None


def __getattr__(name: str) -> Any:
    # The DataProto names need torch; load them only when someone asks.
    if name in _DATA_NAMES:
        from spmdcall import data

        return getattr(data, name)
    raise AttributeError(f"module 'spmdcall.compat.verl' has no attribute {name!r}")


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


# -- register ------------------------------------------------------------------------------------


def register(
    dispatch_mode: sc.DispatchMode | str | dict = Dispatch.ALL_TO_ALL,
    execute_mode: sc.Execute | str = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
) -> Callable[[Callable], Callable]:
    """verl's ``@register``: :func:`spmdcall.register` that also accepts ``async def`` methods.

    An ``async def`` method runs to completion on the worker, on one event loop per worker
    process (kept between calls), so the group call returns its result like any other method's.

    Args:
        dispatch_mode: how arguments are split across ranks and results merged.
        execute_mode: ``Execute.ALL`` or ``Execute.RANK_ZERO``.
        blocking: ``False`` makes the group call return a ``DataProtoFuture`` (a GroupFuture).
        materialize_futures: resolve future arguments before dispatching them.

    Example:
        >>> class Critic(Worker):
        ...     @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        ...     async def values(self, data): ...
    """
    decorate = sc.register(dispatch_mode, execute_mode, blocking, materialize_futures)

    def wrap(fn: Callable) -> Callable:
        if inspect.iscoroutinefunction(fn):
            fn = _run_to_completion(fn)
        return decorate(fn)

    return wrap


def _run_to_completion(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return _worker_event_loop().run_until_complete(fn(*args, **kwargs))

    return run


_loop: asyncio.AbstractEventLoop | None = None


def _worker_event_loop() -> asyncio.AbstractEventLoop:
    # One loop per process for its whole life, so state an async method leaves on the loop (tasks,
    # clients, engines) is still there at the next call.
    global _loop
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "an async worker method was called while an event loop is running in this thread "
            "(the inline backend inside async code?); use the process or ray backend"
        )
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> sc.DispatchMode:
    """verl's mesh dispatch: :func:`spmdcall.nd_dispatch`.

    The workers declare their place differently: where verl workers call
    ``self._register_dispatch_collect_info(mesh_name, dp_rank=..., is_collect=...)``, spmdcall
    workers call ``self.register_mesh(mesh_name, dp_rank=..., dp_size=..., is_collect=...)`` (or
    pass the DeviceMesh: ``self.register_mesh(mesh_name, mesh=device_mesh, dp_axis="dp")``).

    Example:
        >>> mode = make_nd_compute_dataproto_dispatch_fn("actor")
        >>> mode.name
        'nd_dispatch:actor'
    """
    return sc.nd_dispatch(mesh_name)


# -- resources and classes -----------------------------------------------------------------------


class RayResourcePool(sc.ResourcePool):
    """verl's ``RayResourcePool``: an :class:`spmdcall.ResourcePool` with verl's defaults.

    ``use_gpu`` defaults to True, as in verl, and is passed on as given. On the ``ray`` backend each
    worker then reserves its share of a GPU, so on a machine without GPUs placement fails with
    ``ResourceInsufficientError`` (after the backend's ``placement_timeout``) just as verl's would
    wait for GPUs that never come: pass ``use_gpu=False`` there, as verl's own CPU tests do. The
    ``process`` backend reserves nothing; with ``use_gpu=True`` it only records that workers
    use ``cuda:LOCAL_RANK``, so a GPU-less machine runs a CPU-only worker either way.

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

    def __init__(self, cls: Any, *args: Any, **kwargs: Any):
        super().__init__(_unwrap_ray_remote(cls), *args, **kwargs)

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


# -- groups --------------------------------------------------------------------------------------

_IGNORED_GROUP_OPTIONS = ("master_addr", "master_port", "profile_steps", "worker_nsight_options")


class RayWorkerGroup(sc.WorkerGroup):
    """verl's ``RayWorkerGroup``: an :class:`spmdcall.WorkerGroup` on any backend.

    Args:
        resource_pool: a ``RayResourcePool`` (or any ``spmdcall.ResourcePool``).
        ray_cls_with_init: a ``RayClassWithInitArgs``, or what ``create_colocated_worker_cls`` returned.
        bin_pack: verl's packing switch; spmdcall takes the pool's ``placement_strategy``
            (``"STRICT_PACK"`` by default). ``False`` only warns.
        name_prefix: a readable name for the group (made unique).
        detached: the workers outlive the driver (ray backend only); find them again with
            ``spmdcall.backends.ray.attach(name)``.
        worker_names: not supported: attaching to running workers is ``spmdcall.backends.ray.attach``.
        worker_handles: not supported, as ``worker_names``.
        ray_wait_register_center_timeout: not used (set ``start_timeout=`` instead); a warning
            if changed.
        backend: where the workers run; :func:`default_backend` when None.
        device_name: ``"cuda"`` or ``"cpu"``; devices come from the pool's ``use_gpu``.
        worker_env: extra environment variables for every worker (the backend's ``env`` option).
        **kwargs: :class:`spmdcall.WorkerGroup` keywords (``default_timeout``) and backend options
            (``start_timeout``, ``runtime_env``, ...). verl's ``master_addr``, ``master_port``,
            ``profile_steps`` and ``worker_nsight_options`` are ignored with a warning.

    Example:
        >>> wg = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(cls=Actor))  # doctest: +SKIP
        >>> wg.execute_all_sync("init_model")  # doctest: +SKIP
    """

    def __init__(
        self,
        resource_pool: sc.ResourcePool | None = None,
        ray_cls_with_init: sc.ClassWithInitArgs | None = None,
        bin_pack: bool = True,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: list[str] | None = None,
        worker_handles: list | None = None,
        ray_wait_register_center_timeout: int = _VERL_DEFAULT_REGISTER_TIMEOUT,
        *,
        backend: str | sc.Backend | None = None,
        device_name: str = "cuda",
        worker_env: dict[str, str] | None = None,
        **kwargs: Any,
    ):
        if worker_names is not None or worker_handles is not None:
            raise TypeError(
                "RayWorkerGroup(worker_names=..., worker_handles=...) is not supported: to reach the workers "
                "of a detached group from another driver, use spmdcall.backends.ray.attach(name)"
            )
        if resource_pool is None or ray_cls_with_init is None:
            raise TypeError("RayWorkerGroup needs a resource_pool and a ray_cls_with_init")
        use_gpu = kwargs.pop("use_gpu", None)
        if use_gpu is not None and bool(use_gpu) != resource_pool.use_gpu:
            warnings.warn(
                f"RayWorkerGroup(use_gpu={use_gpu}) is ignored: the resource pool's use_gpu="
                f"{resource_pool.use_gpu} decides",
                stacklevel=2,
            )
        for key in _IGNORED_GROUP_OPTIONS:
            value = kwargs.pop(key, None)
            if value is not None:
                warnings.warn(f"RayWorkerGroup({key}={value!r}) is ignored by spmdcall", stacklevel=2)
        if not bin_pack and resource_pool.placement_strategy == "STRICT_PACK":
            warnings.warn(
                "RayWorkerGroup(bin_pack=False) is ignored: pass placement_strategy='PACK' to the resource pool",
                stacklevel=2,
            )
        if ray_wait_register_center_timeout != _VERL_DEFAULT_REGISTER_TIMEOUT:
            warnings.warn(
                "RayWorkerGroup(ray_wait_register_center_timeout=...) is ignored: pass start_timeout=... "
                "(seconds for the workers to start) instead",
                stacklevel=2,
            )
        if device_name not in ("cuda", "cpu"):
            warnings.warn(
                f"RayWorkerGroup(device_name={device_name!r}) is ignored: workers use cuda:LOCAL_RANK when "
                "the pool has use_gpu=True, the CPU otherwise",
                stacklevel=2,
            )
        if worker_env:
            kwargs["env"] = {**dict(worker_env), **kwargs.get("env", {})}
        backend = default_backend() if backend is None else backend
        if detached or getattr(resource_pool, "detached", False):
            if backend != "ray":
                raise ValueError(f"detached groups need the ray backend, this group runs on {backend!r}")
            kwargs["detached"] = True
        super().__init__(resource_pool, ray_cls_with_init, backend, name=name_prefix, **kwargs)

    # The overrides below keep verl's signatures (parameter names, GroupFuture returns) on purpose:
    # verl drivers call them that way, so they differ from the core WorkerGroup's.

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, RayWorkerGroup]:  # type: ignore[override]
        """One group per role of a colocated group (verl: ``wg.spawn(prefix_set=class_dict.keys())``)."""
        views = super().spawn(set(prefix_set))
        for view in views.values():
            # The core builds views as plain WorkerGroups; make them RayWorkerGroups so verl's
            # execute_* semantics below hold on every role too. Nothing else differs.
            view.__class__ = RayWorkerGroup
        return cast("dict[str, RayWorkerGroup]", views)

    # verl's execute_* family. verl returns Ray ObjectRefs from the asynchronous ones; here they
    # return a GroupFuture (``.get()`` where verl code calls ``ray.get``).

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> sc.GroupFuture:  # type: ignore[override]
        """Run ``method_name`` on every rank without waiting (verl: an alias of ``execute_all_async``)."""
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> sc.GroupFuture:  # type: ignore[override]
        """Run ``method_name`` on every rank and return at once.

        As in verl: when every argument is a list of length ``world_size``, rank i receives entry i
        of each; otherwise every rank receives the arguments as given.

        Example:
            >>> wg.execute_all_async("set_seed", [1, 2]).get()   # rank 0 gets 1, rank 1 gets 2  # doctest: +SKIP
            [None, None]
        """
        mode = (
            Dispatch.ALL_TO_ALL if _all_per_rank_lists(args, kwargs, self.world_size) else Dispatch.ONE_TO_ALL
        )
        return self._call(method_name, MethodSpec(mode, Execute.ALL, blocking=False).resolved(), args, kwargs)

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """``execute_all_async(...)`` and wait: one result per rank."""
        return self.execute_all_async(method_name, *args, **kwargs).get()

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> sc.GroupFuture:  # type: ignore[override]
        """Run ``method_name`` on rank 0 without waiting (verl: an alias of ``execute_rank_zero_async``)."""
        return self.execute_rank_zero_async(method_name, *args, **kwargs)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> sc.GroupFuture:
        """Run ``method_name`` on rank 0 with the arguments as given; ``.get()`` is rank 0's result."""
        spec = MethodSpec(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO, blocking=False).resolved()
        return self._call(method_name, spec, args, kwargs)

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """``execute_rank_zero_async(...)`` and wait: rank 0's result."""
        return self.execute_rank_zero_async(method_name, *args, **kwargs).get()


def _all_per_rank_lists(args: tuple, kwargs: dict, world_size: int) -> bool:
    # verl's rule, kept as is: lists only (not tuples), all of them world_size long.
    values = [*args, *kwargs.values()]
    return all(isinstance(v, list) and len(v) == world_size for v in values)
