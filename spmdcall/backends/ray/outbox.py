"""How the values of a ray group's calls travel to its actors: through a rank's shared-memory link
as frames, through the object store, or inside the task itself (``RayBackend.submit``)."""

from __future__ import annotations

import collections
from typing import Any

import ray
import ray.experimental

from spmdcall import serialize
from spmdcall.backends import Call
from spmdcall.backends.ray.actor import goes_linked, seal
from spmdcall.backends.ray.futures import RankState, RayFuture, on_link
from spmdcall.transport.envelope import Envelope
from spmdcall.transport.frames import Frame, KeptSegments, encode_pickled
from spmdcall.transport.link import Link, Linked

# Serialised values below this size travel inside the task itself instead of through ray.put.
_INLINE_MAX_BYTES = 64 * 1024


class Outbox:
    """How the values of one ``submit`` travel, each encoded once: to a rank with a shared-memory
    link, a large value as one frame however many ranks get it (each rank is sent a token); to the
    others, through the object store once (small values inside the task itself).

    It counts what the controller moved (:meth:`moved`): the bytes it serialised or copied (a
    frame's pickle and copied buffers, an envelope put in the store or sent inside the task), and
    those it handed on untouched (a frame's forwarded segments, and another call's result passed
    as its ObjectRef: the size of the object Ray stored, which the controller never fetches).
    Each value counts once, where it is first encoded for a way."""

    def __init__(
        self, ranks: list[RankState], calls: list[Call], encoded: dict[int, Any], kept: KeptSegments
    ):
        self.encoded, self.kept = encoded, kept
        self.frames: dict[int, Frame] = {}
        self.stored: dict[int, Any] = {}
        self.sent_bytes = self.handed_on_bytes = 0
        self.ref_sizes = _object_sizes(
            {
                id(v): v.object_ref
                for c in calls
                for v in (*c.args, *c.kwargs.values())
                if isinstance(v, RayFuture)
            }
        )
        linked = [c for c in calls if ranks[c.rank].link is not None]
        self.receivers = collections.Counter(
            id(v)
            for c in linked
            for v in {id(v): v for v in (*c.args, *c.kwargs.values())}.values()
            if _goes_linked(encoded[id(v)])
        )
        for c in linked:
            w = ranks[c.rank]
            if self.receivers:  # hear which of our segments it let go of, before taking new ones
                on_link(w, Link.drain)
            if w.link is not None and w.link.channel.has_releases():  # tell it which of its we did
                on_link(w, Link.flush)

    def sent(self, v: Any, w: RankState) -> Any:
        """What ``v`` travels to rank ``w`` as: a link token, an ObjectRef, or the envelope itself."""
        e = self.encoded[id(v)]
        if w.link is not None and _goes_linked(e):
            if id(v) not in self.frames:
                # Results that came over a link, handed on unopened (an Envelope, or the pieces of
                # a hand-off): their bytes go on in the segments they came in, not as a copy. Only
                # bytes as the actors sent them lie in kept segments (Channel.recv_sealed).
                frame = self.frames[id(v)] = encode_pickled(
                    e.data, e.sent_buffers, receivers=self.receivers[id(v)], forward=self.kept
                )
                self.sent_bytes += len(frame.data) + frame.copied_bytes
                self.handed_on_bytes += frame.forwarded_bytes
            frame = self.frames[id(v)]
            token = on_link(w, lambda link: link.send(frame))
            if token is not None:
                return Linked(token)
        if id(v) not in self.stored:
            self.stored[id(v)] = store(e)
            if isinstance(e, Envelope):
                self.sent_bytes += e.nbytes
            self.handed_on_bytes += self.ref_sizes.get(id(v), 0)  # a caller's own ObjectRef: neither
        return self.stored[id(v)]

    def moved(self) -> tuple[int, int]:
        """The ``(sent_bytes, handed_on_bytes)`` counted since the last call (``Call.sent_bytes``)."""
        moved = self.sent_bytes, self.handed_on_bytes
        self.sent_bytes = self.handed_on_bytes = 0
        return moved

    def discard(self) -> None:
        for frame in self.frames.values():
            frame.discard()  # leases of frames that could not be sent


def encode_value(c: Call, what: str, value: Any) -> Any:
    """What a call argument travels as: its producer's ObjectRef (a rank future), the caller's own
    ObjectRef, or an envelope."""
    if isinstance(value, RayFuture):
        return value.object_ref  # a top-level ObjectRef argument: Ray resolves it on the worker
    if isinstance(value, ray.ObjectRef):
        return value  # e.g. from ray.put: Ray resolves it on the worker, as for any Ray actor call
    if isinstance(value, Envelope):
        return value  # a result that came back over a link, sent on unopened
    try:
        return seal(value)
    except Exception as exc:
        culprit = serialize.describe_unpicklable({what: value}) or f"{what} ({type(value).__name__}): {exc}"
        raise TypeError(f"cannot send {c.method}() to rank {c.rank}: {culprit}") from exc


def _object_sizes(refs: dict[int, Any]) -> dict[int, int]:
    """The size of each object, as Ray stored it, once it exists: waits for the producers' results
    without fetching them (as a hand-off on ``process`` waits for them), and asks their owner, this
    process, how large they are."""
    if not refs:
        return {}
    ray.wait(list(refs.values()), num_returns=len(refs), fetch_local=False)
    where = ray.experimental.get_object_locations(list(refs.values()))
    return {k: (where.get(ref) or {}).get("object_size") or 0 for k, ref in refs.items()}


def holds_object_refs(c: Call) -> bool:
    return any(isinstance(v, ray.ObjectRef) for v in (*c.args, *c.kwargs.values()))


def _goes_linked(value: Any) -> bool:
    return isinstance(value, Envelope) and goes_linked(value)


def store(value: Any) -> Any:
    # Small envelopes ride inside the task; large ones go to the object store once.
    if isinstance(value, Envelope) and value.nbytes >= _INLINE_MAX_BYTES:
        return ray.put(value)
    return value
