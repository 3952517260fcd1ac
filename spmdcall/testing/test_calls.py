"""Calls in every dispatch and execute mode, the SPMD environment, and a group's life: what every
backend must do with plain Python values (no torch needed)."""

from __future__ import annotations

import json

import pytest

import spmdcall as sc
from spmdcall.testing.plugin import own_processes
from spmdcall.testing.workers import Counter, Plain

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def counters(spmd_backend):
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter, start=1), backend=spmd_backend
    ) as wg:
        yield wg


@pytest.fixture
def counter(counters):
    """A 2-rank Counter(start=1) group shared by the module: each test finds both counters at 1."""
    assert counters.set_each([1, 1]) == [1, 1]
    return counters


def test_one_to_all_returns_one_result_per_rank(counter):
    assert counter.world_size == 2
    assert counter.add(3) == [4, 4]
    assert counter.add(1) == [5, 5]


def test_all_to_all_gives_rank_i_entry_i(counter):
    assert counter.set_each([10, 20]) == [10, 20]
    assert counter.get() == [10, 20]
    assert counter.scaled([2, 3]) == [20, 60]


def test_rank_zero_modes_return_rank_zero_result_only(counter):
    assert counter.only_zero(5) == (0, 6)
    assert counter.zero_executes() == 0
    assert counter.execute_rank_zero("get") == 1
    assert counter.execute_all("get") == [1, 1]


def test_bind_chooses_the_modes_at_the_call_site(counter):
    # The method's own modes stay where none is given; the chosen ones apply to this call only.
    each = counter.bind("add", dispatch_mode=sc.Dispatch.ALL_TO_ALL)
    assert each.dispatch_mode is sc.Dispatch.ALL_TO_ALL and each.execute_mode is sc.Execute.ALL
    assert each([10, 20]) == [11, 21]
    assert counter.add(1) == [12, 22]
    assert counter.bind("get", execute_mode=sc.Execute.RANK_ZERO)() == 12
    pending = counter.bind("scaled", blocking=False)([2, 3])
    assert isinstance(pending, sc.GroupFuture) and pending.get() == [24, 66]
    assert counter.bind("set_each", dispatch_mode="ONE_TO_ALL")(1) == [1, 1]
    with pytest.raises(TypeError, match="method name"):
        counter.bind(None)
    with pytest.raises(ValueError, match="NO_SUCH_MODE"):
        counter.bind("add", dispatch_mode="NO_SUCH_MODE")


def test_submit_refs_is_declared_by_the_backend(counter):
    if counter.capabilities.refs is None:
        with pytest.raises(TypeError, match="capabilities.refs is None"):
            counter.add.submit_refs(1)
        return
    # One reference per running rank, of the declared class; what they hold is the runtime's to
    # give (tests/ray checks ray.get on them). A method without side effects: the calls may run
    # after later group calls.
    refs = counter.bind("scaled", dispatch_mode=sc.Dispatch.ALL_TO_ALL).submit_refs([2, 3])
    assert len(refs) == 2 and all(isinstance(r, counter.capabilities.refs) for r in refs)
    assert len(counter.bind("get", execute_mode=sc.Execute.RANK_ZERO).submit_refs()) == 1


def test_spmd_context_of_every_rank(counter):
    info = counter.identity()
    contexts = [i["context"] for i in info]
    assert [c["rank"] for c in contexts] == [0, 1]
    assert all(c["world_size"] == 2 and c["local_rank"] == c["rank"] for c in contexts)
    assert all(c["local_world_size"] == 2 and c["node_rank"] == 0 for c in contexts)
    assert [i["world_size"] for i in info] == [2, 2] and [i["local_rank"] for i in info] == [0, 1]
    assert contexts[0]["master_addr"] and contexts[0]["master_port"] > 0
    assert {(c["master_addr"], c["master_port"]) for c in contexts} == {
        (contexts[0]["master_addr"], contexts[0]["master_port"])
    }


def test_spmd_environment_of_every_rank_process(counter):
    """A rank that is a process of its own has RANK, WORLD_SIZE, ... in its os.environ, so
    torch.distributed.init_process_group() works in it unchanged."""
    info = counter.identity()
    if not own_processes(counter, [i["pid"] for i in info]):
        pytest.skip("the ranks are not processes of their own (worker_info): no os.environ of their own")
    for i in info:
        ctx, env = i["context"], i["env"]
        assert env == {
            "RANK": str(ctx["rank"]),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(ctx["rank"]),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": ctx["master_addr"],
            "MASTER_PORT": str(ctx["master_port"]),
        }


def test_worker_info_names_every_rank(counter):
    info = counter.worker_info()
    assert len(info) == 2 and all(isinstance(i["pid"], int) and i["host"] for i in info)


def test_arguments_and_results_are_copies(counter):
    items = [7]
    assert counter.append_to(items) == [[7, 0], [7, 1]]  # each rank got its own copy
    assert items == [7]  # the caller's list is untouched


def test_groups_on_split_pools(spmd_backend):
    left, right = sc.ResourcePool([3]).split([1, 2])
    with (
        sc.WorkerGroup(left, sc.ClassWithInitArgs(Counter), backend=spmd_backend) as a,
        sc.WorkerGroup(right, sc.ClassWithInitArgs(Counter), backend=spmd_backend) as b,
    ):
        assert a.world_size == 1 and b.world_size == 2
        assert [i["context"]["local_rank"] for i in b.identity()] == [0, 1]
        assert a.add(1) == [1] and b.add(2) == [2, 2]


def test_any_class_is_a_group(spmd_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Plain, "w"), backend=spmd_backend) as wg:
        assert wg.hello("you") == ["w: hello you", "w: hello you"]
        assert "hello" in dir(wg)
        assert wg.method_names() == ["hello"]


def test_methods_are_discoverable_and_documented(counter):
    names = counter.method_names()
    assert {"add", "double", "identity", "get"} <= set(names) and "_private" not in names
    assert "add" in dir(counter)
    assert counter.add.__doc__ == "Add k on every rank."
    with pytest.raises(AttributeError, match="no public method 'nope'"):
        counter.nope()
    with pytest.raises(AttributeError):
        counter._private()


def test_custom_dispatch_modes_by_object_name_and_dict(spmd_backend):
    def first_rank_gets_all(group, *args, **kwargs):
        return tuple([a] + [None] * (group.world_size - 1) for a in args), {}

    def collect_sum(group, outputs):
        return sum(o for o in outputs if o is not None)

    mode = sc.register_dispatch_mode(
        "SPMDCALL_TESTING_SUM_FIRST", first_rank_gets_all, collect_sum, overwrite=True
    )

    class Adder:
        @sc.register(dispatch_mode=mode)
        def by_object(self, x):
            return None if x is None else x + 1

        @sc.register(dispatch_mode="SPMDCALL_TESTING_SUM_FIRST")
        def by_name(self, x):
            return None if x is None else x * 2

        @sc.register(
            dispatch_mode={"dispatch_fn": sc.Dispatch.ONE_TO_ALL.dispatch_fn, "collect_fn": collect_sum}
        )
        def by_dict(self, x):
            return x

    with sc.WorkerGroup(sc.ResourcePool([3]), sc.ClassWithInitArgs(Adder), backend=spmd_backend) as wg:
        assert wg.by_object(1) == 2
        assert wg.by_name(5) == 10
        assert wg.by_dict(4) == 12


def test_shutdown_and_context_manager(spmd_backend):
    wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter), backend=spmd_backend)
    assert wg.add(1) == [1, 1]
    wg.shutdown()
    wg.shutdown()  # twice is fine
    with pytest.raises(RuntimeError, match="shut down"):
        wg.add(1)
    with sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Counter), backend=spmd_backend) as wg:
        assert wg.add(2) == [2]
    with pytest.raises(RuntimeError, match="shut down"):
        wg.add(1)


def test_constructor_error_is_a_worker_error(spmd_backend):
    with pytest.raises(sc.WorkerError) as info:
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Plain), backend=spmd_backend)  # no "tag"
    assert info.value.method == "__init__" and "tag" in str(info.value)


def test_trace_records_dispatch_execute_collect(counter, tmp_path):
    path = tmp_path / "trace.json"
    with sc.trace(path):
        counter.add(1)
        counter.scaled([1, 2])
    events = json.loads(path.read_text())["traceEvents"]
    names = [e["name"] for e in events if e["ph"] == "X"]
    assert names.count("add dispatch") == 1 and names.count("add collect") == 1 and names.count("add") == 2
    ranks = sorted(e["args"]["rank"] for e in events if e["ph"] == "X" and e["name"] == "scaled")
    assert ranks == [0, 1]
