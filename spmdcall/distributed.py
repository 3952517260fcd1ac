"""torch.distributed inside a worker, from the SPMD environment the group set (torch loads lazily)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from spmdcall.errors import missing_extra


def init_distributed(backend: str | None = None, *, timeout_s: float | None = None) -> None:
    """Initialise the default process group from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.

    Picks ``nccl`` when CUDA is available (and binds this process to GPU ``LOCAL_RANK``), else
    ``gloo``. Calling it again is a no-op, so every method of a worker may call it.

    Args:
        backend: force a torch.distributed backend ("gloo", "nccl", ...).
        timeout_s: collective timeout in seconds (torch's default when None).

    Example:
        >>> class Trainer(sc.Worker):  # doctest: +SKIP
        ...     def __init__(self):
        ...         sc.init_distributed()
    """
    import datetime

    try:
        import torch
        import torch.distributed as dist
    except ModuleNotFoundError as exc:
        raise missing_extra(exc, "init_distributed()") from None

    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed() must run inside a worker of a group: {missing} are not set")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, **kwargs)


def build_device_mesh(shape: Sequence[int], axis_names: Sequence[str], device_type: str | None = None) -> Any:
    """A ``torch.distributed.DeviceMesh`` over every rank of the group, e.g. ``(2, 2), ("dp", "tp")``.

    Initialises torch.distributed first if needed. The product of ``shape`` must be the world size.

    Example:
        >>> mesh = build_device_mesh((2, 2), ("dp", "tp"))  # doctest: +SKIP
        >>> mesh.get_local_rank("dp")
    """
    import math

    try:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
    except ModuleNotFoundError as exc:
        raise missing_extra(exc, "build_device_mesh()") from None

    shape, axis_names = tuple(shape), tuple(axis_names)
    if len(shape) != len(axis_names):
        raise ValueError(f"shape {shape} and axis_names {axis_names} must have the same length")
    init_distributed()
    world_size = int(os.environ["WORLD_SIZE"])
    if math.prod(shape) != world_size:
        raise ValueError(f"mesh shape {shape} holds {math.prod(shape)} ranks but the group has {world_size}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, shape, mesh_dim_names=axis_names)
