"""What runs inside a ``ray`` backend worker: the actor of one rank, and how its replies are packed.

Values travel sealed in an ``Envelope`` (``transport/envelope.py``); Ray's protocol-5 pickler
stores their tensor and array bytes out-of-band, as they are, in the object store. Opening an
envelope copies each buffer out of the object store once (object-store memory is shared and
immutable), so a method always receives tensors it may modify.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import pickle
import secrets
import socket
import struct
import sys
import time
from typing import Any, cast

import ray

from spmdcall import serialize
from spmdcall.errors import WorkerError, format_user_traceback
from spmdcall.rendezvous import PortReservation
from spmdcall.runtime.calls import CallRunner
from spmdcall.runtime.reports import listen_for_reports
from spmdcall.transport import link as ray_link
from spmdcall.transport.envelope import Envelope
from spmdcall.transport.link import Link, Linked

# Values (arguments and results) at least this large go over the shared-memory link when there is
# one; smaller ones ride inside the task or its reply. Values whose pickle itself (what is not
# tensor or array bytes: a dict of many tiny tensors, lists of strings) is larger than
# LINK_MAX_PICKLE_BYTES go through the object store: the pickle crosses the link's socket.
LINK_MIN_BYTES = 64 * 1024
LINK_MAX_PICKLE_BYTES = 64 * 1024
# Tensors and arrays from this size on travel out-of-band (a DataProto's small columns too), so
# that over a link they go into shared memory rather than through its socket.
_OUT_OF_BAND_MIN_BYTES = 4096


def goes_linked(envelope: Envelope) -> bool:
    """Whether ``envelope`` goes over a shared-memory link, when there is one."""
    return envelope.nbytes >= LINK_MIN_BYTES and len(envelope.data) <= LINK_MAX_PICKLE_BYTES


class ResultNotPicklable(TypeError):
    """A method's result cannot be pickled; the controller raises it as a plain TypeError."""


def seal(value: Any) -> Envelope:
    """A value sealed for Ray: its tensors and arrays out of band (into the object store as they
    are), from 4 KiB on, so that over a link they go into shared memory, not through its socket."""
    return Envelope.seal(value, out_of_band_min_bytes=_OUT_OF_BAND_MIN_BYTES)


# A reply without out-of-band buffers is one bytes object: this header, then the pickle (or the
# token of a linked reply). Ray returns bytes as they are; a tuple of the same fields it pickles,
# which makes a no-op call measurably slower than a plain Ray actor's (docs/benchmarks-log.md).
_REPLY_HEADER = struct.Struct("<qqB")  # started_ns, finished_ns, flags
_LINKED = 1
_TOKEN = struct.Struct("<q")
# Larger pickles go in a tuple instead, so they are not copied once more to make the bytes.
_BYTES_REPLY_MAX = 64 * 1024
# Arguments packed together stay below what Ray sends inside a task (100 KiB by default) rather
# than putting in its object store.
_PACKED_MAX_BYTES = 64 * 1024


def pack_reply(envelope: Envelope, started_ns: int, finished_ns: int) -> bytes | tuple:
    """What one call returns, as a single Ray object: the worker-side start and end of the call
    (``time.time_ns()``) and the result's envelope, in bytes or a plain tuple. One return object,
    not a second one for the times, and no class of ours to pickle: Ray's cost per return object
    (as per task argument, see :func:`actor_class`) and for pickling are a good part of a no-op call."""
    if not envelope.buffers and len(envelope.data) <= _BYTES_REPLY_MAX:
        return _REPLY_HEADER.pack(started_ns, finished_ns, 0) + envelope.data
    buffers = map(pickle.PickleBuffer, envelope.buffers)
    return (started_ns, finished_ns, envelope.data, *buffers)


def pack_linked_reply(token: int, started_ns: int, finished_ns: int) -> bytes:
    """A reply whose result went over the shared-memory link as frame ``token``."""
    return _REPLY_HEADER.pack(started_ns, finished_ns, _LINKED) + _TOKEN.pack(token)


def is_linked(reply: bytes | tuple) -> bool:
    return isinstance(reply, bytes) and bool(reply[_REPLY_HEADER.size - 1] & _LINKED)


def unpack_reply(reply: bytes | tuple) -> tuple[Envelope, int, int]:
    """The sealed envelope and the start and end times in a reply that went through Ray."""
    if isinstance(reply, bytes):
        started_ns, finished_ns, flags = _REPLY_HEADER.unpack_from(reply)
        if flags & _LINKED:
            raise RuntimeError("a result sent over a shared-memory link was handed to another actor")
        return Envelope(reply[_REPLY_HEADER.size :], []), started_ns, finished_ns
    started_ns, finished_ns, data, *buffers = reply
    return Envelope(data, buffers), started_ns, finished_ns


def pack_call(seq: int | None, args: list[Any], kwargs: dict[str, Any]) -> bytes | None:
    """The arguments of a call as the one ``bytes`` argument of its actor method, or None where one
    of them cannot travel that way (a value with out-of-band buffers, stored with ``ray.put``, sent
    over a link, or an ObjectRef for Ray to resolve). ``seq`` is the call's turn on an async actor.

    Ray serialises a ``bytes`` argument without pickling it, and charges a fixed cost per task
    argument (an envelope object, the turn): one ``bytes`` makes such a call cost what a plain Ray
    call with one small argument does (the figures: docs/benchmarks-log.md)."""
    values = (*args, *kwargs.values())
    if not all(type(v) is Envelope and not v.buffers for v in values):
        return None
    if sum(len(v.data) for v in values) > _PACKED_MAX_BYTES:  # each stays small enough to go inline
        return None
    return pickle.dumps((seq, [a.data for a in args], {k: v.data for k, v in kwargs.items()}), protocol=5)


def unpack_call(packed: bytes) -> tuple[int | None, tuple[Envelope, ...], dict[str, Envelope]]:
    """:func:`pack_call`'s ``(seq, args, kwargs)``, the arguments sealed as they were sent."""
    seq, args, kwargs = pickle.loads(packed)
    return seq, tuple(Envelope(d, []) for d in args), {k: Envelope(d, []) for k, d in kwargs.items()}


def unpack_linked_reply(reply: bytes, link: Link) -> tuple[Envelope, int, int]:
    """The envelope of a linked reply, its buffers views of shared memory (writable: no copy)."""
    started_ns, finished_ns, _ = _REPLY_HEADER.unpack_from(reply)
    (token,) = _TOKEN.unpack_from(reply, _REPLY_HEADER.size)
    return link.take_sealed(token), started_ns, finished_ns


# -- the actor behind one rank -------------------------------------------------------------------


class _RankActor:
    """The Ray actor of one rank: builds the worker class in its SPMD environment, then runs calls."""

    def __init__(self, rank: int):
        self._rank = rank
        self._instance: Any = None
        self._runner: CallRunner | None = None
        self._group: dict[str, Any] | None = None
        self._link: Link | None = None
        self._next_seq = 0
        self._turns: dict[int, asyncio.Future] = {}
        self._port: PortReservation | None = None

    def locate(self, hosts_rendezvous: bool) -> dict[str, Any]:
        """Where this actor runs: node IP, the GPUs Ray gave it and, for rank 0, the port of the
        torch.distributed rendezvous, reserved on its node for the actor's life (rendezvous.py)."""
        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        if hosts_rendezvous:
            self._port = PortReservation("")
        return {
            "ip": ray.util.get_node_ip_address(),
            "port": self._port.port if self._port is not None else 0,
            "gpus": [str(g) for g in gpus],
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def setup(self, env: dict[str, str], sys_path: list[str], payload: bytes) -> dict[str, Any]:
        # The environment first: the worker class reads its SPMD context when it is built.
        os.environ.update(env)
        sys.path[:0] = [p for p in sys_path if p not in sys.path and os.path.isdir(p)]
        if self._rank == 0 and self._port is None:  # restarted: hold the port the group already uses
            with contextlib.suppress(OSError):
                self._port = PortReservation("", int(env["MASTER_PORT"]))
        try:
            self._instance = serialize.loads(payload)()
        except BaseException as exc:
            raise WorkerError(self._rank, "__init__", format_user_traceback(), type(exc).__name__) from None
        self._runner = CallRunner(self._instance)
        ctx = ray.get_runtime_context()
        # A reporter thread beside the calls answers "where are you" on a port of its own
        # (runtime/reports.py): an actor method would wait behind the call it should describe.
        token = secrets.token_hex(16)
        host, port = listen_for_reports(ray.util.get_node_ip_address(), self._runner.running, token)
        return {
            "reporter": (host, port, token),
            "rank": self._rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "actor_id": ctx.get_actor_id(),
        }

    def remember_group(self, group: dict[str, Any]) -> None:
        """Keep what another controller needs to attach to this (detached) group."""
        self._group = group

    def describe_group(self) -> dict[str, Any] | None:
        return self._group

    def ping(self) -> bool:
        return True

    def renumber(self, rank: int) -> None:
        """This actor's rank after a resize of its group (the worker learns it from the group's own call)."""
        self._rank = rank

    def next_turn(self) -> int:
        """The number the next call must carry (an async actor's; see :class:`_AsyncRankActor`)."""
        return self._next_seq

    def link(self, address: str) -> str | None:
        """Connect the shared-memory link to the controller (on this node); why not, or None."""
        try:
            self._link = ray_link.connect(address, self._rank)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def call(self, target: tuple[str | None, str, tuple], *args: Any, **kwargs: Any) -> bytes | tuple:
        """Run ``(role, method, replies)``: the general path, for a role of a colocated worker, a
        method without an actor method of its own (see :func:`actor_class`), or arguments that are
        other calls' replies (handed rank to rank; ``replies`` names their positions and keywords)."""
        role, method, replies = target
        if replies:
            args = tuple(unpack_reply(a)[0] if i in replies else a for i, a in enumerate(args))
            kwargs = {k: unpack_reply(v)[0] if k in replies else v for k, v in kwargs.items()}
        return self._run(role, method, args, kwargs)

    def _open(self, value: Any) -> Any:
        # Arguments arrive as envelopes (sent inline or stored with ray.put and fetched by Ray), or
        # as tokens of frames on the shared-memory link.
        if isinstance(value, Envelope):
            return value.open()
        if isinstance(value, Linked):
            if self._link is None:
                raise RuntimeError(f"rank {self._rank} was sent a linked value but has no link")
            data, buffers = self._link.take(value.token, drop_older=True)
            return serialize.loads(data, buffers)
        return value

    def call_plain(self, target: tuple[str | None, str, tuple], *args: Any, **kwargs: Any) -> Any:
        """As :meth:`call`, but the result is returned as it is (Ray stores it): the ObjectRef of
        this call is then what Ray code expects from an actor call (``RayBackend.submit_refs``)."""
        role, method, replies = target
        if replies:
            args = tuple(unpack_reply(a)[0] if i in replies else a for i, a in enumerate(args))
            kwargs = {k: unpack_reply(v)[0] if k in replies else v for k, v in kwargs.items()}
        return self._invoke(role, method, args, kwargs)[0]

    def _run(self, role: str | None, method: str, args: tuple, kwargs: dict[str, Any]) -> bytes | tuple:
        """Run one call; a large result goes back over the link when there is one (``transport/link.py``)."""
        result, started, finished = self._invoke(role, method, args, kwargs)
        # The opened arguments went with _invoke's frame: what still uses their shared memory is
        # the result (and whatever the worker kept), which _reply takes out of the box.
        box = [result]
        del result
        return self._reply(method, box, started, finished)

    def _invoke(
        self, role: str | None, method: str, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[Any, int, int]:
        """The method's result (arguments opened first) and its start and end; a worker's
        exception raises as a WorkerError."""
        args = tuple(self._open(a) for a in args)
        kwargs = {k: self._open(v) for k, v in kwargs.items()}
        started = time.time_ns()
        assert self._runner is not None
        try:
            result = self._runner.run(role, method, args, kwargs)
        except BaseException as exc:  # the traceback starts below this frame and CallRunner.run's
            raise WorkerError(self._rank, method, format_user_traceback(2), type(exc).__name__) from None
        return result, started, time.time_ns()

    def _seal(self, method: str, result: Any) -> Envelope:
        try:
            return seal(result)
        except Exception as exc:
            raise ResultNotPicklable(
                f"the result of {method}() on rank {self._rank} cannot be pickled: {type(exc).__name__}: {exc}"
            ) from None

    def _reply(self, method: str, box: list[Any], started: int, finished: int) -> bytes | tuple:
        """The reply of a call whose result is the one item of ``box``. _reply takes it out, so that
        once the frame is encoded nothing holds it: a result that is (a view of) an argument's
        shared memory then goes back by reference instead of being copied (``Channel._settle``)."""
        envelope = self._seal(method, box.pop())
        link = self._link
        if link is None:
            return pack_reply(envelope, started, finished)
        if not (goes_linked(envelope) and link.has_room(len(envelope.data), len(envelope.buffers))):
            link.flush()  # tell the controller which of its segments are free
            return pack_reply(envelope, started, finished)
        link.drain()  # the controller's frames say which of our segments are free again
        frame = link.channel.encode_pickled_reply(envelope.data, envelope.buffers)
        # The frame keeps only where the bytes are: with the envelope gone, views of a received
        # segment that nothing else here uses go back by reference.
        del envelope
        try:
            token = link.send(frame)  # only this thread writes to the link: the room is still there
        finally:
            frame.discard()
        if token is None:
            raise RuntimeError(f"rank {self._rank}: the link to the controller filled up while replying")
        return pack_linked_reply(token, started, finished)


class _AsyncRankActor(_RankActor):
    """The rank actor of a worker class with ``async def`` methods: Ray makes it an async actor
    (any coroutine method does; so the plain :class:`_RankActor` has none).

    Every call carries its number in the order the controller made them (``seq``), and starts only
    when the calls before it have started, so plain methods still run in order and async ones
    start in order (Ray itself does not order an async actor's calls). Outputs of other calls that
    are its arguments travel inside a list, so Ray does not hold the call back until they exist:
    the actor awaits them in the call's turn, and a producer's failure fails this call only.
    """

    async def call(  # type: ignore[override]
        self, target: tuple[int, str | None, str, tuple], *args: Any, **kwargs: Any
    ) -> bytes | tuple:
        """:meth:`_RankActor.call` for an async actor: ``(seq, role, method, replies)``; each reply
        comes as a one-element list holding its ObjectRef."""
        seq, role, method, replies = target
        return await self._run_in_turn(seq, role, method, args, kwargs, replies)

    async def call_plain(  # type: ignore[override]
        self, target: tuple[int, str | None, str, tuple], *args: Any, **kwargs: Any
    ) -> Any:
        """:meth:`_RankActor.call_plain` for an async actor, in its turn as :meth:`call`."""
        seq, role, method, replies = target
        return await self._run_in_turn(seq, role, method, args, kwargs, replies, plain=True)

    async def _run_in_turn(
        self,
        seq: int,
        role: str | None,
        method: str,
        args: tuple,
        kwargs: dict[str, Any],
        replies: tuple = (),
        plain: bool = False,
    ) -> Any:
        """Run one call of an async actor once the calls made before it have started; its reply
        (its result as it is, with ``plain``)."""
        assert self._runner is not None
        if seq != self._next_seq:
            turn = self._turns[seq] = asyncio.get_running_loop().create_future()
            await turn
        try:
            if replies:
                args = tuple([await _output(a[0]) if i in replies else a for i, a in enumerate(args)])
                kwargs = {k: await _output(v[0]) if k in replies else v for k, v in kwargs.items()}
            if not self._runner.is_async(role, method):
                if plain:
                    return self._invoke(role, method, args, kwargs)[0]
                return self._run(role, method, args, kwargs)
            args = tuple(self._open(a) for a in args)
            kwargs = {k: self._open(v) for k, v in kwargs.items()}
            started = time.time_ns()
            task = asyncio.ensure_future(self._runner.run_async(role, method, args, kwargs))
            del args, kwargs
            await asyncio.sleep(0)  # it starts before the next call does
        finally:
            self._next_seq = seq + 1
            following = self._turns.pop(self._next_seq, None)
            if following is not None:
                following.set_result(None)
        try:
            box = [await task]
        except BaseException as exc:
            raise WorkerError(self._rank, method, format_user_traceback(2), type(exc).__name__) from None
        del task  # it holds the result too
        if plain:
            return box.pop()
        return self._reply(method, box, started, time.time_ns())


async def _output(ref: Any) -> Envelope:
    """The sealed output of another call (an argument handed on rank to rank)."""
    return unpack_reply(await ref)[0]


# The actor method that runs worker method ``name`` without a role.
def actor_method_name(name: str) -> str:
    return f"call_{name}"


@functools.cache
def actor_class(method_names: tuple[str, ...], on_event_loop: bool = False) -> Any:
    """The Ray actor class for a worker class whose public methods are ``method_names``: the rank
    actor plus one actor method per worker method, so that a call sends its own arguments and
    nothing else. (Ray's cost per task argument is about that of a whole no-op call, so a generic
    ``call(method, ...)`` would make every call cost about one and a half; docs/benchmarks-log.md.)
    Small arguments come packed in one ``bytes`` (:func:`pack_call`), others as they are. With
    ``on_event_loop`` the methods are async (the worker class has async methods) and take the
    call's number first, inside the ``bytes`` or as an int before the arguments."""
    forward = _forward_in_turn if on_event_loop else _forward
    namespace = {actor_method_name(name): forward(name) for name in method_names}
    base = _AsyncRankActor if on_event_loop else _RankActor
    return ray.remote(type("RankActor", (base,), namespace))


def _forward(name: str) -> Any:
    def forward(self: _RankActor, *args: Any, **kwargs: Any) -> bytes | tuple:
        # Packed; sent as they are, arguments are never bytes (envelopes, link tokens, the
        # ObjectRefs of stored envelopes: RayBackend._send sends the caller's own refs elsewhere).
        if args and type(args[0]) is bytes:
            _, args, kwargs = unpack_call(args[0])
        return self._run(None, name, args, kwargs)

    forward.__name__ = forward.__qualname__ = actor_method_name(name)
    return forward


def _forward_in_turn(name: str) -> Any:
    async def forward(self: _AsyncRankActor, first: bytes | int, *args: Any, **kwargs: Any) -> bytes | tuple:
        if type(first) is bytes:
            packed_seq, args, kwargs = unpack_call(first)
            seq = cast(int, packed_seq)  # RayBackend packs an async actor's calls with their turn
        else:
            seq = cast(int, first)
        return await self._run_in_turn(seq, None, name, args, kwargs)

    forward.__name__ = forward.__qualname__ = actor_method_name(name)
    return forward
