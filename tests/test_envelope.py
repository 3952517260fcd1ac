"""Sealed results: an Envelope opens writable (read-only buffers copied once) or shared (not copied)."""

from __future__ import annotations

import numpy as np
import pytest

from spmdcall.transport.envelope import Envelope, Opened

torch = pytest.importorskip("torch")


def read_only(buffers):
    """The buffers as an object store hands them: read-only views."""
    return [memoryview(bytes(b)) for b in buffers]


def test_open_copies_read_only_buffers_so_tensors_are_writable():
    value = {"t": torch.arange(1 << 16, dtype=torch.float32), "a": np.arange(1 << 16)}
    sealed = Envelope.seal(value)
    assert len(sealed.buffers) == 2 and len(sealed.data) < 1024  # the bytes travel out of band
    opened = Envelope(sealed.data, read_only(sealed.buffers)).open()
    assert torch.equal(opened["t"], value["t"]) and np.array_equal(opened["a"], value["a"])
    opened["t"] += 1  # its own memory
    opened["a"] += 1
    assert opened["a"].flags.writeable


def test_open_shared_leaves_read_only_buffers_where_they_are():
    value = {"t": torch.arange(1 << 16, dtype=torch.float32)}
    sealed = Envelope.seal(value)
    buffers = read_only(sealed.buffers)
    shared = Envelope(sealed.data, buffers).open(shared=True)
    assert torch.equal(shared["t"], value["t"])
    where = np.frombuffer(buffers[0], dtype=np.uint8).ctypes.data
    assert shared["t"].data_ptr() == where  # no copy: the tensor is a view of the buffer
    # ... and the default is writable again, in memory of its own
    assert Envelope(sealed.data, buffers).open()["t"].data_ptr() != where


def test_an_envelope_pickles_with_its_buffers_out_of_band():
    import pickle

    sealed = Envelope.seal({"t": torch.ones(1 << 16)})
    out_of_band = []
    data = pickle.dumps(sealed, protocol=5, buffer_callback=out_of_band.append)
    assert len(out_of_band) == 1 and len(data) < 1024
    again = pickle.loads(data, buffers=out_of_band)
    assert torch.equal(again.open()["t"], torch.ones(1 << 16))


def test_opened_hands_back_the_value_it_holds():
    value = [1, 2]
    assert Opened(value).open() is value and Opened(value).open(shared=True) is value
