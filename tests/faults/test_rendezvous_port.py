"""The rendezvous port (MASTER_PORT): held for the group's life, and a group start that survives it being taken.

A group picks MASTER_PORT when it starts; rank 0 binds it only when its code calls
``init_process_group``, seconds later. These tests take the port in that window on purpose.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import socket
from datetime import timedelta

import pytest
import torch

import spmdcall as sc
from spmdcall import rendezvous

pytestmark = pytest.mark.timeout(180)


class Joined(sc.Worker):
    """Joins torch.distributed in its constructor, as FSDP workers and the RL roles do."""

    def __init__(self):
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=60))

    def master_port(self) -> int:
        return int(os.environ["MASTER_PORT"])

    def total(self) -> float:
        import torch.distributed as dist

        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()


def _squat(port: int) -> socket.socket:
    """Take ``port`` as a job told to use it would: SO_REUSEADDR, listening (a reservation cannot stop that).
    On the loopback address the rendezvous uses: on all addresses, the bind fails when another
    program listens on the same port number on another address (Ray does, in a parallel run)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _bind_error(port: int) -> int | None:
    """The errno of a plain bind to ``port`` (what any other program gets), or None if it is free."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno
    return None


def test_a_reserved_port_is_handed_to_nobody_else_but_torch_store_binds_it():
    import torch.distributed as dist

    with rendezvous.PortReservation() as held:
        assert _bind_error(held.port) == errno.EADDRINUSE
        with socket.socket() as listener:  # outgoing connections skip it too
            listener.bind(("127.0.0.1", 0))
            listener.listen(64)
            clients = [socket.create_connection(listener.getsockname()) for _ in range(64)]
            assert held.port not in {c.getsockname()[1] for c in clients}
            for c in clients:
                c.close()
        for use_libuv in (True, False):
            store = dist.TCPStore("127.0.0.1", held.port, 1, True, timedelta(seconds=10), use_libuv=use_libuv)
            store.set("k", "v")
            assert store.get("k") == b"v"
            del store
        assert "held" in repr(held)
    assert _bind_error(held.port) is None and "closed" in repr(held)


def test_port_taken_tells_the_rendezvous_error_from_others():
    text = "DistNetworkError: The server socket has failed to listen ... port: 38057, useIpv6: false, code: -98, name: EADDRINUSE"
    assert rendezvous.port_taken(sc.WorkerError(0, "__init__", text), 38057)
    assert not rendezvous.port_taken(sc.WorkerError(0, "__init__", text), 38058)
    assert not rendezvous.port_taken(sc.WorkerError(0, "__init__", "ValueError: bad lr 38057"), 38057)
    assert not rendezvous.port_taken(RuntimeError(text), 38057)


def test_a_group_holds_its_rendezvous_port_while_it_lives(process_backend):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Joined), backend=process_backend) as wg:
        port = wg.master_port()[0]
        assert wg.total() == [3.0, 3.0]
        assert _bind_error(port) == errno.EADDRINUSE  # held: nobody else on the machine is given it


@pytest.fixture
def taken_first_port(process_backend, monkeypatch):
    """Take the group's first MASTER_PORT after it is reserved and before rank 0 binds it; the taken ports."""
    taken: list[socket.socket] = []
    if process_backend in ("process", "inline"):  # the backends that reserve the port themselves
        from spmdcall.backends import inline
        from spmdcall.backends.process import backend as process

        class TakenAtOnce(rendezvous.PortReservation):
            def __init__(self, host: str = "127.0.0.1", port: int = 0):
                super().__init__(host, port)
                if not taken:
                    taken.append(_squat(self.port))

        monkeypatch.setattr(
            process if process_backend == "process" else inline, "PortReservation", TakenAtOnce
        )
    else:
        if process_backend == "ray":
            from spmdcall.backends.ray.backend import RayBackend as Backend
        else:
            from spmdcall.backends.monarch.backend import MonarchBackend as Backend

        setup = Backend._setup

        def taken_before_setup(self, ranks):
            if not taken:  # rank 0's actor reserved the port in locate(); its __init__ runs in setup
                taken.append(_squat(self._contexts[0].master_port))
            return setup(self, ranks)

        monkeypatch.setattr(Backend, "_setup", taken_before_setup)
    yield taken
    for s in taken:
        s.close()


def test_a_group_starts_when_its_port_is_taken_before_rank_0_binds_it(
    process_backend, taken_first_port, caplog
):
    caplog.set_level(logging.WARNING, logger="spmdcall")
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Joined), backend=process_backend) as wg:
        assert len(taken_first_port) == 1, "the race was not set up"
        taken = taken_first_port[0].getsockname()[1]
        ports = wg.master_port()
        assert ports[0] == ports[1] != taken  # started again, on another port
        assert wg.total() == [3.0, 3.0]
    retries = [r.getMessage() for r in caplog.records if "rendezvous port" in r.getMessage()]
    assert len(retries) == 1 and str(taken) in retries[0] and "attempt 2 of 3" in retries[0], retries


@pytest.mark.skipif(
    importlib.util.find_spec("monarch") is None, reason="needs spmdcall[monarch] (torchmonarch)"
)
@pytest.mark.parametrize("process_backend", ["monarch"])
def test_a_monarch_group_starts_when_its_port_is_taken_before_rank_0_binds_it(
    process_backend, taken_first_port, caplog
):
    test_a_group_starts_when_its_port_is_taken_before_rank_0_binds_it(
        process_backend, taken_first_port, caplog
    )


def test_a_start_gives_up_after_its_attempts_with_the_ranks_error(monkeypatch):
    """Every port taken: the start fails after START_ATTEMPTS tries with rank 0's own error."""
    from spmdcall.backends.process import backend as process

    taken: list[socket.socket] = []

    class AlwaysTaken(rendezvous.PortReservation):
        def __init__(self, host: str = "127.0.0.1", port: int = 0):
            super().__init__(host, port)
            taken.append(_squat(self.port))

    monkeypatch.setattr(process, "PortReservation", AlwaysTaken)
    try:
        with pytest.raises(sc.WorkerError, match="EADDRINUSE") as info:
            sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Joined), backend="process")
        assert info.value.rank == 0 and len(taken) == rendezvous.START_ATTEMPTS
    finally:
        for s in taken:
            s.close()


@pytest.mark.parametrize("process_backend", ["inline"])
def test_an_inline_group_starts_when_its_port_is_taken_before_rank_0_binds_it(
    process_backend, taken_first_port, caplog
):
    """The inline backend's rank 0 joins torch.distributed in the controller (one rank: inline
    ranks run in turn): the same retry on a new port (a full make test run once met EADDRINUSE)."""
    caplog.set_level(logging.WARNING, logger="spmdcall")
    with sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(Joined), backend=process_backend) as wg:
        assert len(taken_first_port) == 1, "the race was not set up"
        assert wg.master_port() != [taken_first_port[0].getsockname()[1]] and wg.total() == [1.0]
    retries = [r.getMessage() for r in caplog.records if "rendezvous port" in r.getMessage()]
    assert len(retries) == 1 and "attempt 2 of 3" in retries[0], retries
