"""Colocation: ``sc.colocate`` fuses roles into one worker per rank, ``spawn`` gives a view per role,
and ``Call.role`` tells the backend which role a call is for."""

from __future__ import annotations

import pytest

import spmdcall as sc
from spmdcall.testing.workers import Counter, Plain, Reader, Weights

pytestmark = pytest.mark.timeout(120)


def test_colocated_roles_share_processes(spmd_backend):
    fused = sc.colocate(
        {"counter": sc.ClassWithInitArgs(Counter, start=5), "plain": sc.ClassWithInitArgs(Plain, "p")}
    )
    with sc.WorkerGroup(sc.ResourcePool([2]), fused, backend=spmd_backend) as wg:
        views = wg.spawn({"counter", "plain"})
        assert views["counter"].add(1) == [6, 6]
        assert views["plain"].hello("x") == ["p: hello x", "p: hello x"]
        assert views["counter"].set_each([7, 8]) == [7, 8]
        assert "hello" in views["plain"].method_names() and "hello" not in views["counter"].method_names()
        pids = [i["pid"] for i in views["counter"].identity()]
        assert [i["pid"] for i in wg.worker_info()] == pids
        with pytest.raises(ValueError, match="unknown roles"):
            wg.spawn({"nobody"})


class Both(sc.Colocated):
    """A fused class of its own: methods that use both roles of the rank."""

    def __init__(self, start: int):
        super().__init__(
            {"counter": sc.ClassWithInitArgs(Counter, start=start), "plain": sc.ClassWithInitArgs(Plain, "p")}
        )

    def both(self, k):
        return (self.role("counter").add(k), self.role("plain").hello(k))


class Tagged(sc.WorkerGroup):
    """A group subclass: its views from spawn are of its class too."""

    def tag(self) -> str:
        return f"tagged {self.name}"


def test_a_fused_subclass_with_roles_and_group_subclass_views(spmd_backend):
    fused = sc.ClassWithInitArgs(Both, 3)
    fused.roles = {"counter": sc.ClassWithInitArgs(Counter), "plain": sc.ClassWithInitArgs(Plain, "p")}
    with Tagged(sc.ResourcePool([2]), fused, backend=spmd_backend) as wg:
        assert wg.both(1) == [(4, "p: hello 1"), (4, "p: hello 1")]
        views = wg.spawn(["counter"])
        assert type(views["counter"]) is Tagged and views["counter"].tag().endswith("/counter")
        assert views["counter"].add(2) == [6, 6]
    with (
        pytest.raises(TypeError, match="sc.colocate"),
        Tagged(sc.ResourcePool([1]), sc.ClassWithInitArgs(Counter), backend=spmd_backend) as plain,
    ):
        plain.spawn(["counter"])


def test_colocated_roles_reach_their_siblings_of_the_same_rank(spmd_backend):
    fused = sc.colocate(
        {"weights": sc.ClassWithInitArgs(Weights), "reader": sc.ClassWithInitArgs(Reader, at_init=True)}
    )
    with sc.WorkerGroup(sc.ResourcePool([3]), fused, backend=spmd_backend) as wg:
        views = wg.spawn({"weights", "reader"})
        assert views["reader"].first_read() == [(0, 100), (1, 101), (2, 102)]  # built before it: reachable
        views["weights"].bump(5)
        assert views["reader"].read() == [(0, 0, 105), (1, 1, 106), (2, 2, 107)]  # the live object, same rank
        assert views["reader"].lookup_error("critic")[0] == (
            "ValueError",
            "no role 'critic' in this colocation; its roles are ['weights', 'reader']",
        )
        assert "sibling" not in views["reader"].method_names()
        assert "_peek" not in views["weights"].method_names()


def test_a_sibling_built_later_is_not_there_in_init(spmd_backend):
    fused = sc.colocate(
        {"reader": sc.ClassWithInitArgs(Reader, at_init=True), "weights": sc.ClassWithInitArgs(Weights)}
    )
    with pytest.raises(sc.WorkerError, match="role 'weights' is not built yet") as info:
        sc.WorkerGroup(sc.ResourcePool([2]), fused, backend=spmd_backend)
    assert info.value.method == "__init__" and info.value.exc_type == "RuntimeError"


def test_a_role_outside_a_colocation_has_no_siblings(spmd_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Reader), backend=spmd_backend) as wg:
        with pytest.raises(sc.WorkerError, match="Reader is not a role of a colocation") as info:
            wg.read()
        assert info.value.exc_type == "RuntimeError"
