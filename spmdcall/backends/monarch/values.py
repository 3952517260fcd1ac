"""How the arguments of one ``submit`` to a ``monarch`` group travel to its ranks.

Each value is sealed once (``seal_arguments``), however many calls share it. To a rank on the
controller's host, with a shared-memory link, a large value goes as one frame on the link and the
rank is sent its token; to a rank without one, with the group's ``rdma`` on, its buffers are lent
as Monarch RDMA buffers (``monarch_rdma.py``) once, however many ranks read them; any other value
rides inside the Monarch message.
"""

from __future__ import annotations

from typing import Any

from spmdcall import serialize
from spmdcall.backends import Call
from spmdcall.backends.monarch import rdma as rdma_buffers
from spmdcall.backends.monarch.actor import goes_lent, goes_linked, seal
from spmdcall.backends.monarch.futures import RankState
from spmdcall.transport.envelope import Envelope
from spmdcall.transport.frames import Frame, KeptSegments, encode_pickled
from spmdcall.transport.link import Linked

__all__ = ["Outgoing", "seal_arguments"]


class Outgoing:
    """How the values of one ``submit`` travel: to a rank with a link, a large value as one frame
    however many ranks get it (each is sent its token); to one without, with ``rdma``, its buffers
    lent once however many ranks read them; otherwise inside the Monarch message."""

    def __init__(
        self,
        ranks: list[RankState],
        calls: list[Call],
        sealed: dict[int, Envelope],
        kept: KeptSegments,
        rdma: bool,
    ):
        self.sealed, self.kept, self.rdma = sealed, kept, rdma
        self.lent: dict[int, rdma_buffers.Lent] = {}
        self.frames: dict[int, Frame] = {}
        self.receivers: dict[int, int] = {}
        for c in calls:
            if ranks[c.rank].link is None:
                continue
            for v in {id(v): v for v in (*c.args, *c.kwargs.values())}.values():
                if goes_linked(sealed[id(v)]):
                    self.receivers[id(v)] = self.receivers.get(id(v), 0) + 1
        for c in calls:
            link = ranks[c.rank].link
            if link is not None and not link.closed:
                if self.receivers:  # hear which of our segments it let go of, before taking new ones
                    link.drain()
                link.flush()  # tell it which of its segments we let go of

    def sent(self, v: Any, w: RankState) -> Any:
        envelope = self.sealed[id(v)]
        if w.link is not None and not w.link.closed and goes_linked(envelope):
            if id(v) not in self.frames:
                # Results that came over a link, handed on (an Envelope, or the pieces of a
                # hand-off): their bytes go on in the segments they came in, not as a copy. Only
                # bytes as the actors sent them lie in kept segments (Channel.recv_sealed).
                self.frames[id(v)] = encode_pickled(
                    envelope.data, envelope.sent_buffers, receivers=self.receivers[id(v)], forward=self.kept
                )
            token = w.link.send(self.frames[id(v)])
            if token is not None:
                return Linked(token)
        if self.rdma and w.link is None and goes_lent(envelope):
            if id(v) not in self.lent:
                self.lent[id(v)] = rdma_buffers.lend(envelope)
            return self.lent[id(v)]
        return envelope

    def lending(self, count: int) -> rdma_buffers.Lending | None:
        """What the ``count`` calls of this submit borrow (``lent`` as it fills), to drop once they
        have settled; None without ``rdma``."""
        return rdma_buffers.Lending(self.lent, count) if self.rdma else None

    def discard(self) -> None:
        for frame in self.frames.values():
            frame.discard()  # leases of frames that could not be sent


def seal_arguments(calls: list[Call]) -> dict[int, Envelope]:
    """Every argument value sealed, once each however many calls share it; a value that cannot
    be pickled raises ``TypeError`` naming it, before anything is sent."""
    sealed: dict[int, Envelope] = {}
    for c in calls:
        names = [f"argument {i}" for i in range(len(c.args))] + [f"argument {k!r}" for k in c.kwargs]
        for what, v in zip(names, (*c.args, *c.kwargs.values())):
            if id(v) in sealed:
                continue
            try:
                sealed[id(v)] = v if isinstance(v, Envelope) else seal(v)
            except Exception as exc:
                culprit = serialize.describe_unpicklable({what: v}) or f"{what} ({type(v).__name__}): {exc}"
                raise TypeError(f"cannot send {c.method}() to rank {c.rank}: {culprit}") from exc
    return sealed
