"""Elastic groups: a live group grows by new ranks and shrinks by named ones (``grow``, ``shrink``,
``resize``); dispatch follows the live ranks and each rank learns its new rank and world size.
Skipped on a backend that does not declare ``capabilities.resize``."""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest

import spmdcall as sc
from spmdcall.testing.workers import Distributed, Elastic, Rebuilding, Sleeper

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def elastic(spmd_backend):
    if not sc.backend_capabilities(spmd_backend).resize:
        pytest.skip(f"the {spmd_backend} backend does not declare capabilities.resize")
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Elastic, start=1), backend=spmd_backend
    ) as wg:
        yield wg


def _places(wg):
    return [
        (i["context"]["rank"], i["context"]["world_size"], i["env"]["RANK"], i["env"]["WORLD_SIZE"])
        for i in wg.identity()
    ]


def test_grow_adds_ranks_that_dispatch_reaches(elastic):
    wg = elastic
    assert wg.add(1) == [2, 2]
    wg.grow(1)
    assert wg.world_size == 3
    assert wg.add(1) == [3, 3, 2]  # ONE_TO_ALL reaches the new rank, built afresh
    assert wg.scaled([1, 2, 3]) == [3, 6, 6]  # DP_COMPUTE: one entry per live rank
    assert wg.only_zero(0) == (0, 3)
    assert _places(wg) == [(r, 3, str(r), "3") for r in range(3)]
    assert [i["env"]["LOCAL_RANK"] for i in wg.identity()] == ["0", "1", "2"]
    assert [i["env"]["LOCAL_WORLD_SIZE"] for i in wg.identity()] == ["3", "3", "3"]
    assert wg.told() == [[(0, 3)], [(1, 3)], [(2, 3)]]
    with pytest.raises(ValueError, match="one entry per rank"):
        wg.set_each([1, 2])


def test_dp_compute_proto_splits_over_the_live_ranks(elastic):
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("tensordict") is None:
        pytest.skip("needs torch and tensordict")
    import torch

    wg = elastic
    wg.grow(1)
    out = wg.double(sc.DataProto.from_dict({"x": torch.arange(6.0)}))
    assert out.batch["x"].tolist() == [0, 2, 4, 6, 8, 10]
    assert list(out.non_tensor_batch["seen_by"]) == [0, 0, 1, 1, 2, 2]
    wg.shrink([0, 2])
    out = wg.double(sc.DataProto.from_dict({"x": torch.arange(3.0)}))
    assert list(out.non_tensor_batch["seen_by"]) == [0, 0, 0]


def test_shrink_renumbers_the_ranks_left(elastic):
    wg = elastic
    wg.grow(1)
    pids = [i["pid"] for i in wg.worker_info()]
    assert wg.set_each([10, 20, 30]) == [10, 20, 30]
    wg.shrink([1])
    assert wg.world_size == 2
    assert wg.get() == [10, 30]  # the ranks kept keep their state
    assert [i["pid"] for i in wg.worker_info()] == [pids[0], pids[2]]
    assert _places(wg) == [(0, 2, "0", "2"), (1, 2, "1", "2")]
    assert wg.told() == [[(0, 3), (0, 2)], [(2, 3), (1, 2)]]
    with pytest.raises(ValueError, match="ranks of this group"):
        wg.shrink([2])
    with pytest.raises(ValueError, match="no rank"):
        wg.shrink([0, 1])


def test_resize_grows_and_shrinks_to_a_size(elastic):
    wg = elastic
    wg.resize(4)
    assert wg.add(0) == [1, 1, 1, 1]
    wg.resize(1)  # the highest ranks go
    assert wg.world_size == 1 and _places(wg) == [(0, 1, "0", "1")]
    wg.resize(1)  # nothing to do
    wg.resize(3)
    assert wg.add(1) == [2, 2, 2]
    assert wg.told()[0] == [(0, 4), (0, 1), (0, 3)]
    with pytest.raises(ValueError, match="world size >= 1"):
        wg.resize(0)


def test_calls_in_flight_finish_on_the_ranks_they_started_on(elastic):
    wg = elastic
    pids = [i["pid"] for i in wg.worker_info()]
    running = wg.bind("slow_add", blocking=False)(1, delay=0.5)
    wg.grow(1)
    assert running.get() == [2, 2]  # two ranks: the call was split before the resize
    later = wg.bind("slow_add", blocking=False)(1, delay=0.3)
    wg.shrink([0])
    assert later.get() == [3, 3, 2]  # on the three ranks it started on, the one stopped included
    assert wg.world_size == 2 and wg.worker_info()[0]["pid"] == pids[1]


def test_calls_from_other_threads_meanwhile_go_to_whole_groups(elastic):
    wg = elastic
    sizes, errors, stop = [], [], threading.Event()

    def call_in_a_loop():
        while not stop.is_set():
            try:
                out = wg.add(0)
                sizes.append(len(out))
            except Exception as exc:  # reported below
                errors.append(exc)

    threads = [threading.Thread(target=call_in_a_loop) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(2):
            wg.grow(1)
            wg.shrink([0])
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors and sizes and set(sizes) <= {2, 3}
    assert wg.world_size == 2 and wg.add(0) == [1, 1]


def test_async_calls_on_a_stopped_rank_get_the_timeout(spmd_backend):
    caps = sc.backend_capabilities(spmd_backend)
    if not caps.resize:
        pytest.skip(f"the {spmd_backend} backend does not declare capabilities.resize")
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Sleeper), backend=spmd_backend) as wg:
        short = wg.bind("nap").submit(0.5, tag="short")
        wg.shrink([1], timeout=30)  # waits for it on rank 1
        assert short.get() == [("short", 0), ("short", 1)]
        wg.grow(1)
        long = wg.bind("nap").submit(30, tag="long")
        started = time.monotonic()
        wg.shrink([1], timeout=0.5)
        assert time.monotonic() - started < 20
        assert wg.world_size == 1 and wg.nap(0, tag="after") == [("after", 0)]
        if not caps.ranks_in_own_processes:
            return  # inline: the stopped rank's object still runs the call it was sent
        with pytest.raises(sc.WorkerDiedError):
            long.get(timeout=20)


def test_views_follow_the_resize(spmd_backend):
    if not sc.backend_capabilities(spmd_backend).resize:
        pytest.skip(f"the {spmd_backend} backend does not declare capabilities.resize")
    fused = sc.colocate(
        {"counter": sc.ClassWithInitArgs(Elastic, start=1), "other": sc.ClassWithInitArgs(Elastic)}
    )
    with sc.WorkerGroup(sc.ResourcePool([1]), fused, backend=spmd_backend) as wg:
        views = wg.spawn({"counter", "other"})
        views["counter"].grow(1)
        assert wg.world_size == views["other"].world_size == 2
        assert views["counter"].add(1) == [2, 2]
        assert views["other"].told() == [[(0, 2)], [(1, 2)]]


def test_a_process_group_refuses_unless_told_how_to_rebuild(spmd_backend):
    caps = sc.backend_capabilities(spmd_backend)
    if not caps.resize:
        pytest.skip(f"the {spmd_backend} backend does not declare capabilities.resize")
    if not caps.ranks_in_own_processes:
        pytest.skip("ranks inside the controller's process share one torch.distributed")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Distributed), backend=spmd_backend) as wg:
        assert wg.join() == [(0, 2, 2), (1, 2, 2)]
        with pytest.raises(RuntimeError, match="torch.distributed process group.*override on_resize"):
            wg.grow(1)
        assert wg.world_size == 2 and wg.all_sum() == [(0, 2, 2), (1, 2, 2)]  # nothing changed
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Rebuilding), backend=spmd_backend) as wg:
        wg.join()
        wg.shrink([0])
        assert wg.all_sum() == [(0, 1, 1)]
