"""The channel under the process backend (and Ray's link): frames read ahead stay in order."""

from __future__ import annotations

import select
import socket

import numpy as np
import pytest

from spmdcall.backends import channel


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


def test_a_peer_gone_mid_frame_is_an_eof_not_a_hang():
    a, b = socket.socketpair()
    receiver = channel.Channel(b)
    frame = channel.encode(list(range(1000)))
    header = channel._HEADER.pack(1, 0, 0, len(frame.data), 0, 0, 0)
    a.sendall(header + frame.data[: len(frame.data) // 2])
    a.close()
    with pytest.raises(EOFError, match="mid-message"):
        receiver.recv()
    receiver.close()
