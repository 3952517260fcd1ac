"""Messages over a Unix socket, with large buffers in reusable shared memory.

A message is a small frame on the socket — a header, the buffer table and the pickle — plus, when
it carries tensors or arrays, a shared-memory segment (an anonymous ``memfd``) whose file
descriptor travels with the frame (SCM_RIGHTS). The receiver maps the segment and rebuilds tensors
on top of the mapping: the bytes are copied once, by the sender, into pages that are already
allocated when the segment is reused.

Segments are leased. The receiver's tensors keep its mapping alive; when the last of them is
gone, the receiver tells the sender (in the header of its next frame) and the sender may reuse the
segment. Nothing is ever named in ``/dev/shm``, so a crash cannot leak a segment: the kernel frees
it when the last descriptor and mapping of it go away.

A reply may hand bytes back by reference: when a worker returns tensors that are views of a
segment it received (an echo, or the input with columns added), and nothing else in the worker
still uses that segment, the reply names the sender's own segment and offset instead of copying
the bytes again. The sender then holds a lease on its segment until its tensors are gone.

A frame may also pass a segment on: the controller's channels keep the descriptor of each segment
a worker sent them, and a frame encoded with ``forward=True`` (rank outputs of one group handed to
the same ranks of another) sends such bytes on with that descriptor instead of copying them. The
receiver maps the segment copy-on-write, so its writes stay its own, and when it lets go, the
controller lets go of its own mapping in turn, which gives the segment back to the worker that
sent it.
"""

from __future__ import annotations

import array
import collections
import itertools
import mmap
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spmdcall import serialize

# call id, segment id, segment size, body length, number of buffers, number of releases, number
# of forwarded segments, flags. Then the releases (8 bytes each), the forwarded segments (id and
# size, 16 bytes each), and the body: the buffer table, one (segment, offset, size) triple per
# buffer, then the pickle. In the table, segment 0 is the frame's own segment, _FORWARDED | k the
# frame's k-th forwarded segment, any other id one of the receiver's own segments.
_HEADER = struct.Struct("<QQQQIIII")
_FORWARD = struct.Struct("<QQ")
_FORWARDED = 1 << 63  # marks a forwarded segment in a buffer table, and its id in a release
_ENTRY = 3 * 8
_SHARED_BY_MANY = 1  # the segment goes to several receivers: map it copy-on-write
_ALIGN = 64
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault every page in with one call
_MIN_SEGMENT = 1 << 20
_MAX_FORWARDS = 8  # forwarded segments per frame; bytes in any others are copied
_ANCILLARY_SPACE = socket.CMSG_SPACE(4 * (1 + _MAX_FORWARDS))  # its own segment and those forwarded
# Descriptors of received segments kept open at once for forwarding (each costs one of the
# process's file descriptors as long as its mapping lives); the bytes of others are copied.
_MAX_KEPT_DESCRIPTORS = 256
# Bytes a channel reads at once: a small frame comes in with one call, often with the next ones.
_READ_AHEAD = 1 << 16


@dataclass
class _Segment:
    id: int
    fd: int
    size: int
    mm: mmap.mmap
    holders: int = 0


class SegmentPool:
    """The shared-memory segments this process sends from; a segment is reused once every receiver
    of the message it carried has let go of it. Free segments beyond ``max_free_bytes`` are closed."""

    def __init__(self, max_free_bytes: int = 1 << 30):
        self.max_free_bytes = max_free_bytes
        self._segments: dict[int, _Segment] = {}
        self._free: collections.OrderedDict[int, _Segment] = collections.OrderedDict()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def acquire(self, size: int, holders: int) -> _Segment:
        with self._lock:
            # the smallest free segment that fits without wasting more than half of it: a small
            # payload in a big segment leaves a big one to be made anew (page faults and all)
            fits = [s for s in self._free.values() if size <= s.size <= 2 * max(size, _MIN_SEGMENT)]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                del self._free[seg.id]
                seg.holders = holders
                return seg
        seg = self._create(max(size, _MIN_SEGMENT))
        seg.holders = holders
        with self._lock:
            self._segments[seg.id] = seg
        return seg

    def _create(self, size: int) -> _Segment:
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        fd = os.memfd_create("spmdcall", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        try:
            mm.madvise(_MADV_POPULATE_WRITE)  # one syscall instead of a page fault per page
        except (OSError, ValueError):
            pass
        return _Segment(next(self._ids), fd, size, mm)

    def borrow(self, seg_id: int, offset: int, size: int) -> np.ndarray:
        """A view of ``size`` bytes of one of our own segments that a peer handed back by reference.
        The segment is not reused while the view (or anything built on it) is alive."""
        with self._lock:
            seg = self._segments.get(seg_id)
            if seg is None or seg.holders <= 0 or offset + size > seg.size:
                raise ConnectionError(f"peer handed back bytes of segment {seg_id} that it does not hold")
            seg.holders += 1
        view = np.frombuffer(seg.mm, dtype=np.uint8, count=size, offset=offset)
        weakref.finalize(view, self.release, seg_id)
        return view

    def lend_out(self, size: int) -> np.ndarray | None:
        """``size`` bytes of a free segment for a value of this process (a collected result): its
        pages are in memory already, where new memory would fault every page in on first write.
        The segment comes back when the array (or anything built on it) is gone. None for less
        than a segment's minimum size, which new memory serves as well."""
        if size < _MIN_SEGMENT:
            return None
        seg = self.acquire(size, 1)
        view = np.frombuffer(seg.mm, dtype=np.uint8, count=size)
        weakref.finalize(view, self.release, seg.id)
        return view

    def release(self, seg_id: int, count: int = 1) -> None:
        with self._lock:
            seg = self._segments.get(seg_id)
            if seg is None:
                return
            seg.holders -= count
            if seg.holders > 0:
                return
            self._free[seg_id] = seg
            self._free.move_to_end(seg_id)
            free_bytes = sum(s.size for s in self._free.values())
            while free_bytes > self.max_free_bytes and self._free:
                _, old = self._free.popitem(last=False)
                free_bytes -= old.size
                self._close(old)

    def _close(self, seg: _Segment) -> None:
        del self._segments[seg.id]
        seg.mm.close()
        os.close(seg.fd)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "segments": len(self._segments),
                "free": len(self._free),
                "bytes": sum(s.size for s in self._segments.values()),
            }


_pool = SegmentPool()


def pool() -> SegmentPool:
    """This process's segment pool (shared by all its channels: a broadcast goes over several)."""
    return _pool


@dataclass
class Frame:
    """An encoded message, ready to be sent to one or more peers."""

    data: bytes  # the pickle
    table: list[int] = field(default_factory=list)  # (segment, offset, size) per buffer, flat
    segment: _Segment | None = None
    flags: int = 0
    unsent: int = 0  # receivers that have not been sent the frame yet
    # Buffers of a reply that lie in a segment of the receiver: (index, where our copy would go).
    by_reference: list[tuple[int, int]] = field(default_factory=list)
    size: int = 0  # bytes the frame's own segment needs for every buffer
    # Received segments passed on with the frame: (forward id, size, descriptor, our mapping of it).
    forwards: list[tuple[int, int, int, mmap.mmap]] = field(default_factory=list)

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
            _pool.release(self.segment.id, self.unsent)
            self.unsent = 0


def encode(obj: Any, *, receivers: int = 1, forward: bool = False) -> Frame:
    """Serialise ``obj`` into a frame; tensors and arrays are copied into a shared segment. With
    ``forward``, those that lie in a segment received from a peer are passed on with it instead
    (the caller vouches that nothing in this process writes to them any more)."""
    return encode_pickled(*serialize.dumps(obj), receivers=receivers, forward=forward)


def _encode(obj: Any, receivers: int, lent: dict[int, _Lent]) -> Frame:
    return encode_pickled(*serialize.dumps(obj), receivers=receivers, lent=lent)


def encode_pickled(
    data: bytes,
    buffers: list[memoryview],
    *,
    receivers: int = 1,
    lent: dict[int, _Lent] | None = None,
    forward: bool = False,
) -> Frame:
    """A frame of a value pickled already (``serialize.dumps``); its buffers are copied into a
    shared segment, marked to go back by reference when they lie in one of ``lent``, or, with
    ``forward``, passed on with the received segment they lie in."""
    if not buffers:
        return Frame(data)
    frame = Frame(data, flags=_SHARED_BY_MANY if receivers > 1 else 0)
    copies: list[tuple[int, memoryview]] = []
    for i, b in enumerate(buffers):
        if forward and (forwarded := _forward(frame, b)) is not None:
            frame.table += (*forwarded, b.nbytes)
            continue
        offset = frame.size
        frame.size += (b.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        where = _find_lent(lent, b) if lent else None
        if where is None:
            frame.table += (0, offset, b.nbytes)
            copies.append((offset, b))
        else:
            frame.table += (*where, b.nbytes)
            frame.by_reference.append((i, offset))
    if copies:
        _copy_into(frame, copies, receivers)
    return frame


def _copy_into(frame: Frame, copies: list[tuple[int, memoryview]], receivers: int) -> None:
    if frame.segment is None:
        frame.segment, frame.unsent = _pool.acquire(frame.size, receivers), receivers
    mm = frame.segment.mm
    try:
        for off, b in copies:
            mm[off : off + b.nbytes] = b
    except BaseException:
        frame.discard()
        raise


@dataclass
class _Lent:
    """A segment received from the peer and mapped shared (``MAP_SHARED``): what a reply needs to
    recognise bytes in it. ``mapping`` is weak: while it is alive, something here still uses them."""

    address: int
    size: int
    mapping: weakref.ref


def _find_lent(lent: Mapping[int, _Lent], buffer: memoryview) -> tuple[int, int] | None:
    address = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    for seg_id, seg in lent.items():
        if seg.address <= address and address + buffer.nbytes <= seg.address + seg.size:
            return seg_id, address - seg.address
    return None


@dataclass
class _Received(_Lent):
    """A peer's segment that a channel keeping descriptors mapped shared, with the descriptor: what
    a frame needs to pass its bytes on. The entry goes, and the descriptor closes, with the mapping."""

    fd: int = -1


# Segments received by this process's channels that keep descriptors, by a key of our own (two
# peers may use the same segment id).
_received: dict[int, _Received] = {}
_received_keys = itertools.count(1)
_forward_ids = itertools.count(1)


def _forget_received(key: int) -> None:
    os.close(_received.pop(key).fd)


def _forward(frame: Frame, buffer: memoryview) -> tuple[int, int] | None:
    """``(_FORWARDED | k, offset)`` when ``buffer`` lies in a received segment, which becomes (or
    already is) the frame's k-th forwarded segment; None when it must be copied."""
    received = dict(_received)  # a finalizer may remove an entry at any time
    where = _find_lent(received, buffer) if received else None
    if where is None:
        return None
    key, offset = where
    mapping = received[key].mapping()
    if mapping is None:
        return None
    fd = received[key].fd
    for k, forwarded in enumerate(frame.forwards):
        if forwarded[2] == fd:
            return _FORWARDED | k, offset
    if len(frame.forwards) == _MAX_FORWARDS:
        return None
    frame.forwards.append((next(_forward_ids), received[key].size, fd, mapping))
    return _FORWARDED | (len(frame.forwards) - 1), offset


def spin_until_readable(fds: list[int], seconds: float, *, yield_core: bool = True) -> list[int]:
    """Poll ``fds`` without sleeping for up to ``seconds``; the readable ones, or [] when none got data.

    Waking a process that sleeps in ``select``/``recv`` takes the kernel tens of microseconds (over
    a hundred on some VMs), about as long as a whole small call. A peer that answers within the
    window is seen at once. With ``yield_core``, the process yields its core to any other runnable
    one between polls; without, it keeps it, which saves the 15-20 us a yielded core can take to
    come back, but starves a process that shares the core for the whole window."""
    if seconds <= 0:
        return []
    deadline = time.perf_counter() + seconds
    while True:
        ready = select.select(fds, [], [], 0)[0]
        if ready or time.perf_counter() >= deadline:
            return ready
        if yield_core:
            os.sched_yield()


class Channel:
    """One end of a controller <-> worker connection. ``keep_descriptors``: keep the descriptor of
    each segment the peer sends (while our mapping of it lives), so that frames encoded with
    ``forward=True`` can pass its bytes on to other peers (the controller's side)."""

    def __init__(self, sock: socket.socket, *, keep_descriptors: bool = False):
        self.sock = sock
        self.keep_descriptors = keep_descriptors
        # Our mappings of segments forwarded to the peer, by forward id, until the peer lets go.
        self._forwarded: dict[int, mmap.mmap] = {}
        # Segments of the peer that our tensors no longer use, to report in our next frame.
        self._releases: collections.deque[int] = collections.deque()
        # Our segments the peer still holds: given back if the peer dies.
        self._leased: collections.Counter[int] = collections.Counter()
        # The peer's segments we map shared, by id (their mapping removes itself when it is gone).
        self._lent: dict[int, _Lent] = {}
        # Bytes read from the socket and not yet returned as frames: [_start, _end) of _buffer.
        self._buffer = bytearray(_READ_AHEAD)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0
        # Descriptors that came with those bytes, in the order of the frames that carry them.
        self._fds: collections.deque[int] = collections.deque()

    def fileno(self) -> int:
        return self.sock.fileno()

    def buffered(self) -> bool:
        """Whether bytes of the next frame were read already. The socket may then not be readable,
        so wait for it (``select``) only when this is false."""
        return self._end > self._start

    def readable(self) -> bool:
        """Whether a frame (or its start) is there to read without waiting."""
        return self.buffered() or bool(select.select([self.sock.fileno()], [], [], 0)[0])

    def encode_reply(self, obj: Any) -> Frame:
        """Like :func:`encode`, but bytes that lie in a segment received from the peer are marked to
        go back by reference. Whether they do is settled when the frame is sent: only if nothing in
        this process uses that segment any more (so drop the call's arguments and result first)."""
        return _encode(obj, 1, self._lent)

    def encode_pickled_reply(self, data: bytes, buffers: list[memoryview]) -> Frame:
        """:meth:`encode_reply` of a value pickled already."""
        return encode_pickled(data, buffers, lent=self._lent)

    def has_releases(self) -> bool:
        """Whether segments of the peer were let go of since our last frame told it."""
        return bool(self._releases)

    def forwarding(self) -> bool:
        """Whether the peer still holds segments we passed on to it (see ``keep_descriptors``)."""
        return bool(self._forwarded)

    def _settle(self, frame: Frame) -> None:
        # A segment we still map can still change under the peer's tensors: copy its bytes instead.
        copies: list[tuple[int, memoryview]] = []
        for i, offset in frame.by_reference:
            seg_id, at, size = frame.table[3 * i : 3 * i + 3]
            mapping = self._lent[seg_id].mapping() if seg_id in self._lent else None
            if mapping is not None:
                copies.append((offset, memoryview(mapping)[at : at + size]))
                frame.table[3 * i : 3 * i + 2] = (0, offset)
        frame.by_reference = []
        if copies:
            _copy_into(frame, copies, 1)

    def send_frame(self, frame: Frame, call_id: int = 0) -> None:
        if frame.by_reference:
            self._settle(frame)
        releases = self._releases
        n = len(releases)
        released = struct.pack(f"<{n}Q", *(releases.popleft() for _ in range(n))) if n else b""
        seg = frame.segment
        table = frame.packed_table
        header = _HEADER.pack(
            call_id,
            seg.id if seg else 0,
            seg.size if seg else 0,
            len(table) + len(frame.data),
            frame.num_buffers,
            n,
            len(frame.forwards),
            frame.flags,
        )
        if seg is None and not frame.forwards:  # one write, no descriptor (most small messages)
            self.sock.sendall(b"".join((header, released, table, frame.data)))
            return
        forwards = b"".join(_FORWARD.pack(forward_id, size) for forward_id, size, _, _ in frame.forwards)
        parts = [header, released, forwards, table, frame.data]
        fds = [fd for _, _, fd, _ in frame.forwards]
        if seg is not None:
            fds.insert(0, seg.fd)
            frame.unsent -= 1
            self._leased[seg.id] += 1
        for forward_id, _, _, mapping in frame.forwards:
            self._forwarded[forward_id] = mapping
        sent = self.sock.sendmsg(parts, [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        total = sum(len(p) for p in parts)
        if sent < total:
            self.sock.sendall(b"".join(parts)[sent:])

    def send(self, obj: Any, call_id: int = 0) -> None:
        frame = encode(obj)
        try:
            self.send_frame(frame, call_id)
        finally:
            frame.discard()

    def recv(self) -> tuple[int, Any]:
        """``(call_id, obj)``; raises EOFError when the peer is gone."""
        call_id, payload, buffers = self.recv_raw()
        return call_id, serialize.loads(payload, buffers)

    def recv_raw(self) -> tuple[int, memoryview, list[Any]]:
        """The call id, the pickle and its buffers, not yet unpickled (so a failure can name the call)."""
        while self._end - self._start < _HEADER.size:
            self._fill()
        call_id, seg_id, seg_size, body_len, num_buffers, num_releases, num_forwards, flags = (
            _HEADER.unpack_from(self._buffer, self._start)
        )
        prefix = 8 * num_releases + _FORWARD.size * num_forwards
        rest = memoryview(self._take(self._start + _HEADER.size, prefix + body_len))
        body = rest[prefix:]
        view = self._map(self._next_fd(seg_id), seg_id, seg_size, flags) if seg_id else None
        forwarded = []
        for k in range(num_forwards):
            forward_id, size = _FORWARD.unpack_from(rest, 8 * num_releases + _FORWARD.size * k)
            forwarded.append(self._map_forwarded(self._next_fd(forward_id), forward_id, size))
        buffers: list[Any] = []
        if num_buffers:
            table = struct.unpack_from(f"<{3 * num_buffers}Q", body)
            for where, offset, size in zip(table[0::3], table[1::3], table[2::3]):
                if where == 0 and view is not None:
                    buffers.append(view[offset : offset + size])
                elif where & _FORWARDED:
                    buffers.append(forwarded[where & ~_FORWARDED][offset : offset + size])
                else:  # our own bytes, handed back: leased before the releases below can free them
                    buffers.append(_pool.borrow(where, offset, size))
        if num_releases:
            for released in struct.unpack_from(f"<{num_releases}Q", rest):
                if released & _FORWARDED:  # the peer let go of a segment we passed on: so do we
                    self._forwarded.pop(released & ~_FORWARDED, None)
                else:
                    self._leased[released] -= 1
                    _pool.release(released)
        return call_id, body[_ENTRY * num_buffers :], buffers

    def _next_fd(self, seg_id: int) -> int:
        if not self._fds:
            raise ConnectionError(f"frame announces shared segment {seg_id} but carried no descriptor")
        return self._fds.popleft()

    def _fill(self) -> None:
        """Wait for bytes and read what the socket has after those buffered, with the descriptors
        that came with them. A read stops after a frame that carries one (the kernel's rule), so
        a descriptor is always in hand when its frame's header is."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):  # the start of a frame at the very end: move it to the front
            n = self._end - self._start
            self._buffer[:n] = self._view[self._start : self._end]
            self._start, self._end = 0, n
        n, anc, _, _ = self.sock.recvmsg_into([self._view[self._end :]], _ANCILLARY_SPACE)
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                self._fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        if n == 0:
            raise EOFError("peer closed the connection" + (" mid-message" if self.buffered() else ""))
        self._end += n

    def _take(self, start: int, size: int) -> bytearray:
        """The ``size`` bytes of the current frame from ``start`` of the buffer on, read from the
        socket where they are not buffered yet; the frame's bytes are then used up."""
        end = start + size
        if end <= self._end:
            self._start = end
            return self._buffer[start:end]
        data = bytearray(size)
        have = self._end - start
        data[:have] = self._view[start : self._end]
        self._start = self._end = 0
        # Only this frame's bytes, never the next frame's (whose descriptor a plain read would drop).
        self._recv_exact(memoryview(data)[have:])
        return data

    def _map(self, fd: int, seg_id: int, size: int, flags: int) -> memoryview:
        kept = False
        try:
            if flags & _SHARED_BY_MANY:  # others read the same pages: our writes must stay ours
                mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
            else:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                address = np.frombuffer(mm, dtype=np.uint8).ctypes.data
                self._lent[seg_id] = _Lent(address, size, weakref.ref(mm))
                if self.keep_descriptors and len(_received) < _MAX_KEPT_DESCRIPTORS:
                    key = next(_received_keys)
                    _received[key] = _Received(address, size, weakref.ref(mm), fd)
                    weakref.finalize(mm, _forget_received, key)
                    kept = True
        finally:
            if not kept:
                os.close(fd)
        # When the last tensor on this mapping is gone, tell the sender it may reuse the segment.
        weakref.finalize(mm, _unmapped, self._releases, self._lent, seg_id)
        return memoryview(mm)

    def _map_forwarded(self, fd: int, forward_id: int, size: int) -> memoryview:
        """Map a segment another peer sent to ours, copy-on-write: what we write stays ours."""
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
        finally:
            os.close(fd)
        weakref.finalize(mm, self._releases.append, forward_id | _FORWARDED)
        return memoryview(mm)

    def _recv_exact(self, view: memoryview) -> None:
        while view.nbytes:
            n = self.sock.recv_into(view, view.nbytes, socket.MSG_WAITALL)
            if n == 0:
                raise EOFError("peer closed the connection mid-message")
            view = view[n:]

    def close(self) -> None:
        """Close the socket and take back every segment the peer still held."""
        for seg_id, count in self._leased.items():
            if count > 0:
                _pool.release(seg_id, count)
        self._leased.clear()
        self._forwarded.clear()  # our mappings go, and with them our leases on the senders' segments
        while self._fds:
            os.close(self._fds.popleft())
        self.sock.close()


def _unmapped(releases: collections.deque[int], lent: dict[int, _Lent], seg_id: int) -> None:
    lent.pop(seg_id, None)
    releases.append(seg_id)
