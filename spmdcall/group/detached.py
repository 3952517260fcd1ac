"""Detached groups: workers that outlive the controller that started them, driven again from another.

    # controller 1 (e.g. a job that ends)
    wg = sc.WorkerGroup(pool, sc.ClassWithInitArgs(Rollout), backend="ray", name="rollout", detached=True)
    # controller 2, any machine of the cluster
    from spmdcall.group.detached import attach
    wg = attach("rollout")

A backend that keeps workers running without their controller declares
``capabilities.detached`` (of the built-in ones, ``ray``).
"""

from __future__ import annotations

from typing import Any

from spmdcall.backends import adopt_detached
from spmdcall.group.worker_group import WorkerGroup


def attach(
    name: str,
    *,
    ray_init_kwargs: dict[str, Any] | None = None,
    timeout: float = 60.0,
    shutdown_grace: float = 3.0,
    group_cls: type[WorkerGroup] = WorkerGroup,
    backend: str = "ray",
) -> WorkerGroup:
    """A WorkerGroup driving the running detached group called ``name``, from any controller.

    Args:
        name: the ``name=`` the group was built with (``WorkerGroup(..., name=name, detached=True)``),
            or the full name of one of its actors (what verl's ``from_detached`` passes).
        ray_init_kwargs: for ``ray.init()`` if this process has not joined the cluster yet.
        timeout: seconds to wait for a rank to describe the group.
        shutdown_grace: as for RayBackend; ``shutdown()`` on the returned group stops the workers.
        group_cls: the class of the returned group, a WorkerGroup subclass whose constructor takes
            WorkerGroup's arguments (``resource_pool``, ``cls_with_init``, ``backend=``, ``name=``).
        backend: the registered name of the group's backend, one that declares
            ``capabilities.detached``.

    Example:
        >>> wg = attach("trainer", ray_init_kwargs={"address": "auto"})  # doctest: +SKIP
        >>> wg.step(batch)                                                # doctest: +SKIP
        >>> wg.shutdown()   # stops the detached workers for good           # doctest: +SKIP
    """
    if not (isinstance(group_cls, type) and issubclass(group_cls, WorkerGroup)):
        raise TypeError(f"group_cls must be WorkerGroup or a subclass of it, got {group_cls!r}")
    options: dict[str, Any] = {"timeout": timeout, "shutdown_grace": shutdown_grace}
    if ray_init_kwargs is not None:
        options["ray_init_kwargs"] = ray_init_kwargs
    adopted, pool, cls_with_init, group_name = adopt_detached(backend, name, **options)
    wg = group_cls(pool, cls_with_init, backend=adopted, name=name)
    wg.name = group_name  # the name the group was created with
    return wg
