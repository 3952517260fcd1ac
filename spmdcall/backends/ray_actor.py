"""What runs inside a ``ray`` backend worker: the actor of one rank, and the envelope values travel in.

Values are pickled by ``spmdcall.serialize`` inside an :class:`Envelope`; Ray's protocol-5
pickler then stores the tensor and array bytes out-of-band, as they are, in the object store.
Opening an envelope copies each buffer out of the object store once (object-store memory is
shared and immutable), so a method always receives tensors it may modify.
"""

from __future__ import annotations

import functools
import os
import pickle
import socket
import struct
import sys
import time
from typing import Any

import numpy as np
import ray

from spmdcall import serialize
from spmdcall.backends import ray_link
from spmdcall.backends.ray_link import Link, Linked
from spmdcall.errors import WorkerError, format_user_traceback

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


# -- values on the wire --------------------------------------------------------------------------


class ResultNotPicklable(TypeError):
    """A method's result cannot be pickled; the controller raises it as a plain TypeError."""


class Envelope:
    """A value pickled by ``spmdcall.serialize``; Ray stores its tensor and array bytes out-of-band.

    An envelope stays sealed in transit: it arrives as an Envelope whose buffers are read-only views
    of the object store, and :meth:`open` makes the value. A DataProto travels as its state
    (``DataProto.__getstate__``) so that the controller can also join several results straight from
    the object store (:meth:`data_proto_state`).
    """

    __slots__ = ("data", "buffers", "is_data_proto")

    def __init__(self, value: Any):
        data_module = sys.modules.get("spmdcall.data")  # loaded if value can be a DataProto at all
        self.is_data_proto = data_module is not None and type(value) is data_module.DataProto
        self.data, self.buffers = serialize.dumps(
            value.__getstate__() if self.is_data_proto else value,
            out_of_band_min_bytes=_OUT_OF_BAND_MIN_BYTES,
        )

    @property
    def nbytes(self) -> int:
        return len(self.data) + sum(b.nbytes for b in self.buffers)

    def __reduce__(self) -> tuple:
        # PickleBuffers make Ray's protocol-5 pickler put each buffer in the object store as is.
        return _sealed, (self.is_data_proto, self.data, *map(pickle.PickleBuffer, self.buffers))

    def open(self) -> Any:
        """The value. Each buffer is copied out of the (shared, read-only) object store once, with
        numpy's allocator (huge pages for large copies), so the tensors are writable."""
        value = serialize.loads(self.data, [_writable(b) for b in self.buffers])
        return _data_proto(value) if self.is_data_proto else value

    def data_proto_state(self) -> dict[str, Any] | None:
        """For a DataProto, its state with the column arrays left as read-only views of the object
        store (no copy), for a concatenation that copies them anyway; None for any other value, or
        when something outside the columns (meta_info) would be read-only too."""
        if not self.is_data_proto:
            return None
        state = serialize.loads(self.data, self.buffers)
        arrays = [column[1] for column in state["batch"]["columns"]] if state["batch"] else []
        arrays += list(state["non_tensor_batch"].values())
        read_only = sum(isinstance(a, np.ndarray) and not a.flags.writeable for a in arrays)
        return state if read_only == len(self.buffers) else None


def _sealed(is_data_proto: bool, data: bytes, *buffers: Any) -> Envelope:
    envelope = Envelope.__new__(Envelope)
    envelope.is_data_proto, envelope.data, envelope.buffers = is_data_proto, data, list(buffers)
    return envelope


def _data_proto(state: dict[str, Any]) -> Any:
    from spmdcall.data import DataProto

    value = DataProto.__new__(DataProto)
    value.__setstate__(state)
    return value


def _writable(buffer: Any) -> Any:
    view = memoryview(buffer)
    return view if not view.readonly else np.frombuffer(view, dtype=np.uint8).copy()


# A reply without out-of-band buffers is one bytes object: this header, then the pickle (or the
# token of a linked reply). Ray returns bytes as they are; a tuple of the same fields it pickles,
# which made a no-op call ~8% slower than a plain Ray actor's returning None (measured; bytes: none).
_REPLY_HEADER = struct.Struct("<qqB")  # started_ns, finished_ns, flags
_DATA_PROTO, _LINKED = 1, 2
_TOKEN = struct.Struct("<q")
# Larger pickles go in a tuple instead, so they are not copied once more to make the bytes.
_BYTES_REPLY_MAX = 64 * 1024


def pack_reply(envelope: Envelope, started_ns: int, finished_ns: int) -> bytes | tuple:
    """What one call returns, as a single Ray object: the worker-side start and end of the call
    (``time.time_ns()``) and the result's envelope, in bytes or a plain tuple. One return object,
    not a second one for the times, and no class of ours to pickle: Ray's cost per return object
    (as per task argument, see :func:`actor_class`) and for pickling are a good part of a no-op call."""
    if not envelope.buffers and len(envelope.data) <= _BYTES_REPLY_MAX:
        flags = _DATA_PROTO if envelope.is_data_proto else 0
        return _REPLY_HEADER.pack(started_ns, finished_ns, flags) + envelope.data
    buffers = map(pickle.PickleBuffer, envelope.buffers)
    return (started_ns, finished_ns, envelope.is_data_proto, envelope.data, *buffers)


def pack_linked_reply(token: int, is_data_proto: bool, started_ns: int, finished_ns: int) -> bytes:
    """A reply whose result went over the shared-memory link as frame ``token``."""
    flags = _LINKED | (_DATA_PROTO if is_data_proto else 0)
    return _REPLY_HEADER.pack(started_ns, finished_ns, flags) + _TOKEN.pack(token)


def is_linked(reply: bytes | tuple) -> bool:
    return isinstance(reply, bytes) and bool(reply[_REPLY_HEADER.size - 1] & _LINKED)


def unpack_reply(reply: bytes | tuple) -> tuple[Envelope, int, int]:
    """The sealed envelope and the start and end times in a reply that went through Ray."""
    if isinstance(reply, bytes):
        started_ns, finished_ns, flags = _REPLY_HEADER.unpack_from(reply)
        if flags & _LINKED:
            raise RuntimeError("a result sent over a shared-memory link was handed to another actor")
        return _sealed(bool(flags & _DATA_PROTO), reply[_REPLY_HEADER.size :]), started_ns, finished_ns
    started_ns, finished_ns, is_data_proto, data, *buffers = reply
    return _sealed(is_data_proto, data, *buffers), started_ns, finished_ns


def unpack_linked_reply(reply: bytes, link: Link) -> tuple[Envelope, int, int]:
    """The envelope of a linked reply, its buffers views of shared memory (writable: no copy)."""
    started_ns, finished_ns, flags = _REPLY_HEADER.unpack_from(reply)
    (token,) = _TOKEN.unpack_from(reply, _REPLY_HEADER.size)
    data, buffers = link.take(token)
    return _sealed(bool(flags & _DATA_PROTO), bytes(data), *buffers), started_ns, finished_ns


# -- the actor behind one rank -------------------------------------------------------------------


class _RankActor:
    """The Ray actor of one rank: builds the worker class in its SPMD environment, then runs calls."""

    def __init__(self, rank: int):
        self._rank = rank
        self._instance: Any = None
        self._group: dict[str, Any] | None = None
        self._link: Link | None = None

    def locate(self) -> dict[str, Any]:
        """Where this actor runs: node IP, a free port there (rank 0's hosts the torch.distributed
        rendezvous) and the GPUs Ray gave it."""
        from spmdcall.backends.process import free_port

        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        return {
            "ip": ray.util.get_node_ip_address(),
            "port": free_port(""),
            "gpus": [str(g) for g in gpus],
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def setup(self, env: dict[str, str], sys_path: list[str], payload: bytes) -> dict[str, Any]:
        # The environment first: the worker class reads its SPMD context when it is built.
        os.environ.update(env)
        sys.path[:0] = [p for p in sys_path if p not in sys.path and os.path.isdir(p)]
        try:
            self._instance = serialize.loads(payload)()
        except BaseException as exc:
            raise WorkerError(self._rank, "__init__", format_user_traceback(), type(exc).__name__) from None
        ctx = ray.get_runtime_context()
        return {
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

    def call_plain(self, target: tuple[str | None, str, tuple], *args: Any, **kwargs: Any) -> Any:
        """As :meth:`call`, but the result is returned as it is (Ray stores it): the ObjectRef of
        this call is then what Ray code expects from an actor call (``RayBackend.submit_for_refs``)."""
        role, method, replies = target
        if replies:
            args = tuple(unpack_reply(a)[0] if i in replies else a for i, a in enumerate(args))
            kwargs = {k: unpack_reply(v)[0] if k in replies else v for k, v in kwargs.items()}
        result, _, _ = self._invoke(role, method, args, kwargs)
        return result

    def _open(self, value: Any) -> Any:
        # Arguments arrive as envelopes (sent inline or stored with ray.put and fetched by Ray), or
        # as tokens of frames on the shared-memory link.
        if isinstance(value, Envelope):
            return value.open()
        if isinstance(value, Linked):
            if self._link is None:
                raise RuntimeError(f"rank {self._rank} was sent a linked value but has no link")
            data, buffers = self._link.take(value.token, drop_older=True)
            opened = serialize.loads(data, buffers)
            return _data_proto(opened) if value.is_data_proto else opened
        return value

    def _run(self, role: str | None, method: str, args: tuple, kwargs: dict[str, Any]) -> bytes | tuple:
        """Run one call; a large result goes back over the link when there is one (``ray_link.py``)."""
        envelope, started, finished = self._call(role, method, args, kwargs)
        # The opened arguments are gone with _call's frame: what still uses their shared memory is
        # the result (and whatever the worker kept).
        link = self._link
        if link is None:
            return pack_reply(envelope, started, finished)
        if not (goes_linked(envelope) and link.has_room(len(envelope.data), len(envelope.buffers))):
            link.flush()  # tell the controller which of its segments are free
            return pack_reply(envelope, started, finished)
        link.drain()  # the controller's frames say which of our segments are free again
        frame = link.channel.encode_pickled_reply(envelope.data, envelope.buffers)
        is_data_proto = envelope.is_data_proto
        # The frame keeps only where the bytes are: with the envelope gone, views of a received
        # segment that nothing else here uses go back by reference.
        del envelope
        try:
            token = link.send(frame)  # only this thread writes to the link: the room is still there
        finally:
            frame.discard()
        if token is None:
            raise RuntimeError(f"rank {self._rank}: the link to the controller filled up while replying")
        return pack_linked_reply(token, is_data_proto, started, finished)

    def _call(
        self, role: str | None, method: str, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[Envelope, int, int]:
        """The result's envelope and the start and end of the method."""
        result, started, finished = self._invoke(role, method, args, kwargs)
        try:
            return Envelope(result), started, finished
        except Exception as exc:
            raise ResultNotPicklable(
                f"the result of {method}() on rank {self._rank} cannot be pickled: "
                f"{type(exc).__name__}: {exc}"
            ) from None

    def _invoke(
        self, role: str | None, method: str, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[Any, int, int]:
        """The method's result (arguments opened first) and its start and end; a worker's
        exception raises as a WorkerError."""
        args = tuple(self._open(a) for a in args)
        kwargs = {k: self._open(v) for k, v in kwargs.items()}
        started = time.time_ns()
        try:
            target = self._instance if role is None else self._instance.role(role)
            result = getattr(target, method)(*args, **kwargs)
        except BaseException as exc:
            raise WorkerError(self._rank, method, format_user_traceback(), type(exc).__name__) from None
        return result, started, time.time_ns()


# The actor method that runs worker method ``name`` without a role.
def actor_method_name(name: str) -> str:
    return f"call_{name}"


@functools.cache
def actor_class(method_names: tuple[str, ...]) -> Any:
    """The Ray actor class for a worker class whose public methods are ``method_names``: the rank
    actor plus one actor method per worker method, so that a call sends its own arguments and
    nothing else. (Ray's cost per task argument is about that of a whole no-op call: a generic
    ``call(method, ...)`` makes a no-op call 1.5x slower than a plain Ray actor's.)"""
    namespace = {actor_method_name(name): _forward(name) for name in method_names}
    return ray.remote(type("RankActor", (_RankActor,), namespace))


def _forward(name: str) -> Any:
    def forward(self: _RankActor, *args: Any, **kwargs: Any) -> bytes | tuple:
        return self._run(None, name, args, kwargs)

    forward.__name__ = forward.__qualname__ = actor_method_name(name)
    return forward
