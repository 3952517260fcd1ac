"""Results as a backend hands them to the group: sealed, and opened where they are used.

An :class:`Envelope` is a value pickled by ``spmdcall.serialize``: the pickle, and the bytes of its
tensors and arrays as separate buffers. A transport moves the buffers as they are (Ray's object
store keeps them out-of-band; a link's frame puts them in shared memory), and the receiver opens
the envelope. A result that arrived as a value already (a worker's reply read off a channel) is
sealed as :class:`Opened`. Both open the same way, so the group opens every backend's results
alike, and a caller that only reads them (a concatenation, which copies what it keeps) asks for
``open(shared=True)``: buffers that are read-only, such as Ray's object store, are then not copied.
"""

from __future__ import annotations

import pickle
from typing import Any

from spmdcall import serialize


class Envelope:
    """A sealed value: its pickle (``data``) and its out-of-band ``buffers``. ``pass_on``: the
    same bytes where a transport may pass them on to another peer without copying them, in memory
    nothing in this process writes to (a channel's second mapping of the segment they came in:
    ``Channel.recv_sealed``; never opened here); the envelope is pickled with those, so what goes on is what was
    sent, whatever this process did to values opened from ``buffers``. None: ``buffers``.
    ``item``: the value is this item of what the pickle holds (a reply's pickle holds the value
    beside its status and times); None: the pickle is the value."""

    __slots__ = ("data", "buffers", "pass_on", "item")

    def __init__(
        self, data: bytes, buffers: list[Any], pass_on: list[Any] | None = None, item: int | None = None
    ):
        self.data, self.buffers, self.pass_on, self.item = data, buffers, pass_on, item

    @property
    def sent_buffers(self) -> list[Any]:
        """The buffers as they go on (``pass_on``, else ``buffers``)."""
        return self.buffers if self.pass_on is None else self.pass_on

    @classmethod
    def seal(cls, value: Any, *, out_of_band_min_bytes: int = serialize.OUT_OF_BAND_MIN_BYTES) -> Envelope:
        """``value`` pickled; tensors and arrays of ``out_of_band_min_bytes`` or more stay out of band."""
        return cls(*serialize.dumps(value, out_of_band_min_bytes=out_of_band_min_bytes))

    @property
    def nbytes(self) -> int:
        return len(self.data) + sum(memoryview(b).nbytes for b in self.buffers)

    def __reduce__(self) -> tuple:
        # PickleBuffers make a protocol-5 pickler (Ray's) keep each buffer out of band, as it is.
        buffers = map(pickle.PickleBuffer, self.sent_buffers)
        if self.item is None:
            return _unpickle, (self.data, *buffers)
        return _unpickle_item, (self.data, self.item, *buffers)

    def open(self, *, shared: bool = False) -> Any:
        """The value. A read-only buffer (Ray's object store) is copied once, with numpy's allocator
        (huge pages for large copies), so that the value's tensors are writable; with ``shared`` it
        is not, for a caller that only reads the value."""
        if shared:
            value = serialize.loads(self.data, self.buffers, read_only=True)
        else:
            value = serialize.loads(self.data, [_writable(b) for b in self.buffers])
        return value if self.item is None else value[self.item]


class Opened:
    """A result that is a value already (its buffers are this process's to write). ``as_sent``:
    the same result as its rank sent it, sealed, for passing it on unchanged to another rank
    (``spmdcall.group.handoff``), whatever is done to ``value`` meanwhile; None where the backend
    keeps no such form (the value is then passed on as it is)."""

    __slots__ = ("value", "as_sent")

    def __init__(self, value: Any, as_sent: Envelope | None = None):
        self.value, self.as_sent = value, as_sent

    def open(self, *, shared: bool = False) -> Any:
        return self.value


# What a backend's ``wait`` returns for each rank.
Sealed = Envelope | Opened


def _unpickle(data: bytes, *buffers: Any) -> Envelope:
    return Envelope(data, list(buffers))


def _unpickle_item(data: bytes, item: int, *buffers: Any) -> Envelope:
    return Envelope(data, list(buffers), item=item)


def _writable(buffer: Any) -> Any:
    view = memoryview(buffer)
    if not view.readonly:
        return view
    import numpy as np  # only a read-only buffer needs it, and one that arrives has numpy loaded

    return np.frombuffer(view, dtype=np.uint8).copy()
