"""What a group's calls moved through the controller: ``WorkerGroup.transfer_stats()``."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from spmdcall.backends import Call
from spmdcall.transport.envelope import Envelope, Opened, Sealed


@dataclass(frozen=True)
class TransferStats:
    """The bytes a group's calls moved through the controller since the group started
    (``WorkerGroup.transfer_stats()``). The controller should move metadata only: arguments it was given
    go to the ranks once (``sent_bytes``), and a ``GroupFuture`` passed into a call goes rank to
    rank (``handed_on_bytes``, which the controller forwards without copying); ``.get()`` brings a
    result to the controller because the user asked (``collected_bytes``). Each byte count is None
    where the group's backend does not count them (``Capabilities.counts_bytes``: ``process`` and
    ``ray`` do).

    Example:
        >>> consumer.score(producer.generate.submit(prompts))  # doctest: +SKIP
        >>> consumer.transfer_stats()  # doctest: +SKIP
        TransferStats(calls=1, sent_bytes=2189, handed_on_bytes=125829120, collected_bytes=5025)
    """

    calls: int
    """Calls made on the group."""
    sent_bytes: int | None
    """Bytes the controller serialised or copied for the calls' arguments (their pickles, and the
    tensors and arrays it copied into the transport); a message several ranks share counts once."""
    handed_on_bytes: int | None
    """Bytes of other groups' results the calls' ranks got straight from the producer ranks: the
    controller passed on where they lie (shared-memory segments, Ray ObjectRefs), not the bytes.
    Counted per message, whole buffers: a rank that takes some rows of a producer's column counts
    the column."""
    collected_bytes: int | None
    """Bytes of the calls' rank results that ``.get()`` brought to the controller (pickles and
    buffers of the outputs it collected)."""


class StatsCounter:
    """A group's running totals behind :class:`TransferStats`; any thread may add to them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = self._sent = self._handed_on = self._collected = 0

    def add_calls(self, calls: list[Call], counts_bytes: bool) -> tuple[int, int]:
        """Count one group call made of ``calls``; its ``(sent_bytes, handed_on_bytes)`` (zeros
        on a backend that does not count bytes: nothing to add up)."""
        sent = handed_on = 0
        if counts_bytes:
            for c in calls:
                sent += c.sent_bytes
                handed_on += c.handed_on_bytes
        with self._lock:
            self._calls += 1
            self._sent += sent
            self._handed_on += handed_on
        return sent, handed_on

    def add_collected(self, sealed: list[Sealed]) -> int:
        """Count the rank results a collect opened on the controller; their bytes."""
        nbytes = sum(sealed_nbytes(s) for s in sealed)
        with self._lock:
            self._collected += nbytes
        return nbytes

    def snapshot(self, counts_bytes: bool) -> TransferStats:
        with self._lock:
            if not counts_bytes:
                return TransferStats(self._calls, None, None, None)
            return TransferStats(self._calls, self._sent, self._handed_on, self._collected)


def sealed_nbytes(sealed: Sealed) -> int:
    """The bytes of one rank result as it came (its pickle and buffers); 0 when not known."""
    if isinstance(sealed, Opened):
        return 0 if sealed.as_sent is None else sealed.as_sent.nbytes
    return sealed.nbytes if isinstance(sealed, Envelope) else 0
