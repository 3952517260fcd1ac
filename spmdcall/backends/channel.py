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
"""

from __future__ import annotations

import array
import collections
import itertools
import mmap
import os
import socket
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from spmdcall import serialize

# call id, segment id, segment size, body length, number of buffers, number of releases, flags
_HEADER = struct.Struct("<QQQQIII")
_SHARED_BY_MANY = 1  # the segment goes to several receivers: map it copy-on-write
_ALIGN = 64
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault every page in with one call
_MIN_SEGMENT = 1 << 20


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
            # the smallest free segment that fits without wasting more than 4x
            fits = [s for s in self._free.values() if size <= s.size <= 4 * max(size, _MIN_SEGMENT)]
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

    body: bytes
    num_buffers: int = 0
    segment: _Segment | None = None
    flags: int = 0
    unsent: int = 0  # receivers that have not been sent the frame yet

    def discard(self) -> None:
        """Give back the segment's leases for receivers that will never get this frame."""
        if self.segment is not None and self.unsent:
            _pool.release(self.segment.id, self.unsent)
            self.unsent = 0


def encode(obj: Any, *, receivers: int = 1) -> Frame:
    """Serialise ``obj`` into a frame; tensors and arrays are copied into a shared segment."""
    data, buffers = serialize.dumps(obj)
    if not buffers:
        return Frame(data)
    offsets, total = [], 0
    for b in buffers:
        offsets.append(total)
        total += (b.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    seg = _pool.acquire(total, receivers)
    try:
        for off, b in zip(offsets, buffers):
            seg.mm[off : off + b.nbytes] = b
    except BaseException:
        _pool.release(seg.id, receivers)
        raise
    table = struct.pack(f"<{2 * len(buffers)}Q", *offsets, *(b.nbytes for b in buffers))
    return Frame(table + data, len(buffers), seg, _SHARED_BY_MANY if receivers > 1 else 0, receivers)


class Channel:
    """One end of a controller <-> worker connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        # Segments of the peer that our tensors no longer use, to report in our next frame.
        self._releases: collections.deque[int] = collections.deque()
        # Our segments the peer still holds: given back if the peer dies.
        self._leased: collections.Counter[int] = collections.Counter()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_frame(self, frame: Frame, call_id: int = 0) -> None:
        releases = []
        while self._releases:
            releases.append(self._releases.popleft())
        seg = frame.segment
        header = _HEADER.pack(
            call_id,
            seg.id if seg else 0,
            seg.size if seg else 0,
            len(frame.body),
            frame.num_buffers,
            len(releases),
            frame.flags,
        )
        parts = [header, struct.pack(f"<{len(releases)}Q", *releases), frame.body]
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [seg.fd]))] if seg else []
        if seg:
            frame.unsent -= 1
            self._leased[seg.id] += 1
        sent = self.sock.sendmsg(parts, anc)
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

    def recv_raw(self) -> tuple[int, memoryview, list[memoryview]]:
        """The call id, the pickle and its buffers, not yet unpickled (so a failure can name the call)."""
        head = bytearray(_HEADER.size)
        n, anc, _, _ = self.sock.recvmsg_into([head], socket.CMSG_SPACE(4))
        if n == 0:
            raise EOFError("peer closed the connection")
        fds = [
            fd
            for level, kind, data in anc
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
            for fd in array.array("i", data[: len(data) - len(data) % 4])
        ]
        if n < len(head):
            self._recv_exact(memoryview(head)[n:])
        call_id, seg_id, seg_size, body_len, num_buffers, num_releases, flags = _HEADER.unpack(head)
        rest = bytearray(8 * num_releases + body_len)
        self._recv_exact(memoryview(rest))
        for released in struct.unpack_from(f"<{num_releases}Q", rest):
            self._leased[released] -= 1
            _pool.release(released)
        body = memoryview(rest)[8 * num_releases :]
        buffers: list[memoryview] = []
        if seg_id:
            if len(fds) != 1:
                raise ConnectionError(
                    f"frame announces shared segment {seg_id} but carried {len(fds)} descriptors"
                )
            buffers = self._map(fds[0], seg_id, seg_size, num_buffers, body, flags)
        else:
            for fd in fds:
                os.close(fd)
        return call_id, body[16 * num_buffers :], buffers

    def _map(
        self, fd: int, seg_id: int, size: int, num_buffers: int, body: memoryview, flags: int
    ) -> list[memoryview]:
        try:
            if flags & _SHARED_BY_MANY:  # others read the same pages: our writes must stay ours
                mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
            else:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        # When the last tensor on this mapping is gone, tell the sender it may reuse the segment.
        weakref.finalize(mm, self._releases.append, seg_id)
        table = struct.unpack_from(f"<{2 * num_buffers}Q", body)
        view = memoryview(mm)
        return [view[off : off + size] for off, size in zip(table[:num_buffers], table[num_buffers:])]

    def _recv_exact(self, view: memoryview) -> None:
        while view.nbytes:
            n = self.sock.recv_into(view)
            if n == 0:
                raise EOFError("peer closed the connection mid-message")
            view = view[n:]

    def close(self) -> None:
        """Close the socket and take back every segment the peer still held."""
        for seg_id, count in self._leased.items():
            if count > 0:
                _pool.release(seg_id, count)
        self._leased.clear()
        self.sock.close()
