"""verl's single-controller names on top of spmdcall, so a verl driver runs after changing only its imports.

    # before: verl
    # from verl import DataProto
    # from verl.single_controller.base import Worker
    # from verl.single_controller.base.decorator import Dispatch, register
    # from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from spmdcall.compat.verl import (
        DataProto, Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register,
    )

Or leave the imports alone: ``python -m spmdcall.compat.verl.shim DIR`` writes a ``verl`` package
into DIR whose modules (``verl``, ``verl.protocol``, ``verl.single_controller.*``) re-export
this one (:mod:`spmdcall.compat.verl.shim`).

Every name maps onto spmdcall's public API (the table is in ``docs/migrating-from-verl.md``).
Groups run on the backend given as ``RayWorkerGroup(..., backend=...)``, else on the module's
default: ``"ray"`` when Ray is installed, ``"process"`` otherwise, or whatever
:func:`set_default_backend` chose. Classes decorated with ``@ray.remote`` are unwrapped, so the
same worker code runs on the ``process`` backend without a Ray cluster.

What this package adds on top of spmdcall, to keep verl's behaviour:

- ``RayWorkerGroup.execute_all*`` split list arguments of length world_size across the ranks, and
  non-blocking calls return Ray ObjectRefs on the ray backend (``ray.get`` them), a GroupFuture
  elsewhere (``.get()`` works on both);
- verl's worker API (``Worker._register_dispatch_collect_info``, ``get_cuda_visible_devices``,
  ``execute_with_func_generator``, ...), fused workers (``create_colocated_worker_raw_cls``,
  ``RayWorkerGroup.fuse``) and the mesh dispatch ``make_nd_compute_dataproto_dispatch_fn``;
- ``register`` accepts ``async def`` methods (each worker process runs them on one event loop);
- ``RayResourcePool`` keeps verl's defaults (``use_gpu=True``, ``max_colocate_count=10``).

Importing this package loads neither torch nor Ray; ``DataProto`` and the ``verl.protocol``
helpers load torch when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import spmdcall as sc
from spmdcall.compat.verl.decorator import (
    DISPATCH_MODE_FN_REGISTRY,
    Dispatch,
    Execute,
    check_dispatch_mode,
    get_predefined_dispatch_fn,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from spmdcall.compat.verl.groups import (
    ObjectRefs,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
    default_backend,
    merge_resource_pool,
    set_default_backend,
    split_resource_pool,
)
from spmdcall.compat.verl.worker import FusedWorker, Worker
from spmdcall.group.modes import (
    collect_all_to_all,
    collect_dp_compute_data_proto,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_data_proto,
    dispatch_dp_compute_data_proto_with_func,
    dispatch_one_to_all,
)

_check_dispatch_mode = check_dispatch_mode  # verl's own (private) name for it, which verl code imports

if TYPE_CHECKING:
    from spmdcall.compat.verl.protocol import (
        DataProtoConfig,
        deserialize_single_tensor,
        deserialize_tensordict,
        fold_batch_dim,
        serialize_single_tensor,
        serialize_tensordict,
        unfold_batch_dim,
        union_numpy_dict,
        union_tensor_dict,
    )
    from spmdcall.data import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto

__all__ = [
    # workers and their methods
    "Worker",
    "FusedWorker",
    "register",
    "Dispatch",
    "Execute",
    "register_dispatch_mode",
    "update_dispatch_mode",
    "get_predefined_dispatch_fn",
    "DISPATCH_MODE_FN_REGISTRY",
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
    "ResourcePool",
    "ClassWithInitArgs",
    "WorkerGroup",
    "RayResourcePool",
    "RayClassWithInitArgs",
    "RayWorkerGroup",
    "ObjectRefs",
    "split_resource_pool",
    "merge_resource_pool",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
    "set_default_backend",
    "default_backend",
    # data
    "DataProto",
    "DataProtoItem",
    "DataProtoFuture",
    "DataProtoConfig",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "union_tensor_dict",
    "union_numpy_dict",
    "fold_batch_dim",
    "unfold_batch_dim",
    "serialize_single_tensor",
    "deserialize_single_tensor",
    "serialize_tensordict",
    "deserialize_tensordict",
]

# verl's base classes are spmdcall's own.
ResourcePool = sc.ResourcePool
ClassWithInitArgs = sc.ClassWithInitArgs
WorkerGroup = sc.WorkerGroup
# What a ``blocking=False`` method that joins DataProtos returns (verl: DataProtoFuture); ``.get()``.
DataProtoFuture = sc.GroupFuture
# verl's DP_COMPUTE collect checks the length and returns the list unchanged.
collect_dp_compute = collect_all_to_all

# Names that need torch, loaded on first use: name -> module.
_LAZY = {
    **dict.fromkeys(
        ("DataProto", "DataProtoItem", "pad_dataproto_to_divisor", "unpad_dataproto"), "spmdcall.data"
    ),
    **dict.fromkeys(
        (
            "DataProtoConfig",
            "union_tensor_dict",
            "union_numpy_dict",
            "fold_batch_dim",
            "unfold_batch_dim",
            "serialize_single_tensor",
            "deserialize_single_tensor",
            "serialize_tensordict",
            "deserialize_tensordict",
        ),
        "spmdcall.compat.verl.protocol",
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'spmdcall.compat.verl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
