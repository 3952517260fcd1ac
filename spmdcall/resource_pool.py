"""ResourcePool: how many worker processes to start on each node, and with what devices."""

from __future__ import annotations

import socket

from spmdcall.worker import SPMDContext

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now, for rank 0's ``torch.distributed`` rendezvous (``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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

    Example:
        >>> ResourcePool([2, 2]).world_size
        4
    """

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
        """``(node_index, local_rank)`` of every rank, in rank order."""
        return [(node, local) for node, count in enumerate(self.process_on_nodes) for local in range(count)]

    def contexts(self, master_addr: str, master_port: int) -> list[SPMDContext]:
        """The SPMD context of every rank, in rank order."""
        return [
            SPMDContext(
                rank=rank,
                world_size=self.world_size,
                local_rank=local,
                local_world_size=self.process_on_nodes[node],
                node_rank=node,
                master_addr=master_addr,
                master_port=master_port,
            )
            for rank, (node, local) in enumerate(self.placements())
        ]

    def __repr__(self) -> str:
        return f"ResourcePool({self.process_on_nodes}, use_gpu={self.use_gpu}, max_colocate_count={self.max_colocate_count})"
