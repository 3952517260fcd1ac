"""The channel under the process backend (and Ray's link): frames read ahead stay in order."""

from __future__ import annotations

import select
import socket

import numpy as np
import pytest

from spmdcall.transport import channel, frames, segments
from spmdcall.transport.envelope import Envelope


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    sender, receiver = channel.Channel(a), channel.Channel(b)
    yield sender, receiver
    sender.close()
    receiver.close()


def test_frames_sent_before_a_read_come_out_one_by_one_in_order(pair):
    sender, receiver = pair
    big_inline = list(range(40_000))  # pickled in the frame itself, several times the read-ahead
    values = [
        ("small", 1),
        {"array": np.arange(1 << 15, dtype=np.float32)},  # 128 KiB: a shared segment and its descriptor
        ("small", 2),
        big_inline,
        {"array": np.full(1 << 15, 7.0, dtype=np.float32)},
        ("small", 3),
    ]
    for call_id, value in enumerate(values, start=1):
        sender.send(value, call_id)

    got = [receiver.recv() for _ in values]

    assert [call_id for call_id, _ in got] == list(range(1, len(values) + 1))
    assert got[0][1] == ("small", 1) and got[2][1] == ("small", 2) and got[5][1] == ("small", 3)
    np.testing.assert_array_equal(got[1][1]["array"], np.arange(1 << 15, dtype=np.float32))
    assert got[3][1] == big_inline
    np.testing.assert_array_equal(got[4][1]["array"], np.full(1 << 15, 7.0, dtype=np.float32))
    assert not receiver.buffered()


def test_buffered_says_so_when_the_socket_no_longer_does(pair):
    sender, receiver = pair
    sender.send("first", 1)
    sender.send("second", 2)
    assert receiver.recv() == (1, "first")

    # Both frames came in with one read: the second waits in the channel, not in the socket.
    assert receiver.buffered()
    assert not select.select([receiver.fileno()], [], [], 0)[0]
    assert receiver.recv() == (2, "second")
    assert not receiver.buffered()


def test_held_frames_wait_for_a_flush_and_keep_their_place_before_later_ones(pair):
    sender, receiver = pair
    for call_id in (1, 2, 3):
        sender.hold_frame(frames.encode(("small", call_id)), call_id)
    assert sender.holding()
    assert not select.select([receiver.fileno()], [], [], 0)[0]  # nothing sent yet

    # A frame that carries a segment (a descriptor) sends the held ones first.
    sender.send({"array": np.arange(1 << 15, dtype=np.float32)}, 4)
    assert not sender.holding()
    got = [receiver.recv() for _ in range(4)]
    assert [call_id for call_id, _ in got] == [1, 2, 3, 4]
    assert [value for _, value in got[:3]] == [("small", 1), ("small", 2), ("small", 3)]
    np.testing.assert_array_equal(got[3][1]["array"], np.arange(1 << 15, dtype=np.float32))

    sender.hold_frame(frames.encode("held"), 5)
    sender.send("not held", 6)  # a small frame sent, not held, goes after the held one
    sender.hold_frame(frames.encode("flushed"), 7)
    sender.flush()
    assert [receiver.recv() for _ in range(3)] == [(5, "held"), (6, "not held"), (7, "flushed")]


def test_a_peer_gone_mid_frame_is_an_eof_not_a_hang():
    a, b = socket.socketpair()
    receiver = channel.Channel(b)
    frame = channel.encode(list(range(1000)))
    header = frames.HEADER.pack(1, 0, 0, len(frame.data), 0, 0, 0, 0)
    a.sendall(header + frame.data[: len(frame.data) // 2])
    a.close()
    with pytest.raises(EOFError, match="mid-message"):
        receiver.recv()
    receiver.close()


def test_forwarded_segments_pass_on_copy_on_write_and_their_descriptors_close():
    """Three parties in one process: a worker's channel, the controller's end of it (keeping
    descriptors) and the controller's channel to another worker. Bytes received in up to
    _MAX_FORWARDS segments go on with those segments, any more are copied; the last receiver's
    writes stay its own; every kept descriptor closes once the mappings are gone."""
    import gc
    import os

    def forward_round() -> int:
        """One round; the number of open descriptors after it (the pool's free segments, reused
        by the next round, keep theirs)."""
        sockets = socket.socketpair(), socket.socketpair()
        worker = channel.Channel(sockets[0][0])
        kept = frames.KeptSegments()
        from_worker = channel.Channel(sockets[0][1], keep=kept)
        to_other, other = channel.Channel(sockets[1][0]), channel.Channel(sockets[1][1])
        num = frames.MAX_FORWARDS + 2
        sent = [np.full(64 * 1024, i, dtype=np.float32) for i in range(num)]  # 256 KiB: a segment each
        for array in sent:
            worker.send(array)
        sealed = [Envelope(*from_worker.recv_sealed()[1:]) for _ in range(num)]
        received = [s.open() for s in sealed]
        for r in received:
            r += 100  # the controller's own values are copy-on-write: what goes on stays as sent

        frame = channel.encode(sealed, forward=kept)
        assert len(frame.forwards) == frames.MAX_FORWARDS and frame.segment is not None  # 2 copied
        to_other.send_frame(frame)
        frame.discard()
        got = [e.open() for e in other.recv()[1]]
        assert all(np.array_equal(g, s) for g, s in zip(got, sent))
        for g in got:
            g += 1  # copy-on-write: the controller's bytes (and the worker's) stay as they were
        assert all(np.array_equal(r, s + 100) for r, s in zip(received, sent))
        copied = frames.encode(received, forward=kept)
        assert copied.forwards == []  # the values read here are never passed on: they are copied
        copied.discard()

        del got, g, received, frame, sealed, r, copied
        gc.collect()
        assert len(to_other._forwarded) == frames.MAX_FORWARDS  # until the other worker says so
        other.send(None)  # its next frame tells the controller that it let go
        assert to_other.recv()[1] is None and to_other._forwarded == {}
        assert kept.snapshot() == {}
        for ch in (worker, from_worker, to_other, other):
            ch.close()
        return len(os.listdir("/proc/self/fd"))

    assert forward_round() == forward_round()


def test_a_segment_is_reused_for_a_payload_of_at_least_half_its_size():
    """Taking a big free segment for a small payload leaves the next big payload a new segment to
    make (every page faulted in): with 4 ranks of 64 MiB and a 256 MiB result, that happened on
    every call once the pool was full."""
    mib = 1 << 20
    pool = segments.SegmentPool()
    big = pool.acquire(4 * mib, 1)
    pool.release(big.id)
    small = pool.acquire(mib + 1, 1)  # 4 MiB would waste more than half: a new one
    assert small.id != big.id and small.size < 4 * mib
    half = pool.acquire(2 * mib, 1)
    assert half.id == big.id  # half of it used: reused
    assert pool.stats() == {"segments": 2, "free": 0, "bytes": 4 * mib + small.size}
    pool.max_free_bytes = 0  # closes them as they come back
    for seg in (small, half):
        pool.release(seg.id)
    assert pool.stats() == {"segments": 0, "free": 0, "bytes": 0}


def test_beyond_the_kept_descriptors_bytes_are_copied(monkeypatch):
    """A received segment whose descriptor was not kept (the cap is reached) cannot be passed on:
    a frame encoded with forward=that table copies its bytes, which arrive all the same."""
    monkeypatch.setattr(frames, "MAX_KEPT_DESCRIPTORS", 0)
    sockets = socket.socketpair(), socket.socketpair()
    worker = channel.Channel(sockets[0][0])
    kept = frames.KeptSegments()
    from_worker = channel.Channel(sockets[0][1], keep=kept)
    to_other, other = channel.Channel(sockets[1][0]), channel.Channel(sockets[1][1])
    sent = np.arange(64 * 1024, dtype=np.float32)
    worker.send(sent)
    received = from_worker.recv()[1]
    assert kept.snapshot() == {}
    frame = channel.encode(received, forward=kept)
    assert frame.forwards == [] and frame.segment is not None
    to_other.send_frame(frame)
    frame.discard()
    assert np.array_equal(other.recv()[1], sent)
    for ch in (worker, from_worker, to_other, other):
        ch.close()
