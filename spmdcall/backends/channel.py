"""Messages over a Unix socket, with large buffers in shared memory (one memfd per message).

A message is a small frame on the socket — a fixed header, the buffer table and the pickle — and,
when it carries tensors or arrays, one anonymous shared-memory file (``memfd_create``) whose file
descriptor travels with the frame (SCM_RIGHTS). The receiver maps it and rebuilds tensors on top of
the mapping: the bytes are copied once, by the sender. Nothing is ever named in ``/dev/shm``, so a
crash cannot leak a segment: the memory is freed when the last mapping of it goes away.
"""

from __future__ import annotations

import array
import mmap
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from spmdcall import serialize

# call id, pickle length, shared-memory size, number of buffers, flags
_HEADER = struct.Struct("<QQQII")
_SHARED_BY_MANY = 1  # the memfd goes to several receivers: map it copy-on-write
_ALIGN = 64
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault every page in with one call


@dataclass
class Frame:
    """An encoded message, ready to be sent to one or more peers."""

    header: bytes
    fd: int = -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _fill_shared_memory(buffers: list[memoryview]) -> tuple[int, list[int], int]:
    offsets, total = [], 0
    for b in buffers:
        offsets.append(total)
        total += (b.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    fd = os.memfd_create("spmdcall", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        with mmap.mmap(fd, total, flags=mmap.MAP_SHARED) as mm:
            try:
                mm.madvise(_MADV_POPULATE_WRITE)  # one syscall instead of a page fault per page
            except OSError:
                pass
            for off, b in zip(offsets, buffers):
                mm[off : off + b.nbytes] = b
    except BaseException:
        os.close(fd)
        raise
    return fd, offsets, total


def encode(obj: Any, call_id: int = 0, *, receivers: int = 1) -> Frame:
    """Serialise ``obj`` into a frame; tensors and arrays go to shared memory."""
    data, buffers = serialize.dumps(obj)
    fd, offsets, total = _fill_shared_memory(buffers) if buffers else (-1, [], 0)
    flags = _SHARED_BY_MANY if receivers > 1 else 0
    table = struct.pack(f"<{2 * len(buffers)}Q", *offsets, *(b.nbytes for b in buffers))
    return Frame(_HEADER.pack(call_id, len(data), total, len(buffers), flags) + table + data, fd)


class Channel:
    """One end of a controller <-> worker connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_frame(self, frame: Frame) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [frame.fd]))] if frame.fd >= 0 else []
        sent = self.sock.sendmsg([frame.header], anc)
        if sent < len(frame.header):
            self.sock.sendall(memoryview(frame.header)[sent:])

    def send(self, obj: Any, call_id: int = 0) -> None:
        frame = encode(obj, call_id)
        try:
            self.send_frame(frame)
        finally:
            frame.close()

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
        fds = [fd for level, kind, data in anc if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
               for fd in array.array("i", data[: len(data) - len(data) % 4])]
        if n < len(head):
            self._recv_exact(memoryview(head)[n:])
        call_id, data_len, total, num_buffers, flags = _HEADER.unpack(head)
        rest = bytearray(16 * num_buffers + data_len)
        self._recv_exact(memoryview(rest))
        buffers: list[memoryview] = []
        if total:
            if len(fds) != 1:
                raise ConnectionError(f"frame announces {total} bytes of shared memory but carried {len(fds)} descriptors")
            try:
                shared = not (flags & _SHARED_BY_MANY)
                mm = mmap.mmap(fds[0], total, flags=mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE)
            finally:
                os.close(fds[0])
            table = struct.unpack_from(f"<{2 * num_buffers}Q", rest)
            view = memoryview(mm)
            buffers = [view[off : off + size] for off, size in zip(table[:num_buffers], table[num_buffers:])]
        else:
            for fd in fds:
                os.close(fd)
        return call_id, memoryview(rest)[16 * num_buffers :], buffers

    def _recv_exact(self, view: memoryview) -> None:
        while view.nbytes:
            n = self.sock.recv_into(view)
            if n == 0:
                raise EOFError("peer closed the connection mid-message")
            view = view[n:]

    def close(self) -> None:
        self.sock.close()
