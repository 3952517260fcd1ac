"""Group behaviour particular to a backend, and a group's pure logic. What every backend must do
is the shipped conformance suite's (spmdcall/testing/), run on each backend by tests/conformance/."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import spmdcall as sc
from spmdcall import DataProto
from spmdcall.backends.inline import InlineBackend
from spmdcall.testing.workers import Counter, Reader

pytestmark = pytest.mark.timeout(120)


def test_inline_ranks_leave_the_controller_environment_as_it_was(monkeypatch):
    """The inline backend writes each rank's variables for its calls only: a variable the
    controller had keeps its value, one it lacked is gone again, after every call."""
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # what the ranks get too: left alone
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter), backend="inline") as g:
        assert dict(os.environ) == before
        for _ in range(2):
            info = g.identity()
            assert [i["env"]["RANK"] for i in info] == ["0", "1"]
            assert {i["env"]["MASTER_ADDR"] for i in info} == {"127.0.0.1"}
            assert dict(os.environ) == before


class Source:
    """Makes a new 1 MiB batch on every call (in its own shared-memory segments)."""

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, prompts):
        x = prompts.batch["x"].float()[:, None]
        return DataProto.from_dict({"a": x.repeat(1, 512), "b": -x.repeat(1, 512)})

    def segments(self):
        from spmdcall.transport.segments import pool

        return pool().stats()


class Sink:
    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def scribble(self, batch):
        """Writes into its input, and keeps it."""
        batch.batch["a"].add_(1000)
        self.kept = batch
        return DataProto.from_dict(
            {"a0": batch.batch["a"][:, 0].clone(), "b0": batch.batch["b"][:, 0].clone()}
        )

    def kept_b(self):
        return self.kept.batch["b"][:, 0].clone()

    def drop(self):
        del self.kept


def test_a_handed_off_batch_is_the_consumers_own_inline():
    """Rank i's output goes on to rank i (no concat), but as the consumer's own: its writes do not
    show in the producer's result, and the producer's later batches do not change a batch it keeps.
    (On process and ray, the next test checks this and more.)"""
    x = torch.arange(256.0)
    with (
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Source), backend="inline") as source,
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Sink), backend="inline") as sink,
    ):
        fut = source.produce(DataProto.from_dict({"x": torch.arange(256)}))
        out = sink.scribble(fut)
        assert torch.equal(out.batch["a0"], x + 1000) and torch.equal(out.batch["b0"], -x)
        assert torch.equal(fut.get().batch["a"][:, 0], x)
        del fut
        for k in (2, 3):
            assert torch.equal(
                source.produce(DataProto.from_dict({"x": torch.arange(256) * k})).get().batch["a"][:, 0],
                x * k,
            )
        assert torch.equal(torch.cat(sink.kept_b()), -x)


def test_handed_off_outputs_pass_on_in_the_producers_memory(process_backend, monkeypatch):
    """A GroupFuture passed into another group's call: rank i's output goes to rank i in the
    producer's own shared memory (the controller copies nothing), mapped copy-on-write, so the
    consumer's writes stay its own; the producer's segment is not reused while the consumer holds
    it, and is free again once the consumer lets go."""
    import gc

    from spmdcall.transport import frames

    copied = []
    real_copy_into = frames.copy_into
    monkeypatch.setattr(frames, "copy_into", lambda f, c, r: copied.append(c) or real_copy_into(f, c, r))
    prompts = DataProto.from_dict({"x": torch.arange(256)})
    x = torch.arange(256.0)
    with (
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Source), backend=process_backend) as source,
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Sink), backend=process_backend) as sink,
    ):
        fut = source.produce(prompts)
        copied.clear()  # the prompts went out as a copy (below a segment's size: inline) before
        out = sink.scribble(fut)
        assert copied == []  # nothing copied on the way to the sink
        assert torch.equal(out.batch["a0"], x + 1000) and torch.equal(out.batch["b0"], -x)
        assert torch.equal(fut.get().batch["a"][:, 0], x)  # the sink's writes are its own
        del fut, out  # the controller's own views of the first batch go
        gc.collect()

        for k in (2, 3, 4):  # new batches while the sink keeps the first: its bytes do not change
            again = source.produce(DataProto.from_dict({"x": torch.arange(256) * k})).get()
            assert torch.equal(again.batch["a"][:, 0], x * k)
        del again
        assert torch.equal(torch.cat(sink.kept_b()), -x)

        gc.collect()
        kept = source._backend._kept  # the producers' segments the controller keeps to hand on
        received, held = len(kept.snapshot()), sum(s["segments"] - s["free"] for s in source.segments())
        sink.drop()
        assert len(kept.snapshot()) == received - 2  # on the sink's reply, the controller let go
        if process_backend == "process":  # a Ray actor hears of it when it next reads its link
            source.segments()  # the source hears of it with this call
            assert sum(s["segments"] - s["free"] for s in source.segments()) == held - 2


def test_a_role_built_outside_any_group_has_no_siblings():
    with pytest.raises(RuntimeError, match=r"sc.colocate\(\{'weights': ..., ...\}\)"):
        Reader().read()  # built by hand, outside any group: the same error as a role outside a colocation


def test_split_and_merged_pools_keep_their_device_slots():
    pool = sc.ResourcePool([4, 4], use_gpu=True, max_colocate_count=3)
    first, second = pool.split([2, 6])
    assert (first.world_size, second.world_size) == (2, 6)
    assert second.process_on_nodes == [2, 4] and second.placements() == [(0, 2), (0, 3)] + [
        (1, b) for b in range(4)
    ]
    assert [(base is pool, node) for base, node, _ in second.slots()] == [(True, 0)] * 2 + [(True, 1)] * 4
    assert (second.use_gpu, second.max_colocate_count) == (True, 3)
    # Split again (equal parts of 2), then merge back in another order: slots follow the ranks.
    quarters = second.split(2)
    assert [q.placements() for q in quarters] == [[(0, 2), (0, 3)], [(0, 0), (0, 1)], [(0, 2), (0, 3)]]
    merged = sc.ResourcePool.merge([quarters[2], first])
    assert [(node, bundle) for _, node, bundle in merged.slots()] == [(1, 2), (1, 3), (0, 0), (0, 1)]
    assert merged.process_on_nodes == [2, 2]
    # Local ranks count from 0 on every node of the new pool, whatever its slots.
    ctx = merged.contexts("127.0.0.1", 1234)
    assert [(c.rank, c.node_rank, c.local_rank, c.local_world_size) for c in ctx] == [
        (0, 0, 0, 2),
        (1, 0, 1, 2),
        (2, 1, 0, 2),
        (3, 1, 1, 2),
    ]
    with pytest.raises(ValueError, match="add up to 7"):
        pool.split([3, 4])
    with pytest.raises(ValueError, match="does not divide"):
        pool.split(3)
    with pytest.raises(ValueError, match="same device slot twice"):
        sc.ResourcePool.merge([first, first])
    with pytest.raises(ValueError, match="different use_gpu"):
        sc.ResourcePool.merge([first, sc.ResourcePool([1])])


def test_bad_constructor_arguments_are_clear():
    with pytest.raises(TypeError, match="ClassWithInitArgs"):
        sc.WorkerGroup(sc.ResourcePool([2]), Counter)
    with pytest.raises(TypeError, match="expects a class"):
        sc.ClassWithInitArgs(Counter(), 1)
    with pytest.raises(ValueError, match="positive integer"):
        sc.ResourcePool([0])
    with pytest.raises(TypeError, match="list of process counts"):
        sc.ResourcePool(2)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Counter), backend="nope")


# -- where the ranks are (reports) ----------------------------------------------------------------


def test_warn_after_must_be_a_positive_number():
    with pytest.raises(ValueError, match=r"warn_after must be a positive number of seconds or None, got -1"):
        sc.register(warn_after=-1)
    with pytest.raises(ValueError, match=r"warn_after must be a positive number of seconds or None, got '1'"):
        sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Counter), backend="inline", warn_after="1")


class _NoReports(InlineBackend):
    """A backend that declares no reports (as a third party's may)."""

    capabilities = sc.Capabilities(ranks_in_own_processes=False)


def test_a_backend_without_reports_gives_reports_without_stacks():
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter), backend=_NoReports()) as g:
        reports = g.status()
    assert sorted(reports) == [0, 1]
    assert all(not r.threads and "reports no stacks" in r.note for r in reports.values())


def test_a_timeout_error_with_reports_pickles_and_its_message_is_bounded():
    stack = "".join(f'  File "w.py", line {i}, in f\n    f()\n' for i in range(500))
    threads = {f"thread-{i}": stack for i in range(40)}
    reports = {r: sc.RankReport(r, [("hang", 2.0)], threads, pid=100 + r) for r in range(64)}
    err = sc.CallTimeoutError("hang", 1.0, list(range(64)), reports)
    assert len(str(err)) < 13_000 and "the full reports are in .reports" in str(err)
    assert "rank 0 (pid 100): running hang() for 2.0 s" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert again.reports == reports and str(again) == str(err)


def test_resize_needs_a_backend_that_declares_it():
    import dataclasses

    backend = InlineBackend()
    backend.capabilities = dataclasses.replace(backend.capabilities, resize=False)
    with sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Counter), backend=backend) as wg:
        with pytest.raises(
            TypeError, match=r"the inline backend cannot resize.*capabilities\.resize is False"
        ):
            wg.grow(1)
        assert wg.world_size == 1
