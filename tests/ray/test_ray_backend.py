"""The ray backend on a real local Ray: placement, errors, dead actors, the data path, rank-to-rank
futures and detached groups. Behaviour shared with the other backends is the shipped conformance
suite's (spmdcall/testing/, run on every backend by tests/conformance/)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

import spmdcall as sc

ray = pytest.importorskip(
    "ray", minversion="2.40"
)  # [ray]'s floor; also rejects tests/ray/ seen as a namespace package
from spmdcall.backends.ray import actor as ray_actor  # noqa: E402
from spmdcall.backends.ray import detached as ray_detached  # noqa: E402
from spmdcall.backends.ray import placement as ray_placement  # noqa: E402
from spmdcall.group.detached import attach  # noqa: E402
from spmdcall.transport.envelope import Envelope  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]

ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class Probe(sc.Worker):
    """A light worker (no torch import, so its actors start fast)."""

    def __init__(self, tag: str = "probe"):
        self.tag = tag
        self.n = 0

    def where(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "pg": ctx.get_placement_group_id(),
            "cpus": ctx.get_assigned_resources().get("CPU"),
            "env": {k: os.environ[k] for k in ENV_KEYS},
            "tag": self.tag,
        }

    def devices(self) -> dict:
        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        return {
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "ray_gpus": [str(g) for g in gpus],
        }

    def bump(self) -> int:
        self.n += 1
        return self.n

    def echo(self, value):
        return value

    @sc.register(dispatch_mode=sc.Dispatch.ALL_TO_ALL)
    def echo_each(self, value):
        return value

    def fail(self):
        return {}["missing"]

    @sc.register(dispatch_mode=sc.Dispatch.ALL_TO_ALL, blocking=False)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


class Rows(sc.Worker):
    """Data-parallel methods on DataProto and raw tensors (imports torch when called)."""

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def stamp(self, batch):
        import torch

        batch.batch["producer_rank"] = torch.full((len(batch),), self.rank)
        batch.batch["producer_pid"] = torch.full((len(batch),), os.getpid())
        return batch

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def check(self, batch):
        import torch

        batch.batch["consumer_rank"] = torch.full((len(batch),), self.rank)
        batch.batch["consumer_pid"] = torch.full((len(batch),), os.getpid())
        return batch

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def fail_on_rank_one(self, batch):
        if self.rank == 1:
            raise RuntimeError("rank one refuses")
        return batch

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def stall(self, batch):
        time.sleep(60 if self.rank == 1 else 0)
        return batch

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def same_rows(self, batch):
        return batch

    def echo(self, value):
        return value

    def ones(self, n):
        import torch

        return torch.ones(n)

    def hold(self, seconds, value=None):
        time.sleep(seconds)
        return value is not None

    def segments(self):
        """How many shared-memory segments this process has made (and not closed)."""
        from spmdcall.transport import segments as channel

        return channel.pool().stats()["segments"]

    def writable_sum(self, t):
        t.add_(1)  # the received tensor is this rank's own memory
        return float(t.sum())


def group_of(cls, pool=None, **options) -> sc.WorkerGroup:
    return sc.WorkerGroup(pool or sc.ResourcePool([2]), sc.ClassWithInitArgs(cls), backend="ray", **options)


def placement_states(prefix: str) -> set[str]:
    return {pg["state"] for pg in ray.util.placement_group_table().values() if pg["name"].startswith(prefix)}


@pytest.fixture(scope="module")
def probes():
    with group_of(Probe, name="probes") as wg:
        yield wg


@pytest.fixture(scope="module")
def rows():
    """Producer and consumer whose values go through the object store, as between nodes (on the
    controller's node they go over shared-memory links: see the tests of ``rows_here``)."""
    pytest.importorskip("torch")
    pool = sc.ResourcePool([2])
    with (
        group_of(Rows, pool, name="producer", shared_memory=False) as producer,
        group_of(Rows, pool, name="consumer", shared_memory=False) as consumer,
    ):
        yield producer, consumer


# -- placement and environment ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_ranks_get_their_environment_from_rank_zeros_node(probes):
    where = probes.where()
    info = probes.worker_info()
    assert [w["rank"] for w in where] == [0, 1]
    assert [w["pid"] for w in where] == [i["pid"] for i in info]
    for rank, w in enumerate(where):
        assert w["env"] | {"MASTER_PORT": "?"} == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "MASTER_ADDR": info[0]["ip"],
            "MASTER_PORT": "?",
        }
    assert where[0]["env"]["MASTER_PORT"] == where[1]["env"]["MASTER_PORT"]
    assert (
        where[0]["pg"] == where[1]["pg"] and where[0]["node_id"] == where[1]["node_id"]
    )  # one placement group per node
    assert all(
        i["actor_name"] == f"{probes.name}:rank{i['rank']}" for i in info
    )  # the group name carries a uuid


@pytest.mark.timeout(60)
def test_shutdown_removes_placement_groups_but_never_ray(recwarn):
    with pytest.warns(UserWarning, match="ray_init_kwargs .* ignored"):
        wg = group_of(Probe, name="shortlived", ray_init_kwargs={"num_cpus": 1})
    assert placement_states(wg.name) == {"CREATED"}
    wg.shutdown()
    wg.shutdown()  # twice is fine
    assert placement_states(wg.name) == {"REMOVED"}
    assert ray.is_initialized()


@pytest.mark.timeout(60)
def test_pool_that_cannot_fit_fails_within_placement_timeout():
    started = time.monotonic()
    with pytest.raises(sc.ResourceInsufficientError) as err:
        group_of(Probe, sc.ResourcePool([64]), name="starved", placement_timeout=2)
    assert time.monotonic() - started < 10
    message = str(err.value)
    assert "node 0: 64 x {CPU: 1}" in message and "STRICT_PACK" in message
    assert "{CPU: 12} in total" in message and "largest node has {CPU: 8}" in message
    assert placement_states("starved-") == {"REMOVED"}  # nothing left pending to grab resources later

    # Fits the cluster in total, but on no single node: also refused, not left hanging.
    with pytest.raises(sc.ResourceInsufficientError, match="node 0: 9 x"):
        group_of(Probe, sc.ResourcePool([9]), name="toowide", placement_timeout=1)


@pytest.mark.timeout(90)
def test_groups_on_one_pool_share_its_bundles_up_to_max_colocate_count():
    pool = sc.ResourcePool([2], max_colocate_count=2)
    a, b, c = group_of(Probe, pool), group_of(Probe, pool), group_of(Probe, pool)
    try:
        wa, wb, wc = a.where(), b.where(), c.where()
        assert [w["pg"] for w in wa] == [w["pg"] for w in wb]  # same bundles: same machines and devices
        assert {w["cpus"] for w in wa + wb} == {0.5}  # each asks for 1/max_colocate_count of its bundle
        assert not {w["pid"] for w in wa} & {w["pid"] for w in wb}  # separate processes
        assert wc[0]["pg"] != wa[0]["pg"]  # a third group gets bundles of its own instead of waiting
        a.shutdown()
        assert b.bump() == [1, 1]  # b's bundles outlive a
        assert placement_states(a.name) == {"CREATED"}
    finally:
        for wg in (a, b, c):
            wg.shutdown()
    assert placement_states(a.name) == {"REMOVED"} and placement_states(c.name) == {"REMOVED"}


@pytest.mark.timeout(90)
def test_gpu_pool_makes_cuda_local_rank_the_gpu_ray_gave_each_rank():
    # The head node advertises 2 simulated GPUs: Ray assigns their ids as it would real ones.
    pool = sc.ResourcePool([2], use_gpu=True, max_colocate_count=2)
    with group_of(Probe, pool) as a, group_of(Probe, pool) as b:
        seen_a, seen_b = a.devices(), b.devices()
    for seen in (seen_a, seen_b):
        visible = seen[0]["visible"].split(",")
        assert (
            sorted(visible) == ["0", "1"] and seen[1]["visible"] == seen[0]["visible"]
        )  # the node's GPUs, in rank order
        assert all(len(s["ray_gpus"]) == 1 and visible[s["local_rank"]] == s["ray_gpus"][0] for s in seen)
    assert [s["ray_gpus"] for s in seen_a] == [
        s["ray_gpus"] for s in seen_b
    ]  # colocated groups share the devices


@pytest.mark.timeout(120)
def test_split_pools_run_in_their_parents_bundles_and_a_merge_uses_both():
    pool = sc.ResourcePool([2], use_gpu=True, max_colocate_count=2)
    left, right = pool.split(1)
    with group_of(Probe, left, name="left") as a, group_of(Probe, right) as b:
        gpus = [a.devices()[0]["ray_gpus"], b.devices()[0]["ray_gpus"]]
        assert sorted(gpus) == [["0"], ["1"]]  # the halves never share a device
        groups = ray_placement.placement_groups(left)
        assert len(groups) == 1 and ray_placement.placement_groups(pool) == groups
        assert a.where()[0]["pg"] == b.where()[0]["pg"] == groups[0].id.hex()
        with group_of(Probe, sc.ResourcePool.merge([right, left])) as c:
            assert [d["ray_gpus"] for d in c.devices()] == [gpus[1], gpus[0]]  # each rank keeps its slot
            assert [w["env"]["LOCAL_RANK"] for w in c.where()] == ["0", "1"]
    assert ray_placement.placement_groups(pool) == []  # the last group let them go
    assert placement_states(a.name) == {"REMOVED"}


@pytest.mark.timeout(120)
def test_a_merge_of_two_pools_runs_in_both_pools_bundles():
    first, second = sc.ResourcePool([1], max_colocate_count=2), sc.ResourcePool([1], max_colocate_count=2)
    with group_of(Probe, sc.ResourcePool.merge([first, second]), name="merged") as merged:
        with group_of(Probe, first) as a, group_of(Probe, second) as b:
            pgs = [w["pg"] for w in merged.where()]
            assert pgs == [a.where()[0]["pg"], b.where()[0]["pg"]] and pgs[0] != pgs[1]
    assert placement_states(merged.name) == {"REMOVED"}


@pytest.mark.timeout(60)
def test_object_refs_go_in_and_come_out_as_ray_code_expects(probes):
    # An ObjectRef argument is resolved by Ray on the worker, as for any actor call.
    assert probes.echo(ray.put({"k": 1})) == [{"k": 1}, {"k": 1}]
    assert probes.echo_each([ray.put(1), ray.put(2)]) == [1, 2]
    # submit_refs: the ObjectRef of each result itself, for code that calls ray.get.
    assert probes.capabilities.refs is ray.ObjectRef
    refs = probes.bind("echo", dispatch_mode=sc.Dispatch.ALL_TO_ALL).submit_refs([0, 10])
    assert all(isinstance(r, ray.ObjectRef) for r in refs) and ray.get(refs) == [0, 10]
    assert ray.get(probes.bind("echo", execute_mode=sc.Execute.RANK_ZERO).submit_refs(refs[1])) == [10]
    with pytest.raises(sc.WorkerError, match="missing"):
        ray.get(probes.bind("fail", execute_mode=sc.Execute.RANK_ZERO).submit_refs())


@pytest.mark.timeout(60)
def test_colocated_roles_share_each_ranks_actor():
    fused = sc.colocate({"left": sc.ClassWithInitArgs(Probe, "L"), "right": sc.ClassWithInitArgs(Probe, "R")})
    with sc.WorkerGroup(sc.ResourcePool([2]), fused, backend="ray") as wg:
        views = wg.spawn({"left", "right"})
        left, right = views["left"].where(), views["right"].where()
        assert [w["tag"] for w in left] == ["L", "L"] and [w["tag"] for w in right] == ["R", "R"]
        assert [w["pid"] for w in left] == [w["pid"] for w in right] == [i["pid"] for i in wg.worker_info()]
        assert (
            views["left"].bump() == [1, 1]
            and views["left"].bump() == [2, 2]
            and views["right"].bump() == [1, 1]
        )


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_worker_error_carries_the_users_traceback(probes):
    with pytest.raises(sc.WorkerError) as err:
        probes.fail()
    e = err.value
    assert e.rank in (0, 1) and (e.method, e.exc_type) == (
        "fail",
        "KeyError",
    )  # whichever rank reported first
    assert "in fail" in e.remote_traceback and "'missing'" in e.remote_traceback
    assert "ray::" not in e.remote_traceback and "_RankActor" not in e.remote_traceback  # not Ray's wrapper
    before = probes.bump()
    assert probes.bump() == [n + 1 for n in before]  # the group goes on


@pytest.mark.timeout(60)
def test_unpicklable_argument_is_refused_before_anything_is_sent(probes):
    before = probes.bump()
    with pytest.raises(TypeError, match=r"cannot send echo\(\) to rank 0: argument 0 \(lock\)"):
        probes.echo(threading.Lock())
    with pytest.raises(TypeError, match=r"cannot send echo_each\(\) to rank 1"):
        probes.echo_each([1, threading.Lock()])
    assert probes.bump() == [n + 1 for n in before]  # rank 0 never ran the refused call either


@pytest.mark.timeout(60)
def test_call_timeout_then_the_group_goes_on(probes):
    started = time.monotonic()
    future = probes.sleep([2.0, 2.0])
    with pytest.raises(sc.CallTimeoutError) as err:
        future.get(timeout=0.5)
    assert err.value.pending_ranks == [0, 1] and time.monotonic() - started < 1.5
    assert future.get() == [0, 1]


@pytest.mark.timeout(90)
def test_killed_actor_raises_worker_died_naming_its_rank_then_restarts():
    with group_of(Probe, name="victim") as wg:
        before = wg.where()
        future = wg.sleep([0.1, 60.0])
        time.sleep(0.5)
        os.kill(before[1]["pid"], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(sc.WorkerDiedError) as err:
            future.get()
        assert time.monotonic() - started < 30
        assert err.value.rank == 1 and err.value.method == "sleep"
        assert f"pid {before[1]['pid']}" in str(err.value)
        with pytest.raises(sc.WorkerDiedError, match="worker rank 1 died.*restart"):
            wg.bump()  # known dead: refused at once

        wg.restart()  # the dead ranks
        after = wg.where()
        assert after[0]["pid"] == before[0]["pid"] and after[1]["pid"] != before[1]["pid"]
        assert after[1]["env"] == before[1]["env"]  # same SPMD environment
        assert after[1]["pg"] == before[1]["pg"]  # same bundle
        assert wg.bump() == [1, 1]


# -- data path -------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_future_goes_rank_to_rank_without_the_controller(rows, monkeypatch):
    from spmdcall.data import DataProto

    torch = pytest.importorskip("torch")
    producer, consumer = rows
    opened = []
    real_open = Envelope.open
    monkeypatch.setattr(Envelope, "open", lambda self, **kw: opened.append(1) or real_open(self, **kw))

    batch = DataProto.from_dict({"x": torch.arange(7.0)}, non_tensors={"id": [f"r{i}" for i in range(7)]})
    stamped = producer.stamp(batch)  # a GroupFuture (blocking=False)
    out = consumer.check(stamped)
    assert out.batch["x"].tolist() == list(range(7)) and list(out.non_tensor_batch["id"]) == [
        f"r{i}" for i in range(7)
    ]
    assert out.batch["producer_rank"].tolist() == out.batch["consumer_rank"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    producer_pids = {i["pid"] for i in producer.worker_info()}
    assert set(out.batch["producer_pid"].tolist()) == producer_pids
    # The controller opened the consumer's two results and nothing of the producer's.
    assert len(opened) == 2
    assert all(f.state == "pending" for f in stamped.rank_futures)
    assert stamped.get().batch["producer_rank"].tolist() == [0, 0, 0, 0, 1, 1, 1]  # still there if wanted


@pytest.mark.timeout(120)
def test_a_failed_or_dead_producer_surfaces_in_the_consumers_call(rows):
    from spmdcall.data import DataProto

    torch = pytest.importorskip("torch")
    producer, consumer = rows
    batch = DataProto.from_dict({"x": torch.arange(4.0)})
    with pytest.raises(sc.WorkerError) as err:
        consumer.check(producer.fail_on_rank_one(batch))
    assert (err.value.rank, err.value.method) == (1, "fail_on_rank_one") and "rank one refuses" in str(
        err.value
    )

    stalled = producer.stall(batch)
    time.sleep(0.5)
    os.kill(producer.worker_info()[1]["pid"], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(sc.WorkerDiedError, match="produced an input of this call died"):
        consumer.check(stalled)
    assert time.monotonic() - started < 30
    assert len(consumer.echo(1)) == 2  # the consumer itself is fine
    producer.restart()
    assert producer.echo(2) == [2, 2]


@pytest.fixture
def stored():
    """A group whose values go through the object store, as they do to actors on other nodes."""
    pytest.importorskip("torch")
    with group_of(Rows, name="stored", shared_memory=False) as wg:
        yield wg


@pytest.mark.timeout(120)
def test_tensors_travel_out_of_band_once_and_arrive_writable(stored, monkeypatch):
    torch = pytest.importorskip("torch")
    producer = stored
    assert [i["shared_memory"] for i in producer.worker_info()] == [False, False]
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB

    envelope = ray_actor.seal({"t": big})
    assert [b.nbytes for b in envelope.buffers] == [4 << 20] and len(
        envelope.data
    ) < 1024  # bytes out of the pickle

    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda v, **kw: puts.append(v) or real_put(v, **kw))
    results = producer.echo(big)
    assert len(puts) == 1  # one copy in the object store, shared by both ranks
    monkeypatch.undo()
    for r in results:
        assert torch.equal(r, big) and r.numpy().flags.writeable

    n = float(big.numel())
    assert producer.writable_sum(big) == [float(big.sum()) + n] * 2
    assert big[:3].tolist() == [0.0, 1.0, 2.0]  # each rank changed its own copy only

    odd = {
        "bf16": torch.randn(64, 3).to(torch.bfloat16),
        "strided": torch.arange(100.0).reshape(10, 10).t(),
        "grad": torch.ones(3, requires_grad=True),
        "empty": torch.zeros(0, 5),
    }
    back = producer.echo(odd)[1]
    for key, value in odd.items():
        assert torch.equal(back[key].detach(), value.detach()) and back[key].dtype == value.dtype, key
    assert back["grad"].requires_grad


@pytest.mark.timeout(120)
def test_data_proto_results_are_concatenated_straight_from_the_object_store(stored, monkeypatch):
    """A DP_COMPUTE_PROTO collect reads each rank's columns where Ray stored them (no copy out of
    the object store first); the one copy is the concatenation's, into memory of its own."""
    from spmdcall import serialize
    from spmdcall.data import DataProto

    torch = pytest.importorskip("torch")
    batch = DataProto.from_dict({"x": torch.arange(1 << 16, dtype=torch.float32).reshape(1024, 64)})
    read_only_loads = []
    real_loads = serialize.loads
    monkeypatch.setattr(
        serialize,
        "loads",
        lambda data, buffers=(), read_only=False: (
            read_only_loads.append(read_only) or real_loads(data, buffers, read_only=read_only)
        ),
    )
    out = stored.check(batch)
    monkeypatch.undo()
    assert read_only_loads == [True, True]  # both results opened in place, not copied
    assert torch.equal(out.batch["x"], batch.batch["x"])
    assert out.batch["consumer_rank"].tolist() == [0] * 512 + [1] * 512
    out.batch["x"] += 1  # the collected batch is the caller's own, writable memory


def test_replies_come_back_as_bytes_unless_they_carry_buffers_or_a_large_pickle():
    np = pytest.importorskip("numpy")
    small = ray_actor.seal({"loss": 0.5})
    reply = ray_actor.pack_reply(small, 11, 22)
    assert type(reply) is bytes and not ray_actor.is_linked(reply)  # Ray returns bytes unpickled
    envelope, started, finished = ray_actor.unpack_reply(ray.get(ray.put(reply)))
    assert (envelope.open(), started, finished) == ({"loss": 0.5}, 11, 22)

    array = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: out-of-band, so the reply is a tuple
    words = [f"w{i}" for i in range(20_000)]  # a pickle over 64 KiB: a tuple, not copied into bytes
    for value in (array, words):
        reply = ray_actor.pack_reply(ray_actor.seal(value), 3, 4)
        assert type(reply) is tuple and not ray_actor.is_linked(reply)
        envelope, started, finished = ray_actor.unpack_reply(ray.get(ray.put(reply)))
        assert (started, finished) == (3, 4)
        np.testing.assert_array_equal(envelope.open(), value)

    linked = ray_actor.pack_linked_reply(7, 5, 6)
    assert ray_actor.is_linked(linked)
    with pytest.raises(RuntimeError, match="shared-memory link"):
        ray_actor.unpack_reply(linked)

    class Link:  # the frame the token names, as the real link's take_sealed() gives it
        def take_sealed(self, token):
            assert token == 7
            return Envelope(bytes(small.data), [])

    envelope, started, finished = ray_actor.unpack_linked_reply(linked, Link())
    assert (envelope.open(), started, finished) == ({"loss": 0.5}, 5, 6)


def test_small_arguments_travel_packed_in_one_bytes_and_the_rest_as_before(probes, monkeypatch):
    np = pytest.importorskip("numpy")
    from spmdcall.transport.link import Linked

    small, scale = ray_actor.seal([1, "a"]), ray_actor.seal(2.5)
    packed = ray_actor.pack_call(7, [small], {"scale": scale})
    assert type(packed) is bytes  # Ray sends bytes as they are, without pickling
    seq, args, kwargs = ray_actor.unpack_call(ray.get(ray.put(packed)))
    assert (seq, [a.open() for a in args], {k: v.open() for k, v in kwargs.items()}) == (
        7,
        [[1, "a"]],
        {"scale": 2.5},
    )
    # Out-of-band buffers, an ObjectRef for Ray to resolve, a token on a link: not packed.
    for other in (ray_actor.seal(np.zeros(1024)), ray.put(1), Linked(3)):
        assert ray_actor.pack_call(0, [small, other], {}) is None
    words = ray_actor.seal([f"{i:04d}" * 250 for i in range(25)])  # 25 KB, no buffers: 3 too many
    assert ray_actor.pack_call(0, [words, words], {}) is not None
    assert ray_actor.pack_call(0, [words, words, words], {}) is None

    # Through a group: each call goes packed exactly when its arguments can.
    sent = []
    real = ray_actor.pack_call
    monkeypatch.setattr("spmdcall.backends.ray.backend.pack_call", lambda *a: sent.append(p := real(*a)) or p)
    array = np.arange(1 << 16, dtype=np.float32)
    assert probes.echo({"k": [1, 2]}) == [{"k": [1, 2]}] * 2
    assert probes.echo(value=(3, "x")) == [(3, "x")] * 2
    assert [type(p) for p in sent] == [bytes] * 4
    sent.clear()
    for out in probes.echo([array, "tag"]):
        np.testing.assert_array_equal(out[0], array)
        assert out[1] == "tag"
    assert sent == [None, None]  # the array travels out of band
    assert probes.echo(ray.put(b"as bytes")) == [b"as bytes"] * 2  # a caller's ObjectRef, resolved
    sent.clear()
    before = probes.bump()  # no arguments: a plain actor's call sends none
    assert probes.bump() == [n + 1 for n in before] and sent == []


@pytest.fixture
def rows_here():
    """Producer and consumer groups on the head node, where this controller runs (the simulated
    GPUs are there only)."""
    pytest.importorskip("torch")
    pool = sc.ResourcePool([2], use_gpu=True, max_colocate_count=2)
    with group_of(Rows, pool, name="producer") as producer, group_of(Rows, pool, name="consumer") as consumer:
        yield producer, consumer


@pytest.mark.timeout(120)
def test_large_values_to_actors_on_this_node_go_through_shared_memory(rows_here, monkeypatch):
    from spmdcall.data import DataProto
    from spmdcall.transport import segments as channel

    torch = pytest.importorskip("torch")
    producer, consumer = rows_here
    assert [i["shared_memory"] for i in producer.worker_info()] == [True, True]
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: over the link both ways
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda v, **kw: puts.append(v) or real_put(v, **kw))
    results = producer.echo(big)
    for r in results:
        assert torch.equal(r, big) and r.numpy().flags.writeable
    n = float(big.numel())
    assert producer.writable_sum(big) == [float(big.sum()) + n] * 2
    assert big[:3].tolist() == [0.0, 1.0, 2.0] and torch.equal(results[0], big)  # each its own copy

    # Rows split over the ranks and joined again; a blocking result comes back over the link.
    batch = DataProto.from_dict({"x": torch.randn(4096, 256)}, non_tensors={"id": list(range(4096))})
    out = consumer.check(batch)
    assert torch.equal(out.batch["x"], batch.batch["x"]) and list(out.non_tensor_batch["id"]) == list(
        range(4096)
    )
    assert out.batch["consumer_rank"].tolist() == [0] * 2048 + [1] * 2048
    # A result handed to another group came back over the link: the controller sends it on,
    # rank i's output to rank i, over the consumer's link.
    plain = DataProto.from_dict({"x": batch.batch["x"]})  # no per-row strings to pickle
    stamped = producer.stamp(plain)
    handed = consumer.check(stamped)
    assert torch.equal(handed.batch["x"], batch.batch["x"])
    assert handed.batch["producer_rank"].tolist() == handed.batch["consumer_rank"].tolist()
    assert all(f.came_linked for f in stamped.rank_futures)
    assert puts == []  # nothing went through the object store
    monkeypatch.undo()

    # Segments are reused once the other side lets go of them, whether results come back by the
    # link (echo: by reference; ones: the actor's own segment) or by Ray (writable_sum's float):
    # neither side's pool grows.
    for calls in (
        lambda: producer.echo(big),
        lambda: producer.writable_sum(big),  # the actor tells, though it answers through Ray
        lambda: producer.ones(1 << 20),  # we tell, though we send it nothing large
    ):
        for _ in range(3):
            calls()
        before = channel.pool().stats()["segments"], producer.segments()
        for _ in range(10):
            calls()
        assert (channel.pool().stats()["segments"], producer.segments()) == before


@pytest.mark.timeout(120)
def test_rows_returned_as_they_came_go_back_by_reference(rows_here, monkeypatch):
    from spmdcall.data import DataProto
    from spmdcall.transport.channel import Channel

    torch = pytest.importorskip("torch")
    producer, _ = rows_here
    batch = DataProto.from_dict({"x": torch.randn(4096, 256)})  # 2 MiB to each rank, over the link
    producer.same_rows(batch)
    mapped = []
    real_map = Channel._map
    monkeypatch.setattr(
        Channel, "_map", lambda self, fd, *seg: mapped.append(seg) or real_map(self, fd, *seg)
    )
    out = producer.same_rows(batch)
    assert torch.equal(out.batch["x"], batch.batch["x"])
    # Each rank's rows came back as views of the controller's own segment: no copy into a new
    # segment of the actor's for the controller to map.
    assert mapped == []


@pytest.mark.timeout(120)
def test_the_link_never_makes_the_controller_wait_for_a_busy_actor(rows_here):
    torch = pytest.importorskip("torch")
    producer, _ = rows_here
    busy = producer.execute_all_async("hold", 3.0)
    # 40 values of 12 KB of pickle and 128 KiB of tensor: more than the link's socket holds while
    # the actors are busy. Those that do not fit go through the object store instead of waiting.
    value = {"pad": b"x" * 12000, "t": torch.ones(1 << 15)}
    queued = [producer.execute_all_async("hold", 0.0, value) for _ in range(40)]
    assert not busy.done()  # every call was sent while the actors still slept
    assert busy.get() == [False, False] and all(q.get() == [True, True] for q in queued)
    # A result whose pickle is large (many small tensors) comes back through the object store.
    many = {f"w{i}": torch.full((4,), float(i)) for i in range(3000)}
    back = producer.echo(many)[1]
    assert len(back) == 3000 and back["w2999"].tolist() == [2999.0] * 4


@pytest.mark.timeout(120)
def test_only_actors_on_the_controllers_node_are_linked(node_resource):
    # The 2-CPU nodes of the test cluster run on this machine too, but as other Ray nodes.
    with group_of(Rows, name="far", resources_per_worker={node_resource: 1}) as wg:
        assert [i["shared_memory"] for i in wg.worker_info()] == [False] * 2
        assert wg.echo(b"x" * (1 << 20)) == [b"x" * (1 << 20)] * 2


@pytest.mark.timeout(120)
def test_a_restarted_rank_gets_a_new_link():
    torch = pytest.importorskip("torch")
    big = torch.ones(1 << 20)
    with group_of(Rows, sc.ResourcePool([2], use_gpu=True), name="relink") as wg:  # on the head node
        assert [i["shared_memory"] for i in wg.worker_info()] == [True, True]
        assert torch.equal(wg.echo(big)[1], big)
        pid = wg.worker_info()[1]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)  # gone: the link to it is broken when the call is sent
        with pytest.raises(sc.WorkerDiedError, match="rank 1"):
            wg.echo(big)
        wg.restart()
        assert wg.worker_info()[1]["shared_memory"] is True
        assert all(torch.equal(r, big) for r in wg.echo(big))


# -- detached groups -------------------------------------------------------------------------------

ATTACH_SCRIPT = """
import json, sys
from spmdcall.group.detached import attach
wg = attach(sys.argv[1])
print(json.dumps({"bump": wg.bump(), "pids": [i["pid"] for i in wg.worker_info()], "name": wg.name}))
wg.restart([1])  # an attached controller can rebuild ranks too
assert wg.bump() == [3, 1], wg.bump()
wg.shutdown()  # stops the detached workers for good
"""


@pytest.mark.timeout(120)
def test_detached_group_outlives_its_controller_and_is_attached_by_name():
    name = f"detached{uuid.uuid4().hex[:6]}"
    wg = group_of(Probe, name=name, detached=True)
    group_name = wg.name
    assert wg.bump() == [1, 1]
    pids = [i["pid"] for i in wg.worker_info()]
    with pytest.raises(ValueError, match="already running"):
        group_of(Probe, name=name, detached=True)
    # Its full name (as its actors' names start) picks exactly this group.
    attached = attach(group_name)
    assert [i["pid"] for i in attached.worker_info()] == pids
    assert [r.pid for r in attached.status().values()] == pids  # its ranks' reporters answer here too
    del attached
    del wg  # this controller lets go; a detached group keeps running

    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_ADDRESS": address, "PYTHONPATH": os.pathsep.join([HERE, ROOT])}
    proc = subprocess.run(
        [sys.executable, "-c", ATTACH_SCRIPT, name], env=env, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"bump": [2, 2], "pids": pids, "name": group_name}  # same actors, same state

    assert ray_detached.find(name) == {}
    assert placement_states(group_name) == {"REMOVED"}
    with pytest.raises(ValueError, match="no detached spmdcall group"):
        attach(name)
