"""Large values to and from ranks without a shared-memory link, through Monarch's RDMA buffers.

A rank on another host has no shared-memory link to the controller. Its large values (the
size that would go over a link) can then travel as :class:`Lent`: the pickle inline, and each
out-of-band buffer (a tensor's or array's bytes) registered with Monarch's ``RDMABuffer`` where it
lies; the receiver reads each one straight into memory of its own (``fetch``), and the Monarch
message carries only the handles. The sender keeps the memory until the receiver has read it:
the controller until the replies of the call have come (``Lending``), a rank until the controller
says it has read the result (the actor's ``release``).

Monarch moves the bytes with ibverbs where the host has RDMA hardware, else over TCP (its
fallback), which is slower than its own messages. So the backend uses this path on its own only
where ibverbs is there (``rdma=None``); ``rdma=True`` asks for it anyway.
"""

from __future__ import annotations

import threading
from typing import Any

from spmdcall.transport.envelope import Envelope

__all__ = ["Lending", "Lent", "available", "lend", "wanted"]


def available() -> str:
    """Monarch's RDMA transport here: ``"ibverbs"``, ``"tcp"`` (its fallback) or ``"none"``."""
    from monarch.rdma import get_rdma_backend

    return str(get_rdma_backend())


def wanted(setting: bool | None) -> bool:
    """Whether large values to ranks without a link go through RDMA buffers, for the backend's
    ``rdma`` option: None where Monarch has ibverbs, True wherever it has a transport at all."""
    if setting is None:
        return available() == "ibverbs"
    if setting and available() == "none":
        raise ValueError("rdma=True, but Monarch finds no RDMA transport here (neither ibverbs nor TCP)")
    return bool(setting)


class Lent:
    """A sealed value whose buffers stay with its sender, each lent as an ``RDMABuffer``.

    Pickled (into a Monarch message) it is the pickle and the buffers' handles; ``key`` names it
    among what its sender lent, for the sender's release."""

    __slots__ = ("data", "parts", "key", "_memory")

    def __init__(self, data: bytes, parts: list[tuple[Any, int]], key: int = 0, memory: Any = None):
        self.data, self.parts, self.key = data, parts, key
        self._memory = memory  # the sender's buffers, kept while lent (not pickled)

    def __reduce__(self) -> tuple:
        return Lent, (self.data, self.parts, self.key)

    def fetch(self) -> Envelope:
        """Read every buffer into memory of this process (the reads go at once, then are awaited);
        the sealed value, ready to open."""
        into = [bytearray(n) for _, n in self.parts]
        reads = [buf.read_into(memoryview(dst)) for (buf, n), dst in zip(self.parts, into) if n]
        for read in reads:
            read.get()
        return Envelope(self.data, [memoryview(b) for b in into])

    def drop(self) -> None:
        """Give the buffers' registrations back (the sender, once the receiver has read them)."""
        for buf, n in self.parts:
            if n:
                buf.drop()
        self.parts, self._memory = [], None


def lend(envelope: Envelope, key: int = 0) -> Lent:
    """``envelope`` with each of its buffers registered as an ``RDMABuffer`` where it lies."""
    from monarch.rdma import RDMABuffer

    views = [memoryview(b).cast("B") for b in envelope.buffers]
    # Over the TCP fallback Monarch warns once a process (its own "once" filter); not silenced here:
    # warnings.catch_warnings would change the filters of every thread while it lasts.
    parts = [(RDMABuffer(v) if v.nbytes else None, v.nbytes) for v in views]
    return Lent(envelope.data, parts, key, views)


class Lending:
    """What one ``submit`` lends to ranks (``lent``, by value, filled as the calls are sent),
    dropped once each of its ``count`` calls has settled (any thread)."""

    __slots__ = ("_lent", "_left", "_lock")

    def __init__(self, lent: dict[int, Lent], count: int):
        self._lent, self._left, self._lock = lent, count, threading.Lock()

    def settled(self) -> None:
        with self._lock:
            self._left -= 1
            done = self._left == 0
        if done:
            for lent in self._lent.values():
                lent.drop()
            self._lent = {}
