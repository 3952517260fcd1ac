"""Colocation: several roles in one process per rank (so they share one CUDA caching allocator)."""

from __future__ import annotations

from typing import Any

from spmdcall.worker import ClassWithInitArgs


class Colocated:
    """The fused worker: one instance of every role, built in the same process."""

    def __init__(self, roles: dict[str, ClassWithInitArgs]):
        self.roles = {name: cls_with_init() for name, cls_with_init in roles.items()}

    def role(self, name: str) -> Any:
        return self.roles[name]


class ColocatedClassWithInitArgs(ClassWithInitArgs):
    """What :func:`colocate` returns: a ClassWithInitArgs that also knows each role's class."""

    def __init__(self, roles: dict[str, ClassWithInitArgs]):
        super().__init__(Colocated, roles)
        self.roles = dict(roles)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v.cls.__qualname__}" for k, v in self.roles.items())
        return f"colocate({inner})"


def colocate(roles: dict[str, ClassWithInitArgs]) -> ColocatedClassWithInitArgs:
    """Fuse several roles into one worker class; ``WorkerGroup.spawn`` gives one view per role.

    Args:
        roles: role name -> the class (with its init args) that plays it.

    Example:
        >>> fused = colocate({"actor": ClassWithInitArgs(Actor), "critic": ClassWithInitArgs(Critic)})  # doctest: +SKIP
        >>> views = WorkerGroup(pool, fused).spawn({"actor", "critic"})  # doctest: +SKIP
        >>> views["actor"].update(batch)  # doctest: +SKIP
    """
    if not isinstance(roles, dict) or not roles:
        raise TypeError(f"colocate expects a non-empty dict of role name -> ClassWithInitArgs, got {roles!r}")
    for name, cls_with_init in roles.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"role names must be identifiers, got {name!r}")
        if not isinstance(cls_with_init, ClassWithInitArgs):
            raise TypeError(f"role {name!r} must be a ClassWithInitArgs, got {type(cls_with_init).__name__}")
    return ColocatedClassWithInitArgs(roles)
