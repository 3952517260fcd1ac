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
    """A sealed value: its pickle (``data``) and its out-of-band ``buffers``."""

    __slots__ = ("data", "buffers")

    def __init__(self, data: bytes, buffers: list[Any]):
        self.data, self.buffers = data, buffers

    @classmethod
    def seal(cls, value: Any, *, out_of_band_min_bytes: int = serialize.OUT_OF_BAND_MIN_BYTES) -> Envelope:
        """``value`` pickled; tensors and arrays of ``out_of_band_min_bytes`` or more stay out of band."""
        return cls(*serialize.dumps(value, out_of_band_min_bytes=out_of_band_min_bytes))

    @property
    def nbytes(self) -> int:
        return len(self.data) + sum(memoryview(b).nbytes for b in self.buffers)

    def __reduce__(self) -> tuple:
        # PickleBuffers make a protocol-5 pickler (Ray's) keep each buffer out of band, as it is.
        return _unpickle, (self.data, *map(pickle.PickleBuffer, self.buffers))

    def open(self, *, shared: bool = False) -> Any:
        """The value. A read-only buffer (Ray's object store) is copied once, with numpy's allocator
        (huge pages for large copies), so that the value's tensors are writable; with ``shared`` it
        is not, for a caller that only reads the value."""
        if shared:
            return serialize.loads(self.data, self.buffers, read_only=True)
        return serialize.loads(self.data, [_writable(b) for b in self.buffers])


class Opened:
    """A result that is a value already (its buffers are this process's to write)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def open(self, *, shared: bool = False) -> Any:
        return self.value


# What a backend's ``wait`` returns for each rank.
Sealed = Envelope | Opened


def _unpickle(data: bytes, *buffers: Any) -> Envelope:
    return Envelope(data, list(buffers))


def _writable(buffer: Any) -> Any:
    view = memoryview(buffer)
    if not view.readonly:
        return view
    import numpy as np  # only a read-only buffer needs it, and one that arrives has numpy loaded

    return np.frombuffer(view, dtype=np.uint8).copy()
