"""What runs inside a ``ray`` backend worker: the actor of one rank, and the envelope values travel in.

Values are pickled by ``spmdcall.serialize`` inside an :class:`Envelope`; Ray's protocol-5
pickler then stores the tensor and array bytes out-of-band, as they are, in the object store.
Opening an envelope copies each buffer out of the object store once (object-store memory is
shared and immutable), so a method always receives tensors it may modify.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
from typing import Any

import cloudpickle
import numpy as np
import ray

from spmdcall import serialize
from spmdcall.errors import WorkerError, format_user_traceback

# -- values on the wire --------------------------------------------------------------------------


class ResultNotPicklable(TypeError):
    """A method's result cannot be pickled; the controller raises it as a plain TypeError."""


class Envelope:
    """A value pickled by ``spmdcall.serialize``; Ray stores its tensor and array bytes out-of-band."""

    __slots__ = ("data", "buffers")

    def __init__(self, value: Any):
        self.data, self.buffers = serialize.dumps(value)

    @property
    def nbytes(self) -> int:
        return len(self.data) + sum(b.nbytes for b in self.buffers)

    def __reduce__(self) -> tuple:
        # PickleBuffers make Ray's protocol-5 pickler put each buffer in the object store as is.
        return _open, (self.data, *map(pickle.PickleBuffer, self.buffers))


def _open(data: bytes, *buffers: Any) -> Any:
    """The value of an envelope. Each buffer is copied out of the (shared, read-only) object store
    once, with numpy's allocator (huge pages for large copies), so the tensors are writable."""
    return serialize.loads(data, [_writable(b) for b in buffers])


def _writable(buffer: Any) -> Any:
    view = memoryview(buffer)
    return view if not view.readonly else np.frombuffer(view, dtype=np.uint8).copy()


# -- the actor behind one rank -------------------------------------------------------------------


class _RankActor:
    """The Ray actor of one rank: builds the worker class in its SPMD environment, then runs calls."""

    def __init__(self, rank: int):
        self._rank = rank
        self._instance: Any = None
        self._group: dict[str, Any] | None = None

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
            self._instance = cloudpickle.loads(payload)()
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

    @ray.method(num_returns=2)
    def call(
        self, role: str | None, method: str, num_args: int, kw_names: tuple, *values: Any
    ) -> tuple[Any, tuple[int, int]]:
        """Run one method; returns (the result, in an envelope) and (start, end) times as two objects,
        so the result's ObjectRef can be handed to another group on its own."""
        started = time.time_ns()
        try:
            target = self._instance if role is None else self._instance.role(role)
            result = getattr(target, method)(*values[:num_args], **dict(zip(kw_names, values[num_args:])))
        except BaseException as exc:
            raise WorkerError(self._rank, method, format_user_traceback(), type(exc).__name__) from None
        finished = time.time_ns()
        try:
            envelope = Envelope(result)
        except Exception as exc:
            raise ResultNotPicklable(
                f"the result of {method}() on rank {self._rank} cannot be pickled: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        return envelope, (started, finished)


RemoteRankActor = ray.remote(_RankActor)
