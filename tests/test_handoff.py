"""A GroupFuture passed into another group's call (group/handoff.py): whatever the two methods'
modes and world sizes, every consumer rank gets what the usual path (collect on the controller,
then dispatch) would give it, padding included; on process the bytes go rank to rank; and a
user's ``.get()`` result and what another group receives are each their own."""

from __future__ import annotations

import pytest
import torch

import spmdcall as sc
from spmdcall import DataProto

pytestmark = pytest.mark.timeout(180)

COLS = 512  # float32 columns: 2 KiB a row, so a rank's output is out of band (64 KiB and more)


class Rows(sc.Worker):
    """Makes ``k`` rows per prompt row (k samples per prompt), with a metric per rank."""

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, prompts):
        return self._rows(prompts, 1)

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce_twice(self, prompts):
        return self._rows(prompts, 2)

    def _rows(self, prompts, k):
        x = prompts.batch["x"].float().repeat_interleave(k)[:, None]
        out = DataProto.from_dict({"a": x.repeat(1, COLS), "b": -x}, meta_info={"step": 3})
        out.meta_info["metrics"] = {"rank": [self.rank]}
        return out

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, execute_mode=sc.Execute.RANK_ZERO, blocking=False)
    def export(self, n):
        x = torch.arange(float(n))[:, None]
        return DataProto.from_dict({"a": x.repeat(1, COLS), "b": -x}, meta_info={"step": 4})

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, execute_mode=sc.Execute.RANK_ZERO, blocking=False)
    def weights(self):
        return {f"w{i}": torch.full((64 * 1024,), float(i)) for i in range(3)}


class Taker(sc.Worker):
    """Says which rows each rank got, and what meta_info."""

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def take(self, batch):
        assert torch.equal(batch.batch["a"][:, -1:], -batch.batch["b"])  # the columns' rows agree
        return DataProto.from_dict(
            {"x": batch.batch["a"][:, 0].clone(), "rank": torch.full((len(batch),), self.rank)},
            meta_info={"got": {k: v for k, v in batch.meta_info.items() if k != "metrics"}},
        )

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def take_pair(self, first, second):
        assert torch.equal(first.batch["a"], second.batch["a"])
        return DataProto.from_dict({"x": first.batch["a"][:, 0].clone()})

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def whole(self, value, scale=1):
        """What a rank got, in plain numbers; then writes into it (its own copy)."""
        if isinstance(value, dict):
            seen = {k: v.tolist()[:2] + [len(v)] for k, v in value.items()}
            for v in value.values():
                v.add_(100)
            return seen
        seen = (value.batch["a"][:, 0].tolist(), value.batch["b"][:, 0].tolist(), value.meta_info, scale)
        value.batch["a"].add_(100)
        return seen

    def keep_whole(self, value):
        self.kept = value
        return sorted(value)

    def kept_sum(self):
        return {k: float(v.sum()) for k, v in self.kept.items()}


class Mesh(sc.Worker):
    """4 ranks as dp 2 x tp 2: ranks 0 and 2 collect."""

    def __init__(self):
        self.register_mesh("m", dp_rank=self.rank // 2, dp_size=2, is_collect=self.rank % 2 == 0)

    @sc.register(dispatch_mode=sc.nd_dispatch("m"), blocking=False)
    def produce(self, prompts):
        x = prompts.batch["x"].float()[:, None]
        return DataProto.from_dict({"a": x.repeat(1, COLS), "b": -x})

    @sc.register(dispatch_mode=sc.nd_dispatch("m"))
    def take(self, batch):
        return DataProto.from_dict(
            {"x": batch.batch["x"].clone(), "rank": torch.full((len(batch),), self.rank)}
        )


def _prompts(n: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n)})


def _same(a: DataProto, b: DataProto) -> None:
    assert a.batch.keys() == b.batch.keys()
    for key in a.batch.keys():
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert a.meta_info == b.meta_info


def test_nd_mesh_to_another_split_and_back(suite_backend):
    """nd_dispatch (dp 2 x tp 2) into a 3-rank DP_COMPUTE_PROTO group and back: rows follow the
    mesh's collect ranks and dp ranks (tp replicas get the same rows). First in the module: on
    ray, its groups and the module's do not fit on the test cluster at once."""
    with (
        sc.WorkerGroup(sc.ResourcePool([4]), sc.ClassWithInitArgs(Mesh), backend=suite_backend) as mesh,
        sc.WorkerGroup(sc.ResourcePool([3]), sc.ClassWithInitArgs(Taker), backend=suite_backend) as take,
    ):
        fut = mesh.produce(_prompts(5))
        _same(take.take(fut), take.take(fut.get()))
        back = take.take.submit(mesh.produce(_prompts(7)))  # columns x and rank, 7 rows over 3 ranks
        _same(mesh.take(back), mesh.take(back.get()))
        assert mesh.take(back).batch["x"].tolist() == [float(i) for i in range(7)]


@pytest.fixture(scope="module")
def groups(suite_backend):
    backend = suite_backend
    made = {
        "rows2": sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Rows), backend=backend),
        "take2": sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Taker), backend=backend),
        "take3": sc.WorkerGroup(sc.ResourcePool([3]), sc.ClassWithInitArgs(Taker), backend=backend),
    }
    yield made
    for g in made.values():
        g.shutdown()


@pytest.mark.parametrize("consumer", ["take2", "take3"])
@pytest.mark.parametrize(("num_rows", "k"), [(6, 1), (7, 1), (5, 2), (1, 1)])
def test_rows_reach_each_rank_as_the_usual_path_gives_them(groups, consumer, num_rows, k):
    """DP_COMPUTE_PROTO into DP_COMPUTE_PROTO, the same or another world size, padded or not on
    either side (k rows per prompt row): each consumer rank of another split gets the rows, and
    meta_info, that collecting on the controller and splitting again would give it; the same
    split hands rank i's output to rank i; either way the result is the usual path's."""
    produce = groups["rows2"].produce if k == 1 else groups["rows2"].produce_twice
    fut = produce(_prompts(num_rows))
    handed = groups[consumer].take(fut)
    usual = groups[consumer].take(fut.get())
    if consumer == "take2":  # the same split: rank i takes rank i's output, padding rows and all
        del handed.batch["rank"], usual.batch["rank"]
    _same(handed, usual)
    assert handed.batch["x"].tolist() == [float(i) for i in range(num_rows) for _ in range(k)]


def test_rank_zeros_rows_split_over_another_group(groups):
    fut = groups["rows2"].export(7)  # rank 0 alone makes them: no padding of its own
    _same(groups["take3"].take(fut), groups["take3"].take(fut.get()))


def test_two_futures_split_alike(groups):
    a, b = groups["rows2"].produce(_prompts(5)), groups["rows2"].produce(_prompts(5))
    _same(groups["take3"].take_pair(a, b), groups["take3"].take_pair(a.get(), b.get()))


@pytest.mark.parametrize("num_rows", [4, 5])
def test_a_split_result_reaches_every_rank_whole(groups, num_rows):
    """DP_COMPUTE_PROTO into ONE_TO_ALL: every rank gets the whole result, unpadded, with its
    merged meta_info, beside an argument that is not a future."""
    fut = groups["rows2"].produce(_prompts(num_rows))
    handed = groups["take3"].whole(fut, scale=2)
    assert handed == groups["take3"].whole(fut.get(), scale=2)
    xs = [float(i) for i in range(num_rows)]
    assert handed == [(xs, [-x for x in xs], {"step": 3, "metrics": {"rank": [0, 1]}}, 2)] * 3


def test_rank_zero_to_every_rank_and_each_copy_is_its_own(groups, suite_backend):
    """RANK_ZERO -> ONE_TO_ALL: every consumer rank gets rank 0's dict; the consumers' writes
    (each adds 100) stay theirs; the user's ``.get()`` result, written to and changed in shape,
    changes nothing that another group gets afterwards, before or after the first hand-off."""
    if suite_backend == "inline":
        pytest.skip("inline ranks are handed the collected value as it is (nothing is handed off)")
    fut = groups["rows2"].weights()
    first = groups["take2"].whole(fut)
    assert first == [{f"w{i}": [float(i), float(i), 64 * 1024] for i in range(3)}] * 2
    mine = fut.get()
    assert [float(v[0]) for v in mine.values()] == [0.0, 1.0, 2.0]  # the consumers' writes are theirs
    for v in mine.values():
        v.mul_(-1)  # the user writes to the result...
    del mine["w0"]  # ...and changes its shape
    assert groups["take3"].keep_whole(fut) == [["w0", "w1", "w2"]] * 3  # what rank 0 sent
    sums = {f"w{i}": float(i) * 64 * 1024 for i in range(3)}
    assert groups["take3"].kept_sum() == [sums] * 3
    for v in mine.values():
        v.add_(7)  # later writes of the user do not reach what the consumers keep
    assert groups["take3"].kept_sum() == [sums] * 3
    assert float(fut.get()["w1"][0]) == -1.0 + 7  # the user's result is the user's own


def test_the_controller_copies_none_of_the_bytes(monkeypatch, groups, suite_backend):
    """A hand-off of any kind copies nothing into the controller's shared memory: the consumers
    map the producers' segments (on process; on ray and monarch, between actors linked to the
    controller on its node, as the test's are)."""
    if suite_backend == "inline":
        pytest.skip("inline ranks share the controller's memory")
    from spmdcall.transport import frames

    copied = []
    real_copy_into = frames.copy_into
    monkeypatch.setattr(frames, "copy_into", lambda f, c, r: copied.append(c) or real_copy_into(f, c, r))
    futures = [groups["rows2"].produce(_prompts(64)), groups["rows2"].weights(), groups["rows2"].export(64)]
    for f in futures:
        f.get()
    copied.clear()
    groups["take3"].take(futures[0])  # another split
    groups["take2"].take(futures[0])  # the same split
    groups["take3"].whole(futures[0])  # the whole of a split result
    groups["take3"].whole(futures[1])  # rank 0 to every rank
    groups["take3"].take(futures[2])  # rank 0's rows split
    assert copied == []
    groups["take3"].whole(futures[1].get())  # the value itself: copied, as any argument
    assert copied != []


def test_transfer_stats_and_traces_say_what_went_through_the_controller(tmp_path, suite_backend):
    """``transfer_stats()`` and each dispatch's and collect's trace span: a hand-off's bytes are
    handed on (not sent), a value's bytes are sent, and ``.get()``'s are collected; a backend
    that does not count says None."""
    import json

    weights = 3 * 64 * 1024 * 4  # bytes of rank 0's dict
    with (
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Rows), backend=suite_backend) as rows,
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Taker), backend=suite_backend) as take,
        sc.trace(tmp_path / "trace.json"),
    ):
        fut = rows.weights()
        take.whole(fut)
        handed = take.transfer_stats()
        value = fut.get()
        take.whole(value)
        sent = take.transfer_stats()
        produced = rows.transfer_stats()
    assert (handed.calls, sent.calls, produced.calls) == (1, 2, 1)
    if not rows.capabilities.counts_bytes:
        assert (sent.sent_bytes, sent.handed_on_bytes, produced.collected_bytes) == (None, None, None)
        return
    if _off_the_controllers_node(suite_backend, rows, take):
        # Ray actors on other nodes (the head was full): rank 0's result, fetched, is put in the
        # object store once for every rank (docs/data.md, "Where the bytes go").
        assert handed.handed_on_bytes == 0 and weights <= handed.sent_bytes < weights + 16 * 1024
    else:
        assert handed.handed_on_bytes == weights and handed.sent_bytes < 16 * 1024
    assert sent.handed_on_bytes == handed.handed_on_bytes and sent.sent_bytes - handed.sent_bytes >= weights
    assert weights <= produced.collected_bytes < weights + 16 * 1024  # .get() of rank 0's result
    spans = {
        (e["name"], e["args"]["group"]): e["args"]
        for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
        if e["name"].endswith(("dispatch", "collect"))
    }
    assert spans["whole dispatch", take.name]["handed_on_bytes"] == 0  # the last call's: the value
    assert spans["whole dispatch", take.name]["sent_bytes"] >= weights
    assert spans["weights collect", rows.name]["collected_bytes"] == produced.collected_bytes


def _off_the_controllers_node(backend: str, *groups: sc.WorkerGroup) -> bool:
    """Whether some rank of ``groups`` is a Ray actor on another node than the controller's (no
    shared-memory link: results go through the object store)."""
    if backend != "ray":
        return False
    import ray

    here = ray.get_runtime_context().get_node_id()
    return any(w["node_id"] != here for g in groups for w in g.worker_info())
