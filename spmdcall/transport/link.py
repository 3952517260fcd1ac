"""A shared-memory link between the controller and a Ray actor on its own node, beside Ray's own transport.

Through the object store, a tensor is copied four times on its way to a rank and back: into the
store, out of it (so the method may modify it), into the store again, and out of it into the
controller's result. An actor on the controller's node needs none of that: it is connected to the
controller by the ``process`` backend's channel (``channel.py``: shared-memory segments whose
descriptors cross a Unix socket, leased and reused), over an abstract Unix socket, and large values
travel on it. The Ray task then carries a :class:`Linked` token instead of the value: the controller
sends the frame first, then submits the task, and the actor takes the frame with that token from
its link when it runs the call. A large result comes back the same way, as a token in Ray's reply.
Only the controller can read the link, so a future whose result came back over it and is passed
into another group's call is sent on by the controller (``RayBackend._unlinked``).

Results that are views of what the actor received (an echo, a batch with a column added) go back
by reference, as on the ``process`` backend: a 32 MiB echo is one copy into the segment and one
copy out, instead of four.
"""

from __future__ import annotations

import fcntl
import itertools
import socket
import struct
import termios
import threading
import uuid
from typing import Any

from spmdcall.transport.channel import Channel
from spmdcall.transport.envelope import Envelope
from spmdcall.transport.frames import Frame, KeptSegments, encode

_RANK = struct.Struct("<Q")
# Bytes the kernel may count for a frame beyond its pickle and buffer table (header, releases, skb).
_FRAME_OVERHEAD = 4096


class Linked:
    """A task argument whose value is the frame ``token`` on the link."""

    __slots__ = ("token",)

    def __init__(self, token: int):
        self.token = token


class Link:
    """One end of a controller <-> actor link: frames named by increasing tokens, one counter per
    direction. Frames read while looking for another token are kept until they are asked for."""

    def __init__(self, sock: socket.socket, *, keep: KeptSegments | None = None):
        self.channel = Channel(sock, keep=keep)
        self._send_buffer = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        self._tokens = itertools.count(1)
        self._kept: dict[int, tuple[memoryview, list[Any], list[Any]]] = {}
        self._lock = threading.Lock()
        self.closed = False

    def send(self, frame: Frame) -> int | None:
        """Send ``frame`` and return its token; None, sending nothing, when the socket has no room
        for it. The peer reads the link only when it runs a call or collects a result, so a send
        must never wait for it: the value then goes through the object store instead."""
        with self._lock:
            if not self.has_room(len(frame.data), frame.num_buffers):
                return None
            token = next(self._tokens)
            self.channel.send_frame(frame, token)
            return token

    def has_room(self, pickle_bytes: int, num_buffers: int) -> bool:
        """Whether a frame of a pickle and ``num_buffers`` buffers fits in the socket's send buffer
        without blocking, with room to spare for the kernel's own accounting."""
        nbytes = pickle_bytes + 3 * 8 * num_buffers + _FRAME_OVERHEAD
        queued = struct.unpack("i", fcntl.ioctl(self.channel.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        return queued + 2 * nbytes <= self._send_buffer

    def take(self, token: int, *, drop_older: bool = False) -> tuple[memoryview, list[Any]]:
        """The pickle and buffers of frame ``token``, reading the link until it comes.
        ``drop_older``: frames with smaller tokens are left over from calls that failed before
        taking them (the actor's side), so they are dropped instead of kept."""
        with self._lock:
            while token not in self._kept:
                self._read_one()
                if drop_older:
                    for old in [t for t in self._kept if t < token]:
                        del self._kept[old]
            data, buffers, _ = self._kept.pop(token)
            return data, buffers

    def take_sealed(self, token: int) -> Envelope:
        """Frame ``token`` sealed (the controller's side): its buffers to read, and the same
        bytes as they may be passed on (``Envelope.pass_on``, ``Channel.recv_sealed``)."""
        with self._lock:
            while token not in self._kept:
                self._read_one()
            data, buffers, pass_on = self._kept.pop(token)
        return Envelope(bytes(data), buffers, None if pass_on is buffers else pass_on)

    def drain(self) -> None:
        """Read the frames already there (their headers free our segments the peer let go of)."""
        with self._lock:
            while not self.closed and self.channel.readable():
                self._read_one()

    def flush(self) -> None:
        """Tell the peer about its segments we let go of since our last frame (a frame without a
        value), so that it can reuse them even when our replies go through the object store."""
        if self.channel.has_releases():
            frame = encode(None)
            with self._lock:
                self.channel.send_frame(frame, 0)

    def _read_one(self) -> None:
        token, payload, buffers, pass_on = self.channel.recv_sealed()  # EOFError when the peer is gone
        if token:
            self._kept[token] = (payload, buffers, pass_on)

    def close(self) -> None:
        """Close the socket and take back every segment the peer still held."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._kept.clear()
                self.channel.close()


def connect(address: str, rank: int) -> Link:
    """The actor's end: connect to the controller's listening socket and say which rank this is."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        sock.sendall(_RANK.pack(rank))
    except BaseException:
        sock.close()
        raise
    return Link(sock)


def accept(listener: socket.socket, count: int, timeout: float, keep: KeptSegments) -> dict[int, Link]:
    """The controller's ends of ``count`` links whose actors have connected already, by rank."""
    links: dict[int, Link] = {}
    listener.settimeout(timeout)
    try:
        for _ in range(count):
            sock, _ = listener.accept()
            sock.settimeout(timeout)
            head = b""
            while len(head) < _RANK.size:
                chunk = sock.recv(_RANK.size - len(head))
                if not chunk:
                    raise ConnectionError("an actor closed its link before naming its rank")
                head += chunk
            sock.settimeout(None)
            links[_RANK.unpack(head)[0]] = Link(sock, keep=keep)
    except BaseException:
        for link in links.values():
            link.close()
        raise
    return links


def listen(backlog: int) -> tuple[socket.socket, str]:
    """A listening socket with a fresh name in the abstract namespace (nothing on disk to clean up)
    that holds ``backlog`` connections not accepted yet."""
    address = f"\0spmdcall-link-{uuid.uuid4().hex}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address)
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    return listener, address
