"""The wire format of a channel: frames (a pickle, a table of its buffers, and where the buffers are).

A frame's buffers are copied into one shared segment of the sender (``segments.py``), or, for a
reply, named by reference where they lie in a segment the receiver sent, or passed on with the
received segment they lie in (``encode(..., forward=table)``). Knows nothing of the values inside.
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spmdcall import serialize
from spmdcall.transport.segments import Segment, pool

# call id, segment id, segment size, body length, number of buffers, number of releases, number
# of forwarded segments, flags. Then the releases (8 bytes each), the forwarded segments (id and
# size, 16 bytes each), and the body: the buffer table, one (segment, offset, size) triple per
# buffer, then the pickle. In the table, segment 0 is the frame's own segment, FORWARDED | k the
# frame's k-th forwarded segment, any other id one of the receiver's own segments.
HEADER = struct.Struct("<QQQQIIII")
FORWARD = struct.Struct("<QQ")
FORWARDED = 1 << 63  # marks a forwarded segment in a buffer table, and its id in a release
ENTRY = 3 * 8
SHARED_BY_MANY = 1  # the segment goes to several receivers: map it copy-on-write
_ALIGN = 64
MAX_FORWARDS = 8  # forwarded segments per frame; bytes in any others are copied
# Descriptors of received segments kept open at once for forwarding (each costs one of the
# process's file descriptors as long as its mapping lives); the bytes of others are copied.
MAX_KEPT_DESCRIPTORS = 256


@dataclass
class Frame:
    """An encoded message, ready to be sent to one or more peers."""

    data: bytes  # the pickle
    table: list[int] = field(default_factory=list)  # (segment, offset, size) per buffer, flat
    segment: Segment | None = None
    flags: int = 0
    unsent: int = 0  # receivers that have not been sent the frame yet
    # Buffers of a reply that lie in a segment of the receiver: (index, where our copy would go).
    by_reference: list[tuple[int, int]] = field(default_factory=list)
    size: int = 0  # bytes the frame's own segment needs for every buffer
    # Received segments passed on with the frame: (forward id, size, descriptor, our mapping of it).
    forwards: list[tuple[int, int, int, mmap.mmap]] = field(default_factory=list)
    copied_bytes: int = 0  # bytes of buffers copied into the frame's own segment
    forwarded_bytes: int = 0  # bytes of buffers passed on in received segments, not copied

    @property
    def num_buffers(self) -> int:
        return len(self.table) // 3

    @property
    def packed_table(self) -> bytes:
        return struct.pack(f"<{len(self.table)}Q", *self.table) if self.table else b""

    @property
    def body(self) -> bytes:
        return self.packed_table + self.data

    def discard(self) -> None:
        """Give back the segment's leases for receivers that will never get this frame."""
        if self.segment is not None and self.unsent:
            pool().release(self.segment.id, self.unsent)
            self.unsent = 0


def encode(obj: Any, *, receivers: int = 1, forward: KeptSegments | None = None) -> Frame:
    """Serialise ``obj`` into a frame; tensors and arrays are copied into a shared segment. With
    ``forward``, those that lie in a segment kept in that table are passed on with it instead
    (the caller vouches that nothing in this process writes to them any more)."""
    return encode_pickled(*serialize.dumps(obj), receivers=receivers, forward=forward)


def encode_lent(obj: Any, receivers: int, lent: dict[int, Lent]) -> Frame:
    return encode_pickled(*serialize.dumps(obj), receivers=receivers, lent=lent)


def encode_pickled(
    data: bytes,
    buffers: list[memoryview],
    *,
    receivers: int = 1,
    lent: dict[int, Lent] | None = None,
    forward: KeptSegments | None = None,
) -> Frame:
    """A frame of a value pickled already (``serialize.dumps``); its buffers are copied into a
    shared segment, marked to go back by reference when they lie in one of ``lent``, or, with
    ``forward``, passed on with the kept segment they lie in."""
    if not buffers:
        return Frame(data)
    frame = Frame(data, flags=SHARED_BY_MANY if receivers > 1 else 0)
    copies: list[tuple[int, memoryview]] = []
    for i, b in enumerate(buffers):
        if forward is not None and (forwarded := _forward(frame, b, forward)) is not None:
            frame.table += (*forwarded, b.nbytes)
            frame.forwarded_bytes += b.nbytes
            continue
        offset = frame.size
        frame.size += (b.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        where = find_lent(lent, b) if lent else None
        if where is None:
            frame.table += (0, offset, b.nbytes)
            copies.append((offset, b))
            frame.copied_bytes += b.nbytes
        else:
            frame.table += (*where, b.nbytes)
            frame.by_reference.append((i, offset))
    if copies:
        copy_into(frame, copies, receivers)
    return frame


def copy_into(frame: Frame, copies: list[tuple[int, memoryview]], receivers: int) -> None:
    if frame.segment is None:
        frame.segment, frame.unsent = pool().acquire(frame.size, receivers), receivers
    mm = frame.segment.mm
    try:
        for off, b in copies:
            mm[off : off + b.nbytes] = b
    except BaseException:
        frame.discard()
        raise


@dataclass
class Lent:
    """A segment received from the peer and mapped shared (``MAP_SHARED``): what a reply needs to
    recognise bytes in it. ``mapping`` is weak: while it is alive, something here still uses them."""

    address: int
    size: int
    mapping: weakref.ref


def find_lent(lent: Mapping[int, Lent], buffer: memoryview) -> tuple[int, int] | None:
    address = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    for seg_id, seg in lent.items():
        if seg.address <= address and address + buffer.nbytes <= seg.address + seg.size:
            return seg_id, address - seg.address
    return None


@dataclass
class Received(Lent):
    """A peer's segment that a channel keeping descriptors mapped shared, with the descriptor: what
    a frame needs to pass its bytes on. The entry goes, and the descriptor closes, with the mapping."""

    fd: int = -1


class KeptSegments:
    """Peers' segments kept with their descriptors, by a key of our own (two peers may use the
    same segment id), so that a frame can pass their bytes on (``encode(..., forward=table)``).

    The channels that share one table (``Channel(keep=table)``) keep what they receive in it, at
    most ``MAX_KEPT_DESCRIPTORS`` at once (each holds a file descriptor); an entry goes, and its
    descriptor closes, with our mapping of the segment. A backend shares one table between all its
    channels, so that a reply of one group's rank can be handed on to another group's rank."""

    def __init__(self) -> None:
        self._kept: dict[int, Received] = {}
        self._keys = itertools.count(1)

    def keep(self, address: int, size: int, mapping: mmap.mmap, fd: int) -> bool:
        """Keep ``fd`` while ``mapping`` lives; False (the caller closes it) when the table is full."""
        if len(self._kept) >= MAX_KEPT_DESCRIPTORS:
            return False
        key = next(self._keys)
        self._kept[key] = Received(address, size, weakref.ref(mapping), fd)
        weakref.finalize(mapping, self._forget, key)
        return True

    def _forget(self, key: int) -> None:
        os.close(self._kept.pop(key).fd)

    def snapshot(self) -> dict[int, Received]:
        return dict(self._kept)  # a finalizer may remove an entry at any time


_forward_ids = itertools.count(1)


def _forward(frame: Frame, buffer: memoryview, table: KeptSegments) -> tuple[int, int] | None:
    """``(FORWARDED | k, offset)`` when ``buffer`` lies in a segment kept in ``table``, which becomes
    (or already is) the frame's k-th forwarded segment; None when it must be copied."""
    kept = table.snapshot()
    where = find_lent(kept, buffer) if kept else None
    if where is None:
        return None
    key, offset = where
    mapping = kept[key].mapping()
    if mapping is None:
        return None
    fd = kept[key].fd
    for k, forwarded in enumerate(frame.forwards):
        if forwarded[2] == fd:
            return FORWARDED | k, offset
    if len(frame.forwards) == MAX_FORWARDS:
        return None
    frame.forwards.append((next(_forward_ids), kept[key].size, fd, mapping))
    return FORWARDED | (len(frame.forwards) - 1), offset
