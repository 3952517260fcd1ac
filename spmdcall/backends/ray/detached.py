"""Finding detached groups on a Ray cluster by name (their actors outlive the controller that made them).

Every actor of a detached group is named ``<name>-<8 hex>:rank<r>[.<generation>]`` in one Ray
namespace, so any controller can list them; the hex suffix means no name is ever reused.
"""

from __future__ import annotations

import re
from typing import Any

import ray

# Detached groups' actors are named in this Ray namespace, so any controller can find them.
NAMESPACE = "spmdcall"
UNIQUE_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def user_name(group_name: str) -> str:
    """The name the user gave (``WorkerGroup(name=...)``), without the unique suffix."""
    return UNIQUE_SUFFIX.sub("", group_name)


def find(name: str) -> dict[str, dict[int, tuple[int, str]]]:
    """Live detached groups called ``name``: group name -> rank -> (generation, actor name)."""
    pattern = re.compile(rf"^({re.escape(name)}-[0-9a-f]{{8}}):rank(\d+)(?:\.(\d+))?$")
    groups: dict[str, dict[int, tuple[int, str]]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        m = pattern.match(entry["name"]) if entry["namespace"] == NAMESPACE else None
        if m:
            rank, generation = int(m.group(2)), int(m.group(3) or 0)
            ranks = groups.setdefault(m.group(1), {})
            if rank not in ranks or ranks[rank][0] < generation:
                ranks[rank] = (generation, entry["name"])
    return groups


def find_one(name: str) -> tuple[str, dict[int, tuple[Any, str]]]:
    """The one running detached group called ``name`` (or whose full name, with its unique suffix,
    is ``name``): its full name, and its live actors by rank (with their names). Raises ValueError
    when there is none, or more than one."""
    groups = find(name)
    if not groups and UNIQUE_SUFFIX.search(name):  # the full name of one group: that group only
        groups = {g: ranks for g, ranks in find(user_name(name)).items() if g == name}
    if not groups:
        raise ValueError(
            f"no detached spmdcall group named {name!r} is running on this Ray cluster "
            f"(Ray namespace {NAMESPACE!r})"
        )
    if len(groups) > 1:
        raise ValueError(
            f"several detached groups are named {name!r}: {sorted(groups)}; shut down the stale ones"
        )
    group_name, ranks = groups.popitem()
    actors: dict[int, tuple[Any, str]] = {}
    for rank, (_, actor_name) in ranks.items():
        try:
            actors[rank] = (ray.get_actor(actor_name, namespace=NAMESPACE), actor_name)
        except ValueError:
            pass  # died between the listing and now
    return group_name, actors
