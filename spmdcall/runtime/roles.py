"""Colocation: several roles in one process per rank (so they share one CUDA caching allocator).

The roles of one rank reach each other through their colocation (``Worker.sibling``), never
through module globals: on the inline backend every rank's colocation lives in the same process.
"""

from __future__ import annotations

from typing import Any

from spmdcall.worker import ClassWithInitArgs, building_colocation


class Colocated:
    """The fused worker of one rank: one instance of every role, built in the same process, in order.

    While it builds them, every role that subclasses ``Worker`` keeps a link to it, so that
    ``self.sibling(name)`` finds the other roles of the same rank.

    :func:`colocate` builds it. A subclass adds methods that use several roles of the rank at once
    (``self.role("actor")``), as verl's fused workers do: build its group from a ClassWithInitArgs
    whose ``roles`` lists the roles, and ``spawn`` gives a view per role beside the subclass's own
    methods.

    Example:
        >>> class Both(Colocated):  # doctest: +SKIP
        ...     def __init__(self):
        ...         super().__init__({"a": ClassWithInitArgs(A), "b": ClassWithInitArgs(B)})
        ...     def step(self):
        ...         return self.role("a").forward(self.role("b").batch())
    """

    def __init__(self, roles: dict[str, ClassWithInitArgs]):
        self._role_names = list(roles)
        self.roles: dict[str, Any] = {}
        with building_colocation(self):
            for name, cls_with_init in roles.items():
                self.roles[name] = cls_with_init()

    def role(self, name: str) -> Any:
        """The object playing ``name`` on this rank."""
        instance = self.roles.get(name)
        if instance is None:
            if name in self._role_names:
                raise RuntimeError(
                    f"role {name!r} is not built yet: roles are built in the order given to sc.colocate "
                    f"({', '.join(self._role_names)}); reach it from a method, or list it earlier"
                )
            raise ValueError(f"no role {name!r} in this colocation; its roles are {self._role_names}")
        return instance


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

    Each rank builds its roles in the order given, in one process; a role that subclasses
    ``Worker`` reaches the others of its rank with ``self.sibling(name)``.

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
