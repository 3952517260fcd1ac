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
a worker sent them, and a frame encoded with ``forward=`` that table (rank outputs of one group handed to
the same ranks of another) sends such bytes on with that descriptor instead of copying them. The
receiver maps the segment copy-on-write, so its writes stay its own, and when it lets go, the
controller lets go of its own mapping in turn, which gives the segment back to the worker that
sent it. The controller maps each segment it keeps twice: copy-on-write for the values it reads
(a user's ``.get()`` result, which the user may write to), and once more for what it passes on
(:meth:`Channel.recv_sealed`), which no value here is built on, so that nothing the controller
does changes the bytes another worker is sent, and nothing another worker does changes the
controller's values.
"""

from __future__ import annotations

import array
import collections
import mmap
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from spmdcall import serialize
from spmdcall.transport.frames import (
    ENTRY,
    FORWARD,
    FORWARDED,
    HEADER,
    MAX_FORWARDS,
    SHARED_BY_MANY,
    Frame,
    KeptSegments,
    Lent,
    copy_into,
    encode,
    encode_lent,
    encode_pickled,
)
from spmdcall.transport.segments import pool

_ANCILLARY_SPACE = socket.CMSG_SPACE(4 * (1 + MAX_FORWARDS))  # its own segment and those forwarded
# Bytes a channel reads at once: a small frame comes in with one call, often with the next ones.
_READ_AHEAD = 1 << 16


def spin_until_readable(fds: list[int], seconds: float, *, yield_core: bool = True) -> list[int]:
    """Poll ``fds`` without sleeping for up to ``seconds``; the readable ones, or [] when none got data.

    Waking a process that sleeps in ``select``/``recv`` costs the kernel about as much as a whole
    small call (docs/benchmarks-log.md). A peer that answers within the window is seen at once. With
    ``yield_core``, the process yields its core to any other runnable one between polls; without,
    it keeps it, which saves the time a yielded core takes to come back, but starves a process
    that shares the core for the whole window."""
    if seconds <= 0:
        return []
    deadline = time.perf_counter() + seconds
    while True:
        ready = select.select(fds, [], [], 0)[0]
        if ready or time.perf_counter() >= deadline:
            return ready
        if yield_core:
            os.sched_yield()


def small(frame: Frame) -> bool:
    """Whether ``frame`` goes out as bytes alone (no shared memory, no descriptor): a frame that
    :meth:`Channel.hold_frame` can hold back."""
    return frame.segment is None and not frame.forwards


class Channel:
    """One end of a controller <-> worker connection. ``keep``: a table to keep the descriptor of
    each segment the peer sends in (while our mapping of it lives), so that frames encoded with
    ``forward=keep`` can pass its bytes on to other peers (the controller's side).

    ``when_full``: called when a write finds the socket full, instead of blocking in it; the write
    tries again when it returns. A peer that stops reading because it cannot send us its own
    messages would otherwise wait for us while we wait for it: the controller reads replies there
    (``ProcessBackend``)."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        keep: KeptSegments | None = None,
        when_full: Callable[[], None] | None = None,
    ):
        self.sock = sock
        self.keep = keep
        self.when_full = when_full
        # Our mappings of segments forwarded to the peer, by forward id, until the peer lets go.
        self._forwarded: dict[int, mmap.mmap] = {}
        # Segments of the peer that our tensors no longer use, to report in our next frame.
        self._releases: collections.deque[int] = collections.deque()
        # Our segments the peer still holds: given back if the peer dies.
        self._leased: collections.Counter[int] = collections.Counter()
        # One thread may send while another receives (the process backend's controller): the
        # lease counts are the one thing both update.
        self._leased_lock = threading.Lock()
        # The peer's segments we map shared, by id (their mapping removes itself when it is gone).
        self._lent: dict[int, Lent] = {}
        # Bytes read from the socket and not yet returned as frames: [_start, _end) of _buffer.
        self._buffer = bytearray(_READ_AHEAD)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0
        # Descriptors that came with those bytes, in the order of the frames that carry them.
        self._fds: collections.deque[int] = collections.deque()
        # Small frames held back to go out in one write with the next ones (``hold_frame``).
        self._held: list[bytes] = []
        self._held_bytes = 0

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
        return encode_lent(obj, 1, self._lent)

    def encode_pickled_reply(self, data: bytes, buffers: list[memoryview]) -> Frame:
        """:meth:`encode_reply` of a value pickled already."""
        return encode_pickled(data, buffers, lent=self._lent)

    def has_releases(self) -> bool:
        """Whether segments of the peer were let go of since our last frame told it."""
        return bool(self._releases)

    def forwarding(self) -> bool:
        """Whether the peer still holds segments we passed on to it (see ``keep``)."""
        return bool(self._forwarded)

    def _settle(self, frame: Frame) -> None:
        # A segment we still map can still change under the peer's tensors: copy its bytes instead.
        copies: list[tuple[int, memoryview]] = []
        for i, offset in frame.by_reference:
            seg_id, at, size = frame.table[3 * i : 3 * i + 3]
            lent = self._lent.get(seg_id)  # a finalizer may remove it at any time
            mapping = lent.mapping() if lent is not None else None
            if mapping is not None:
                copies.append((offset, memoryview(mapping)[at : at + size]))
                frame.table[3 * i : 3 * i + 2] = (0, offset)
        frame.by_reference = []
        if copies:
            copy_into(frame, copies, 1)

    def send_frame(self, frame: Frame, call_id: int = 0) -> None:
        """Send ``frame``, after the frames held back (:meth:`hold_frame`): frames always leave in
        the order they were given."""
        self.flush()
        self.write(*self.prepare(frame, call_id))

    def prepare(self, frame: Frame, call_id: int = 0) -> tuple[bytes, list[int]]:
        """``frame`` as it goes on the wire: its bytes and the descriptors that go with them (none
        for a :func:`small` frame). Frames must be written in the order they were prepared (the
        header reports the segments we let go of since the previous one)."""
        if frame.by_reference:
            self._settle(frame)
        releases = self._releases
        n = len(releases)
        released = struct.pack(f"<{n}Q", *(releases.popleft() for _ in range(n))) if n else b""
        seg = frame.segment
        table = frame.packed_table
        header = HEADER.pack(
            call_id,
            seg.id if seg else 0,
            seg.size if seg else 0,
            len(table) + len(frame.data),
            frame.num_buffers,
            n,
            len(frame.forwards),
            frame.flags,
        )
        if small(frame):  # one write, no descriptor (most small messages)
            return b"".join((header, released, table, frame.data)), []
        forwards = b"".join(FORWARD.pack(forward_id, size) for forward_id, size, _, _ in frame.forwards)
        fds = [fd for _, _, fd, _ in frame.forwards]
        if seg is not None:
            fds.insert(0, seg.fd)
            frame.unsent -= 1
            with self._leased_lock:
                self._leased[seg.id] += 1
        for forward_id, _, _, mapping in frame.forwards:
            self._forwarded[forward_id] = mapping
        return b"".join((header, released, forwards, table, frame.data)), fds

    def take_held_and(self, frame: Frame, call_id: int = 0) -> bytes:
        """The bytes of the frames held back (no longer held), then of :func:`small` ``frame``."""
        data = self.prepare(frame, call_id)[0]
        return self.take_held() + data if self._held else data

    def hold_frame(self, frame: Frame, call_id: int = 0) -> None:
        """Prepare a :func:`small` frame and hold it back, to go out with the next write."""
        data = self.prepare(frame, call_id)[0]
        self._held.append(data)
        self._held_bytes += len(data)

    def flush(self) -> None:
        """Send the frames held back by :meth:`hold_frame`."""
        data = self.take_held()
        if data:
            self.write(data)

    def take_held(self) -> bytes:
        """The bytes of the frames held back, which are no longer held: for a sender that writes
        them (:meth:`write`) outside the lock that orders its frames, while other threads hold more."""
        held = self._held
        if not held:
            return b""
        data = held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        self._held_bytes = 0
        return data

    def write(self, data: bytes, fds: list[int] | None = None) -> None:
        """Write prepared bytes (``fds`` go with the first of them). With ``when_full``, a write
        that finds the socket full calls it and tries again, instead of blocking."""
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        if self.when_full is None:
            sent = self.sock.sendmsg([data], ancillary) if ancillary else self.sock.send(data)
            if sent < len(data):
                self.sock.sendall(memoryview(data)[sent:])
            return
        rest: bytes | memoryview = data
        while True:
            try:
                if ancillary:
                    sent = self.sock.sendmsg([rest], ancillary, socket.MSG_DONTWAIT)
                else:
                    sent = self.sock.send(rest, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            if sent == len(rest):
                return
            if sent:
                rest, ancillary = memoryview(rest)[sent:], []  # the descriptors went with the first byte
            self.when_full()

    def holding(self) -> bool:
        """Whether frames are held back, waiting for :meth:`flush`."""
        return bool(self._held)

    def holding_enough(self) -> bool:
        """Whether the frames held back fill what the peer reads at once: time to send them."""
        return self._held_bytes >= _READ_AHEAD

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
        call_id, body, buffers, _ = self.recv_sealed()
        return call_id, body, buffers

    def recv_sealed(self) -> tuple[int, memoryview, list[Any], list[Any]]:
        """:meth:`recv_raw`, and the same buffers as they may be passed on: on a channel that
        keeps segments (``keep``), views of a second mapping of each segment the peer sent, which
        no value of this process is built on (the buffers to read are copy-on-write): nothing may
        write to them; elsewhere, the buffers to read themselves."""
        while self._end - self._start < HEADER.size:
            self._fill()
        call_id, seg_id, seg_size, body_len, num_buffers, num_releases, num_forwards, flags = (
            HEADER.unpack_from(self._buffer, self._start)
        )
        prefix = 8 * num_releases + FORWARD.size * num_forwards
        rest = memoryview(self._take(self._start + HEADER.size, prefix + body_len))
        body = rest[prefix:]
        view, sealed = self._map(self._next_fd(seg_id), seg_id, seg_size, flags) if seg_id else (None, None)
        forwarded = []
        for k in range(num_forwards):
            forward_id, size = FORWARD.unpack_from(rest, 8 * num_releases + FORWARD.size * k)
            forwarded.append(self._map_forwarded(self._next_fd(forward_id), forward_id, size))
        buffers: list[Any] = []
        pass_on = buffers
        if num_buffers:
            table = struct.unpack_from(f"<{3 * num_buffers}Q", body)
            if sealed is not None and sealed is not view:
                pass_on = [
                    sealed[offset : offset + size] if where == 0 else None
                    for where, offset, size in zip(table[0::3], table[1::3], table[2::3])
                ]
            for where, offset, size in zip(table[0::3], table[1::3], table[2::3]):
                if where == 0 and view is not None:
                    buffers.append(view[offset : offset + size])
                elif where & FORWARDED:
                    buffers.append(forwarded[where & ~FORWARDED][offset : offset + size])
                else:  # our own bytes, handed back: leased before the releases below can free them
                    buffers.append(pool().borrow(where, offset, size))
        if num_releases:
            for released in struct.unpack_from(f"<{num_releases}Q", rest):
                if released & FORWARDED:  # the peer let go of a segment we passed on: so do we
                    self._forwarded.pop(released & ~FORWARDED, None)
                else:
                    with self._leased_lock:
                        self._leased[released] -= 1
                    pool().release(released)
        if pass_on is not buffers:  # bytes not in the peer's own segment: passed on as they are read
            pass_on = [b if p is None else p for b, p in zip(buffers, pass_on)]
        return call_id, body[ENTRY * num_buffers :], buffers, pass_on

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

    def _map(self, fd: int, seg_id: int, size: int, flags: int) -> tuple[memoryview, memoryview]:
        """Map a segment the peer sent: the view to read, and the view to pass on (the same one,
        but on a channel that keeps segments)."""
        if self.keep is not None and not flags & SHARED_BY_MANY:
            return self._map_kept(fd, seg_id, size)
        try:
            if flags & SHARED_BY_MANY:  # others read the same pages: our writes must stay ours
                mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
            else:  # a worker reads what it is sent (its arguments): map every page at once
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                address = np.frombuffer(mm, dtype=np.uint8).ctypes.data
                self._lent[seg_id] = Lent(address, size, weakref.ref(mm))
        finally:
            os.close(fd)
        # When the last tensor on this mapping is gone, tell the sender it may reuse the segment.
        weakref.finalize(mm, _unmapped, self._releases, self._lent, seg_id)
        view = memoryview(mm)
        return view, view

    def _map_kept(self, fd: int, seg_id: int, size: int) -> tuple[memoryview, memoryview]:
        """The controller's two mappings of a worker's segment: copy-on-write for the values it
        reads, which their user may write to (the writes stay in this process), and one for
        passing the bytes on (``forward=``) that no value here is built on, so that what another
        worker is sent is what the sender wrote. (Not ``PROT_READ``: a read-only buffer would be
        pickled as read-only, and the receiver would copy it to get tensors it may write to.)
        Neither is populated: the controller often only passes a result on or reads part of it,
        and populating and unmapping pages it never reads was most of its CPU for a big result
        handed to another group (docs/benchmarks-log.md, "Where the bytes go")."""
        kept = False
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
            sealed = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            address = np.frombuffer(sealed, dtype=np.uint8).ctypes.data
            self._lent[seg_id] = Lent(address, size, weakref.ref(sealed))
            kept = self.keep is not None and self.keep.keep(address, size, sealed, fd)
        finally:
            if not kept:
                os.close(fd)
        # The mapping to pass on lives as long as the values' one (the segment must not be reused
        # under pages not yet copied), and when it goes, the sender may reuse the segment.
        weakref.finalize(mm, _keep_alive, sealed)
        weakref.finalize(sealed, _unmapped, self._releases, self._lent, seg_id)
        return memoryview(mm), memoryview(sealed)

    def _map_forwarded(self, fd: int, forward_id: int, size: int) -> memoryview:
        """Map a segment another peer sent to ours, copy-on-write: what we write stays ours."""
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
        finally:
            os.close(fd)
        weakref.finalize(mm, self._releases.append, forward_id | FORWARDED)
        return memoryview(mm)

    def _recv_exact(self, view: memoryview) -> None:
        while view.nbytes:
            n = self.sock.recv_into(view, view.nbytes, socket.MSG_WAITALL)
            if n == 0:
                raise EOFError("peer closed the connection mid-message")
            view = view[n:]

    def close(self) -> None:
        """Close the socket and take back every segment the peer still held."""
        with self._leased_lock:
            leased = dict(self._leased)
            self._leased.clear()
        for seg_id, count in leased.items():
            if count > 0:
                pool().release(seg_id, count)
        self._forwarded.clear()  # our mappings go, and with them our leases on the senders' segments
        while self._fds:
            os.close(self._fds.popleft())
        self.sock.close()


def _keep_alive(mapping: mmap.mmap) -> None:
    """Nothing: a finalizer's argument lives as long as the object it watches."""


def _unmapped(releases: collections.deque[int], lent: dict[int, Lent], seg_id: int) -> None:
    lent.pop(seg_id, None)
    releases.append(seg_id)
