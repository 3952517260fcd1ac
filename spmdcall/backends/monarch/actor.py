"""What runs inside a ``monarch`` backend worker: the Monarch actor of one rank.

The actor's endpoints are all plain (Monarch 0.7 does not let one actor class mix ``async def``
and plain endpoints), so Monarch delivers this actor's messages one at a time on a thread of its
own. A call comes as ``run`` (sent to this rank alone) or ``cast`` (one message to every rank of
the mesh, whose replies Monarch gathers), each with the call's number in the rank's sequence:
Monarch delivers the two by different paths, so the actor runs calls by their numbers, not by
their arrival. Both answer through an explicit response port. Calls run as every spmdcall
backend runs them (``runtime/calls.py``): in the order they were sent, plain methods one at a
time, ``async def`` methods as overlapping tasks. For a class with async methods the endpoint only
queues the call for the rank's call thread, whose event loop runs them. For a class without, the
endpoint runs the call itself, on Monarch's thread, as a plain Monarch endpoint runs: a hop to
another thread, and a reply that is an ``Envelope`` object rather than its bytes, each cost about
0.1 ms of a no-op's 1.3 ms here. While such a call runs, the actor's other messages (the next
calls, ``release``) wait for it; "where is it" and "stop it" go to the rank's reporter thread.

Values travel sealed in an ``Envelope``. To and from a controller on the same host, large ones
go over a shared-memory link (``transport/link.py``) and the Monarch message carries only the
frame's token; to and from one elsewhere, with the backend's ``rdma`` on, their buffers are lent as
Monarch RDMA buffers (``monarch_rdma.py``) and read by the receiver; the others ride inside
Monarch's own (pickled) messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import sys
import threading
import time
from typing import Any

from monarch.actor import Actor, endpoint

from spmdcall import serialize
from spmdcall.backends.monarch.logs import own_log_path
from spmdcall.backends.monarch.rdma import Lent, lend
from spmdcall.errors import format_user_traceback
from spmdcall.rendezvous import PortReservation
from spmdcall.runtime.calls import CallRunner, runs_on_event_loop
from spmdcall.runtime.reports import listen_for_reports
from spmdcall.transport import link as shm_link
from spmdcall.transport.envelope import Envelope
from spmdcall.transport.link import Link, Linked

# Values (arguments and results) of at least LINK_MIN_BYTES go over the shared-memory link when
# there is one, unless their pickle itself (what is not tensor or array bytes) is larger than
# LINK_MAX_PICKLE_BYTES: that part crosses the link's socket.
LINK_MIN_BYTES = 64 * 1024
LINK_MAX_PICKLE_BYTES = 64 * 1024
# Tensors and arrays from this size on travel out of band, so that over a link they go into
# shared memory rather than through its socket.
OUT_OF_BAND_MIN_BYTES = 4096
# A rank keeps the replies of its last KEPT_REPLIES calls cast to the mesh (those small enough: not
# a result's buffers), for the controller to read one before the mesh's slowest rank has answered.
KEPT_REPLIES = 8


def seal(value: Any) -> Envelope:
    return Envelope.seal(value, out_of_band_min_bytes=OUT_OF_BAND_MIN_BYTES)


def goes_linked(envelope: Envelope) -> bool:
    """Whether ``envelope`` goes over a shared-memory link, when there is one."""
    return envelope.nbytes >= LINK_MIN_BYTES and len(envelope.data) <= LINK_MAX_PICKLE_BYTES


def goes_lent(envelope: Envelope) -> bool:
    """Whether ``envelope``'s buffers are lent (RDMA) rather than sent, where there is no link."""
    return envelope.nbytes - len(envelope.data) >= LINK_MIN_BYTES


def node_ip() -> str:
    """An address of this host that other hosts can reach (the loopback one when there is none)."""
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


class RankActor(Actor):
    """The Monarch actor of one rank: builds the worker class in its SPMD environment, then runs
    calls (in the endpoint that delivers them, or, for a class with async methods, on a thread
    with an event loop) and answers each through the call's port.

    Replies are tuples: ``("ok", started_ns, finished_ns, envelope)``, ``("pickle", started_ns,
    finished_ns, data)`` (an envelope without buffers: its pickle), ``("linked", started_ns,
    finished_ns, token)``, ``("lent", started_ns, finished_ns, lent)`` (the controller then reads
    the buffers and calls ``release``), ``("error", traceback, exc_type)`` for a method that raised and
    ``("unpicklable", message)`` for a result that cannot be pickled."""

    def __init__(self) -> None:
        self._rank = -1
        self._runner: CallRunner | None = None
        self._link: Link | None = None
        self._rdma = False  # results lent as RDMA buffers (no link, and the group's rdma on)
        self._lent: dict[int, Lent] = {}  # results lent and not yet read, by key
        self._next_key = 0
        self._port: PortReservation | None = None
        self._loop = asyncio.new_event_loop()
        self._queue: asyncio.Queue[tuple[Any, int | None, tuple]] | None = None
        self._inline = False  # a class without async methods: calls run in the endpoint
        self._next_seq = 0  # the number of the next call to start
        self._early: dict[int, tuple[Any, int | None, tuple]] = {}  # calls that came before one sent earlier
        self._kept: dict[int, tuple] = {}  # the replies of the last calls cast to the mesh, by number
        self._order = threading.Lock()

    @endpoint
    def locate(self, rank: int, hosts_rendezvous: bool) -> dict[str, Any]:
        """Where this rank runs (and its Monarch log file, ``logs.py``); rank 0 also
        reserves the rendezvous port on its host for the actor's life (``rendezvous.py``)."""
        self._rank = rank
        if hosts_rendezvous:
            self._port = PortReservation("")
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "ip": node_ip(),
            "port": self._port.port if self._port is not None else 0,
            "monarch_log": own_log_path(),
        }

    @endpoint
    def setup(
        self, env: dict[str, str], sys_path: list[str], payload: bytes, link_address: str | None, rdma: bool
    ) -> tuple:
        """Build the worker class in the rank's environment; ``("ok", info)`` or ``("error",
        traceback, exc_type)`` when the constructor raised. With ``rdma``, a rank without a link
        lends its large results as RDMA buffers."""
        os.environ.update(env)  # first: the worker class reads its SPMD context when it is built
        sys.path[:0] = [p for p in sys_path if p not in sys.path and os.path.isdir(p)]
        if self._rank == 0 and self._port is None:  # restarted: hold the port the group uses
            with contextlib.suppress(OSError):
                self._port = PortReservation("", int(env["MASTER_PORT"]))
        try:
            cls_with_init = serialize.loads(payload)
            instance = cls_with_init()
        except BaseException as exc:
            return ("error", format_user_traceback(), type(exc).__name__)
        self._runner = CallRunner(instance)
        token = secrets.token_hex(16)
        # A reporter thread beside the calls answers "where are you" on a port of its own
        # (runtime/reports.py), even while a call blocks.
        host, port = listen_for_reports(node_ip(), self._runner.running, token)
        why_not = None
        if link_address is not None:
            try:
                self._link = shm_link.connect(link_address, self._rank)
            except OSError as exc:
                why_not = f"{type(exc).__name__}: {exc}"
        if rdma and self._link is None:
            self._rdma = True
            lend(Envelope(b"", [bytearray(1)])).drop()  # start Monarch's RDMA manager now
        if runs_on_event_loop(cls_with_init):
            self._queue = asyncio.Queue()  # binds to the call thread's loop when first used there
            threading.Thread(target=self._serve_forever, name="spmdcall-calls", daemon=True).start()
        else:
            self._inline = True
        return ("ok", {"reporter": (host, port, token), "link_error": why_not})

    @endpoint
    def release(self, key: int) -> None:
        """The controller has read the result lent as ``key``: give its buffers back."""
        lent = self._lent.pop(key, None)
        if lent is not None:
            lent.drop()

    @endpoint
    def num_lent(self) -> int:
        """How many results this rank has lent that the controller has not released."""
        return len(self._lent)

    @endpoint
    def kept(self, seq: int) -> tuple | None:
        """The reply of call ``seq``, cast to the mesh, if it has finished here and is kept: Monarch
        gathers a cast's replies, so the controller reads none before the slowest rank answers; past
        a deadline it asks each rank for its own (a rank still running a plain call answers later)."""
        return self._kept.get(seq)

    @endpoint(explicit_response_port=True)
    def run(self, port: Any, seq: int, call: tuple) -> None:
        """Start call ``seq`` of this rank, ``(role, method, args, kwargs)`` (``_arrived``); it
        answers on ``port``."""
        self._arrived(seq, port, call, cast=False)

    @endpoint(explicit_response_port=True)
    def cast(self, port: Any, seqs: tuple[int, ...], call: tuple) -> None:
        """As ``run``, for a call sent to every rank at once: ``seqs[rank]`` is its number here."""
        self._arrived(seqs[self._rank], port, call, cast=True)

    def _arrived(self, seq: int, port: Any, call: tuple, *, cast: bool) -> None:
        """Start the call numbered ``seq`` once every call numbered before it has started: queued
        for the call thread, or (a class without async methods) run here."""
        ready = []
        with self._order:
            self._early[seq] = (port, seq if cast else None, call)
            while self._next_seq in self._early:
                if self._inline:
                    ready.append(self._early.pop(self._next_seq))
                else:
                    assert self._queue is not None, "a call before setup()"
                    self._loop.call_soon_threadsafe(self._queue.put_nowait, self._early.pop(self._next_seq))
                self._next_seq += 1
        del port, call
        while ready:  # popped, so that nothing here holds a call's arguments once it has run
            port, kept_as, call = ready.pop(0)
            self._run(port, kept_as, *call)
            del port, call

    # -- running calls ---------------------------------------------------------------------

    def _serve_forever(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        """Start each call in the order it came; an ``async def`` one runs as a task, which runs
        to its first ``await`` before the next call starts."""
        assert self._runner is not None and self._queue is not None
        tasks: set[asyncio.Task] = set()
        while True:
            port, kept_as, call = await self._queue.get()
            if not self._runner.is_async(call[0], call[1]):
                self._run(port, kept_as, *call)
                continue
            task = asyncio.ensure_future(self._run_async(port, kept_as, *call))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            del call
            await asyncio.sleep(0)

    def _run(
        self, port: Any, kept_as: int | None, role: str | None, method: str, args: tuple, kwargs: dict
    ) -> None:
        """Run a plain method and answer on ``port`` (a cast call's reply kept as ``kept_as``)."""
        assert self._runner is not None
        opened = self._opened(port, args, kwargs)
        if opened is None:
            return
        args, kwargs = opened
        del opened
        started = time.time_ns()
        try:
            box = [self._runner.run(role, method, args, kwargs)]
        except BaseException as exc:  # the traceback starts at the user's method
            self._answer(port, ("error", format_user_traceback(2), type(exc).__name__), kept_as)
            return
        del args, kwargs  # a result that is a view of an argument may go back by reference
        self._reply(port, method, box, started, time.time_ns(), kept_as)

    async def _run_async(
        self, port: Any, kept_as: int | None, role: str | None, method: str, args: tuple, kwargs: dict
    ) -> None:
        assert self._runner is not None
        opened = self._opened(port, args, kwargs)
        if opened is None:
            return
        args, kwargs = opened
        del opened
        started = time.time_ns()
        try:
            box = [await self._runner.run_async(role, method, args, kwargs)]
        except BaseException as exc:
            self._answer(port, ("error", format_user_traceback(2), type(exc).__name__), kept_as)
            return
        del args, kwargs
        self._reply(port, method, box, started, time.time_ns(), kept_as)

    def _opened(self, port: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The values of a call's arguments; None (the error answered on ``port``) if one
        cannot be opened."""
        try:
            return tuple(self._open(a) for a in args), {k: self._open(v) for k, v in kwargs.items()}
        except BaseException as exc:
            port.send(("error", format_user_traceback(0), type(exc).__name__))
            return None

    def _open(self, value: Any) -> Any:
        if isinstance(value, Envelope):
            return value.open()
        if isinstance(value, Linked):
            if self._link is None:
                raise RuntimeError(f"rank {self._rank} was sent a linked value but has no link")
            data, buffers = self._link.take(value.token, drop_older=True)
            return serialize.loads(data, buffers)
        if isinstance(value, Lent):
            return value.fetch().open()
        return value

    def _reply(
        self, port: Any, method: str, box: list[Any], started: int, finished: int, kept_as: int | None
    ) -> None:
        """Answer with the one item of ``box`` (taken out, so that once its frame is encoded
        nothing here holds it: a view of a received segment then goes back by reference)."""
        try:
            envelope = seal(box.pop())
        except Exception as exc:
            message = f"the result of {method}() on rank {self._rank} cannot be pickled: {type(exc).__name__}: {exc}"
            self._answer(port, ("unpicklable", message), kept_as)
            return
        if self._rdma and goes_lent(envelope):
            key, self._next_key = self._next_key, self._next_key + 1
            self._lent[key] = lent = lend(envelope, key)
            del envelope
            self._answer(port, ("lent", started, finished, lent), kept_as)
            return
        link = self._link
        if (
            link is not None
            and goes_linked(envelope)
            and link.has_room(len(envelope.data), len(envelope.buffers))
        ):
            link.drain()  # the controller's frames say which of our segments are free again
            frame = link.channel.encode_pickled_reply(envelope.data, envelope.buffers)
            del envelope
            try:
                token = link.send(frame)  # only this thread writes to the link: the room is there
            finally:
                frame.discard()
            if token is None:
                raise RuntimeError(f"rank {self._rank}: the link to the controller filled up while replying")
            self._answer(port, ("linked", started, finished, token), kept_as)
            return
        if link is not None:
            link.flush()  # tell the controller which of its segments are free
        if not envelope.buffers:  # the pickle alone: Monarch sends bytes faster than an Envelope
            self._answer(port, ("pickle", started, finished, envelope.data), kept_as)
            return
        port.send(("ok", started, finished, envelope))  # not kept: it holds the result's buffers

    def _answer(self, port: Any, reply: tuple, kept_as: int | None) -> None:
        """Send ``reply`` on ``port``; a cast call's reply is kept too, as ``kept_as`` (``kept``),
        unless it lends buffers (which the controller's read gives back)."""
        if kept_as is not None and reply[0] != "lent":
            self._kept[kept_as] = reply
            while len(self._kept) > KEPT_REPLIES:  # only this rank's calls write here
                del self._kept[next(iter(self._kept))]
        port.send(reply)
