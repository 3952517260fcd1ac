"""ResourcePool: how many worker processes to start on each node, and with what devices."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from spmdcall.worker import SPMDContext

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


class ResourcePool:
    """Processes per node, plus the devices each one gets.

    Args:
        process_on_nodes: one entry per node, the number of worker processes on it, e.g. ``[2]``
            or ``[4, 4]``. Ranks are ordered by node, then by local rank.
        use_gpu: workers use GPUs. The ray backend reserves one GPU per bundle; the process
            backend leaves every GPU visible and each rank uses ``cuda:LOCAL_RANK``
            (``sc.init_distributed()`` binds it).
        max_colocate_count: how many groups may share the same devices (separate processes
            colocated on one device; the ray backend hands out fractional resources).
        placement_strategy: the Ray placement-group strategy for each node's bundles.
        num_cpus_per_worker: CPUs reserved for each worker (ray backend).

    A pool can be cut into pools of consecutive ranks (:meth:`split`) and pools can be joined
    (:meth:`merge`): such a pool runs its ranks on the devices of the ranks it was made of, so
    groups on two halves of one pool never share a device, and a group on the merge of two pools
    uses the devices of both (the ray backend places them in the same bundles).

    Example:
        >>> ResourcePool([2, 2]).world_size
        4
    """

    # (base pool, node of the base pool, bundle index on that node) of every rank of a pool made
    # by split() or merge(); None for a pool built directly, which is its own base.
    _slots: list[tuple[ResourcePool, int, int]] | None = None

    def __init__(
        self,
        process_on_nodes: list[int] | tuple[int, ...],
        use_gpu: bool = False,
        max_colocate_count: int = 1,
        placement_strategy: str = "STRICT_PACK",
        num_cpus_per_worker: float = 1.0,
    ):
        if (
            isinstance(process_on_nodes, int)
            or not isinstance(process_on_nodes, (list, tuple))
            or not process_on_nodes
        ):
            raise TypeError(
                f"process_on_nodes must be a non-empty list of process counts per node, e.g. [2], got {process_on_nodes!r}"
            )
        for n in process_on_nodes:
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(
                    f"every node needs a positive integer process count, got {n!r} in {list(process_on_nodes)}"
                )
        if not isinstance(max_colocate_count, int) or max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be a positive integer, got {max_colocate_count!r}")
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {placement_strategy!r}"
            )
        if not num_cpus_per_worker > 0:
            raise ValueError(f"num_cpus_per_worker must be positive, got {num_cpus_per_worker!r}")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = bool(use_gpu)
        self.max_colocate_count = max_colocate_count
        self.placement_strategy = placement_strategy
        self.num_cpus_per_worker = num_cpus_per_worker

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.process_on_nodes)

    def placements(self) -> list[tuple[int, int]]:
        """``(node_index, bundle_index)`` of every rank, in rank order: the node of this pool it
        runs on, and its slot among that node's devices (its local rank, unless this pool was
        made by :meth:`split` or :meth:`merge`: then its slot in the pool it came from)."""
        if self._slots is None:
            return [
                (node, local) for node, count in enumerate(self.process_on_nodes) for local in range(count)
            ]
        nodes = self._node_of_slots()
        return [(nodes[r], bundle) for r, (_, _, bundle) in enumerate(self._slots)]

    def slots(self) -> list[tuple[ResourcePool, int, int]]:
        """``(base pool, node of the base pool, bundle index)`` of every rank: where it really runs.
        A pool built directly is its own base."""
        if self._slots is None:
            return [(self, node, bundle) for node, bundle in self.placements()]
        return list(self._slots)

    def split(self, sizes: int | Sequence[int]) -> list[ResourcePool]:
        """Cut this pool into pools of consecutive ranks that keep their devices.

        Args:
            sizes: the world size of every part (they must add up to this pool's), or one size
                that divides it (equal parts).

        Example:
            >>> [p.world_size for p in ResourcePool([4, 4]).split([2, 6])]
            [2, 6]
        """
        if isinstance(sizes, Sequence):
            counts = list(sizes)
        else:
            if sizes < 1 or self.world_size % sizes:
                raise ValueError(f"split size {sizes} does not divide the world size {self.world_size}")
            counts = [sizes] * (self.world_size // sizes)
        if not counts or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in counts):
            raise ValueError(f"split sizes must be positive ints, got {counts!r}")
        if sum(counts) != self.world_size:
            raise ValueError(
                f"split sizes {counts} add up to {sum(counts)}, not the world size {self.world_size}"
            )
        slots, parts, start = self.slots(), [], 0
        for n in counts:
            parts.append(self._derived(slots[start : start + n]))
            start += n
        return parts

    @staticmethod
    def merge(pools: Sequence[ResourcePool]) -> ResourcePool:
        """One pool with the ranks of ``pools`` in order, each on the devices it had.

        Example:
            >>> ResourcePool.merge([ResourcePool([2]), ResourcePool([2])]).world_size
            4
        """
        pools = list(pools)
        if not pools or not all(isinstance(p, ResourcePool) for p in pools):
            raise TypeError(f"merge expects a list of ResourcePools, got {pools!r}")
        for what in ("use_gpu", "max_colocate_count", "num_cpus_per_worker"):
            values = {getattr(p, what) for p in pools}
            if len(values) > 1:
                raise ValueError(f"cannot merge pools with different {what}: {sorted(values, key=str)}")
        return pools[0]._derived([slot for p in pools for slot in p.slots()])

    def _derived(self, slots: list[tuple[ResourcePool, int, int]]) -> ResourcePool:
        if len(slots) != len({(id(base), node, bundle) for base, node, bundle in slots}):
            raise ValueError("a pool cannot hold the same device slot twice")
        pool = copy.copy(self)  # the same settings (and subclass) as this pool, other ranks
        pool._slots = slots
        nodes = pool._node_of_slots()
        pool.process_on_nodes = [nodes.count(node) for node in range(max(nodes) + 1)]
        return pool

    def _node_of_slots(self) -> list[int]:
        # Consecutive ranks on the same node of the same base pool form one node of this pool.
        assert self._slots is not None
        nodes: list[int] = []
        for r, (base, node, _) in enumerate(self._slots):
            previous = self._slots[r - 1] if r else None
            same = previous is not None and previous[0] is base and previous[1] == node
            nodes.append(nodes[-1] if same else (nodes[-1] + 1 if nodes else 0))
        return nodes

    def contexts(self, master_addr: str, master_port: int) -> list[SPMDContext]:
        """The SPMD context of every rank, in rank order (local ranks count from 0 on every node)."""
        contexts, seen = [], [0] * self.num_nodes
        for rank, (node, _) in enumerate(self.placements()):
            contexts.append(
                SPMDContext(
                    rank=rank,
                    world_size=self.world_size,
                    local_rank=seen[node],
                    local_world_size=self.process_on_nodes[node],
                    node_rank=node,
                    master_addr=master_addr,
                    master_port=master_port,
                )
            )
            seen[node] += 1
        return contexts

    def __repr__(self) -> str:
        made = "" if self._slots is None else ", split or merged"
        return f"ResourcePool({self.process_on_nodes}, use_gpu={self.use_gpu}, max_colocate_count={self.max_colocate_count}{made})"


def contexts_on(nodes: list[Any], master_addr: str, master_port: int) -> list[SPMDContext]:
    """The SPMD contexts of ranks placed on ``nodes`` (each rank's node, any hashable name, in rank
    order), as a group that grew or shrank has them: local ranks count in rank order on each
    node, and nodes in the order of their first rank.

    Example:
        >>> [(c.rank, c.local_rank, c.node_rank) for c in contexts_on(["a", "b", "a"], "127.0.0.1", 29500)]
        [(0, 0, 0), (1, 0, 1), (2, 1, 0)]
    """
    order = list(dict.fromkeys(nodes))
    return [
        SPMDContext(
            rank=r,
            world_size=len(nodes),
            local_rank=nodes[:r].count(node),
            local_world_size=nodes.count(node),
            node_rank=order.index(node),
            master_addr=master_addr,
            master_port=master_port,
        )
        for r, node in enumerate(nodes)
    ]
