"""One simulated 3-node Ray cluster for every Ray test (and the shared tests' ``ray`` runs).

The head node has 8 CPUs and 2 simulated GPUs (Ray hands out their ids; nothing touches CUDA);
two more nodes have 2 CPUs each and advertise ``NODE_RESOURCE: 2``,
so a pool asking for ``resources_per_worker={NODE_RESOURCE: 1}`` on ``[2, 2]`` gets one node
each. Starting Ray costs seconds on a small machine, so the whole run shares this session.
"""

from __future__ import annotations

import contextlib
import os

import pytest

ray = pytest.importorskip(
    "ray", minversion="2.40"
)  # [ray]'s floor; also rejects tests/ray/ seen as a namespace package

NODE_RESOURCE = "spmd_test_node"


@pytest.fixture(scope="session")
def ray_cluster(ray_tmp):
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        have = ray.cluster_resources()
        if have.get(NODE_RESOURCE, 0) >= 4 and have.get("GPU", 0) >= 2:
            yield None  # the shared fixture already started this layout
            return
        ray.shutdown()  # a plain single-node session from another fixture: these tests need the cluster
    tmp = ray_tmp
    (tmp / "ray").mkdir(exist_ok=True)  # the other session fixture may have made it
    with _ray_tmpdir(tmp):
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 8,
                "num_gpus": 2,
                "include_dashboard": False,
                "temp_dir": str(tmp),
                "object_store_memory": 512 << 20,
            },
        )
        for _ in range(2):
            cluster.add_node(num_cpus=2, resources={NODE_RESOURCE: 2}, object_store_memory=256 << 20)
    ray.init(address=cluster.address, configure_logging=False)
    yield cluster
    ray.shutdown()
    with _ray_tmpdir(tmp):
        cluster.shutdown()


@contextlib.contextmanager
def _ray_tmpdir(tmp):
    # Ray records the address of a cluster it starts (and deletes it at shutdown) under RAY_TMPDIR,
    # where a plain ray.init() in any other process would find and join it. Keep that record in
    # pytest's folder: examples and other subprocesses must start a Ray of their own.
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(tmp)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["RAY_TMPDIR"]
        else:
            os.environ["RAY_TMPDIR"] = saved


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """The shared tests' name for "a Ray this process is connected to"."""
    return ray


@pytest.fixture(scope="session")
def node_resource(ray_cluster) -> str:
    """The custom resource only the two 2-CPU worker nodes advertise (2 each)."""
    return NODE_RESOURCE
