"""What a rank does when its group grows or shrinks: the two calls the group makes on every rank
around a backend's resize, run by the rank's :class:`~spmdcall.runtime.calls.CallRunner` on any
worker class (a ``Worker`` subclass or not, colocated or not).

``CAN_RESIZE`` (before anything changes): why this rank cannot be renumbered, or None. A rank whose
process joined torch.distributed cannot, unless its class overrides ``on_resize`` (which then
rebuilds the process group). ``RESIZE`` (after the backend renumbered the ranks): the rank's new
context becomes its own (``adopt_context``), then every object of the rank that has an ``on_resize``
is told its new rank and world size.
"""

from __future__ import annotations

from typing import Any

from spmdcall.lazy import loaded
from spmdcall.runtime.roles import Colocated
from spmdcall.worker import SPMDContext, Worker, adopt_context

# Method names the group calls; dunders, so that no worker method can take them.
CAN_RESIZE = "__spmd_can_resize__"
RESIZE = "__spmd_resize__"


def _objects(instance: Any) -> list[Any]:
    """The rank's objects: a colocated worker and each of its roles, else the instance alone."""
    return [instance, *instance.roles.values()] if isinstance(instance, Colocated) else [instance]


def _rebuilds(obj: Any) -> bool:
    """Whether ``obj``'s class says what to do on a resize (an ``on_resize`` of its own)."""
    hook = getattr(type(obj), "on_resize", None)
    return callable(hook) and hook is not Worker.on_resize


def can_resize(instance: Any) -> str | None:
    """None if this rank can be renumbered, else why not (the group raises it before resizing)."""
    dist = loaded("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if any(_rebuilds(obj) for obj in _objects(instance)):
        return None
    names = "+".join(type(obj).__qualname__ for obj in _objects(instance))
    return (
        f"{names} joined a torch.distributed process group (world size {dist.get_world_size()}), which a "
        "resize would leave with the old ranks; override on_resize(self, rank, world_size) on the worker "
        "class to rebuild it (destroy_process_group(), then init_process_group() on every rank)"
    )


def resize(instance: Any, ctx: SPMDContext) -> None:
    """Make ``ctx`` the rank's context and call ``on_resize(rank, world_size)`` on its objects."""
    objects = _objects(instance)
    for obj in objects:
        adopt_context(obj, ctx)
    for obj in objects:
        hook = getattr(type(obj), "on_resize", None)
        if callable(hook):
            hook(obj, ctx.rank, ctx.world_size)
