"""Placement of a ResourcePool on a Ray cluster: one placement group per node of the pool.

Entry ``i`` of ``pool.process_on_nodes`` becomes placement group ``i``: one bundle per worker
(``{"CPU": num_cpus_per_worker}``, plus ``{"GPU": 1}`` with ``use_gpu``, plus any extra resources),
with the pool's strategy (STRICT_PACK keeps a node's bundles on one machine). Rank ``r`` on node
``i`` runs in bundle ``local_rank`` of group ``i``.

A pool with ``max_colocate_count = k`` lets ``k`` groups share the same bundles: every actor asks
for ``1/k`` of its bundle, and the placement groups are cached on the pool object, so groups built
on the same ResourcePool instance land on the same machines and devices. A group that finds every
cached set already shared ``k`` times gets a fresh set instead of waiting forever.

A pool made by ``ResourcePool.split``/``merge`` has no placement groups of its own: its ranks run
in the bundles of the pools it was made of (their cached sets, created if needed and shared by
every pool made from them, whatever ``k``), so the parts of one pool never share a device.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from spmdcall.errors import ResourceInsufficientError
from spmdcall.resource_pool import ResourcePool


@dataclass(eq=False)
class Placement:
    """The placement groups of one pool (one per node), and how many groups use them."""

    groups: list[PlacementGroup]
    bundle: dict[str, float]
    colocate_count: int
    detached: bool
    cluster_id: str
    num_users: int = 0
    key: tuple = field(default=(), repr=False)
    # For a split or merged pool: the placements of the pools it was made of, whose groups it uses.
    parts: list[Placement] = field(default_factory=list, repr=False)

    def actor_resources(self) -> dict[str, Any]:
        """Ray actor options asking for this actor's share (``1/max_colocate_count``) of its bundle."""
        share = {k: v / self.colocate_count for k, v in self.bundle.items()}
        custom = {k: v for k, v in share.items() if k not in ("CPU", "GPU")}
        return {
            "num_cpus": share.get("CPU", 0.0),
            "num_gpus": share.get("GPU", 0.0),
            "resources": custom or None,
        }


# Placements cached per pool object (weakly: a pool that is gone cannot be asked for again).
_cache: weakref.WeakKeyDictionary[ResourcePool, list[Placement]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def bundle_of(pool: ResourcePool, extra_resources: dict[str, float] | None) -> dict[str, float]:
    bundle = {"CPU": float(pool.num_cpus_per_worker)}
    if pool.use_gpu:
        bundle["GPU"] = 1.0
    for name, amount in (extra_resources or {}).items():
        if name in ("CPU", "GPU"):
            raise ValueError(
                f"resources_per_worker sets custom resources only; {name} comes from the ResourcePool, got {extra_resources!r}"
            )
        if not amount > 0:
            raise ValueError(f"resources_per_worker[{name!r}] must be positive, got {amount!r}")
        bundle[name] = float(amount)
    return bundle


def acquire(
    pool: ResourcePool,
    *,
    extra_resources: dict[str, float] | None = None,
    detached: bool = False,
    timeout: float = 30.0,
    name: str = "",
) -> Placement:
    """Placement groups for one more group on ``pool``: a cached set with room, or a new one.

    Raises ResourceInsufficientError (after removing what it created) if a new set is not ready
    within ``timeout`` seconds.
    """
    slots = pool.slots()
    if any(base is not pool for base, _, _ in slots):
        if detached:
            raise ValueError(f"a detached group needs a pool of its own, not a split or merged one: {pool!r}")
        parts: dict[int, Placement] = {}
        try:
            for base, _, _ in slots:
                if id(base) not in parts:
                    # Each pool it is made of gets placement groups named apart (names are unique in Ray).
                    part_name = f"{name}.part{len(parts)}" if name else ""
                    parts[id(base)] = _acquire(
                        base, extra_resources, False, timeout, part_name, always_share=True
                    )
        except BaseException:
            for part in parts.values():
                release(part)
            raise
        groups = _node_groups(pool, {key: part.groups for key, part in parts.items()})
        first = next(iter(parts.values()))
        return Placement(
            groups,
            first.bundle,
            first.colocate_count,
            False,
            first.cluster_id,
            num_users=1,
            parts=list(parts.values()),
        )
    return _acquire(pool, extra_resources, detached, timeout, name, always_share=False)


def _acquire(
    pool: ResourcePool,
    extra_resources: dict[str, float] | None,
    detached: bool,
    timeout: float,
    name: str,
    *,
    always_share: bool,
) -> Placement:
    bundle = bundle_of(pool, extra_resources)
    cluster_id = _cluster_id()
    key = (tuple(sorted(bundle.items())), pool.placement_strategy, tuple(pool.process_on_nodes))
    # Detached groups outlive this process, so they never share bundles with anyone. Split and
    # merged pools use disjoint bundles of the same set (always_share), whatever the colocate count.
    shareable = not detached and (always_share or pool.max_colocate_count > 1)
    with _lock:
        if shareable:
            for placement in _cache.get(pool, []):
                if (
                    placement.key == key
                    and placement.cluster_id == cluster_id
                    and 0 < placement.num_users
                    and (always_share or placement.num_users < placement.colocate_count)
                ):
                    placement.num_users += 1
                    return placement
    groups = _create(
        pool, bundle, detached=detached, timeout=timeout, name=name or f"spmdcall-{uuid.uuid4().hex[:8]}"
    )
    placement = Placement(groups, bundle, pool.max_colocate_count, detached, cluster_id, num_users=1, key=key)
    if not detached:
        with _lock:
            live = [p for p in _cache.get(pool, []) if p.num_users > 0 and p.cluster_id == cluster_id]
            _cache[pool] = live + [placement]
    return placement


def placement_groups(pool: ResourcePool) -> list[PlacementGroup]:
    """The placement groups that groups on ``pool`` run in now, one per node ([] while none runs)."""
    slots = pool.slots()
    with _lock:
        held = {
            id(base): next((p for p in _cache.get(base, []) if p.num_users > 0), None) for base, _, _ in slots
        }
    if any(p is None for p in held.values()):
        return []
    return _node_groups(pool, {key: p.groups for key, p in held.items() if p is not None})


def _node_groups(pool: ResourcePool, base_groups: dict[int, list[PlacementGroup]]) -> list[PlacementGroup]:
    """The placement group of every node of a (split or merged) pool, from its base pools' groups
    (keyed by ``id(base)``): the group of the base node its first rank there runs on."""
    slots = pool.slots()
    groups: list[PlacementGroup] = []
    for r, (node, _) in enumerate(pool.placements()):
        if node == len(groups):
            base, base_node, _ = slots[r]
            groups.append(base_groups[id(base)][base_node])
    return groups


def release(placement: Placement) -> None:
    """One group is done with ``placement``; the last one removes its placement groups."""
    with _lock:
        placement.num_users -= 1
        if placement.num_users > 0:
            return
        for _pool, placements in list(_cache.items()):
            if placement in placements:
                placements.remove(placement)
    if placement.parts:
        for part in placement.parts:
            release(part)
        return
    remove(placement.groups)


def remove(groups: list[PlacementGroup]) -> None:
    if not ray.is_initialized():
        return  # Ray is gone, and with it every placement group this process owned
    for pg in groups:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed (e.g. by another controller of a detached group)
            pass


def _create(
    pool: ResourcePool, bundle: dict[str, float], *, detached: bool, timeout: float, name: str
) -> list[PlacementGroup]:
    groups = [
        placement_group(
            [dict(bundle) for _ in range(count)],
            strategy=pool.placement_strategy,
            name=f"{name}:node{node}",
            lifetime="detached" if detached else None,
        )
        for node, count in enumerate(pool.process_on_nodes)
    ]
    refs = [pg.ready() for pg in groups]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if len(ready) < len(refs):
        not_ready = [i for i, ref in enumerate(refs) if ref not in set(ready)]
        remove(groups)  # never leave a pending request behind to grab resources later
        raise ResourceInsufficientError(_explain(pool, bundle, not_ready, timeout))
    return groups


def _explain(pool: ResourcePool, bundle: dict[str, float], not_ready: list[int], timeout: float) -> str:
    keys = list(bundle)
    asked = ", ".join(f"node {i}: {n} x {_fmt(bundle)}" for i, n in enumerate(pool.process_on_nodes))
    total = ray.cluster_resources()
    available = ray.available_resources()
    largest = _largest_node(keys)
    return (
        f"cannot place {pool!r} on the Ray cluster within {timeout:g} s (placement groups of nodes {not_ready} "
        f"not ready). Asked for one {pool.placement_strategy} placement group per node, one bundle per worker: "
        f"{asked}. The cluster has {_fmt({k: total.get(k, 0.0) for k in keys})} in total, "
        f"{_fmt({k: available.get(k, 0.0) for k in keys})} available now; the largest node has {_fmt(largest)}. "
        f"Ask for fewer workers or resources per worker, add nodes, free resources held by other groups, "
        f"or raise the backend option placement_timeout."
    )


def _largest_node(keys: list[str]) -> dict[str, float]:
    best: dict[str, float] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            res = {k: node["Resources"].get(k, 0.0) for k in keys}
            if tuple(res.values()) > tuple(best.get(k, -1.0) for k in keys):
                best = res
    return best


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def _cluster_id() -> str:
    # A placement cached under an earlier Ray session (ray.shutdown(); ray.init()) is stale.
    return ray.get_runtime_context().gcs_address + "/" + ray.get_runtime_context().get_job_id()
