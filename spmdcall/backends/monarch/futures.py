"""The ``monarch`` backend's controller side of one rank: what it knows of the rank's actor, and
the futures of its calls.

A call's reply is a Monarch ``Handle`` (Monarch 0.7's observe-only handle of a reply: a thread may
``get`` it, asyncio may ``await`` it, and neither consumes it). Whoever needs it first reads it —
a thread that waits for the call, or the backend's loop thread for the calls nobody waits for —
and it is read once (``read_reply``): a reply that names a frame on the rank's shared-memory link
takes that frame then, and one that lends the result's buffers as RDMA buffers (a rank elsewhere)
has them read then, off the loop thread, and tells the rank to give them back. The replies of a
call cast to the whole mesh are gathered by Monarch into one value (a ``ValueMesh``, one
``Handle``), from which each rank's future reads its own (``GatheredReply``). Monarch's errors
become the errors every backend raises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

from spmdcall.backends.futures import RankFutureBase
from spmdcall.backends.monarch.rdma import Lending
from spmdcall.errors import WorkerDiedError, WorkerError
from spmdcall.runtime.reports import ReportClient
from spmdcall.transport.envelope import Envelope
from spmdcall.transport.link import Link

# Seconds a deadline's wait gives the ranks to hand over the replies they kept (``probe_kept``).
PROBE_BUDGET_S = 0.3

__all__ = [
    "PROBE_BUDGET_S",
    "GatheredReply",
    "MonarchFuture",
    "RankState",
    "await_reply",
    "describe",
    "fail_rank",
    "gather_answers",
    "probe_kept",
    "read_reply",
]


@dataclasses.dataclass(eq=False)
class RankState:
    """One rank's actor and what the controller knows of it (a restart makes a new one)."""

    actor: Any  # the rank's one-actor slice of an actor mesh
    procs: Any  # the proc mesh its process belongs to
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    tmp_log: str | None = None  # the Monarch log file where Monarch writes it (logs.py)
    link: Link | None = None
    reports: ReportClient | None = None
    died: WorkerDiedError | None = None
    pending: set[MonarchFuture] = dataclasses.field(default_factory=set)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # sends, in order
    sent: int = 0  # calls sent to it: the next call's number in the rank's sequence
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)


_taking = threading.Lock()  # a reply is read once: the first thread to take it reads it


class MonarchFuture(RankFutureBase):
    """The pending result of one call on one rank. Its reply (a Monarch ``Handle``, which many may
    observe) is read by whoever comes first: a thread that waits for it, or the backend's loop
    thread, which observes the replies nobody waits for (at once for a future with a
    done-callback, else within ``watch_interval``).

    What the backend keeps on it (``backend.py``): ``reply``, the Handle (or ``GatheredReply``) set
    when the call is sent; ``taken``, whether a thread has taken the reply to read it (under
    ``read_reply``'s lock); ``observed``, whether the loop thread awaits it already."""

    __slots__ = ("reply", "_w", "_backend", "taken", "observed", "_lending", "__weakref__")

    def __init__(self, rank: int, method: str, w: RankState, backend: Any, lending: Lending | None = None):
        super().__init__(rank, method)
        self.reply: Any = None
        self._w, self._backend = w, backend
        self.taken = self.observed = False
        self._lending = lending  # the call's arguments lent as RDMA buffers, until it settles

    def settle(self, state: str, value: Any, started_ns: int = 0, finished_ns: int = 0) -> bool:
        settled = super().settle(state, value, started_ns, finished_ns)
        if settled and self._lending is not None:
            self._lending.settled()
        return settled

    def done(self) -> bool:
        if self.state == "pending" and self.reply is not None:
            self._backend.poll(self)
        return self.state != "pending"

    def add_done_callback(self, fn: Any) -> None:
        super().add_done_callback(fn)
        if self.state == "pending":
            self._backend.observe_soon([self])

    def result(self, timeout: float | None = None) -> Any:
        return self._backend.wait([self], timeout)[0].open()


class GatheredReply:
    """One rank's reply to a call cast to the mesh, out of the replies Monarch gathers for it,
    read as a Monarch ``Handle`` is: ``get(timeout)`` (``TimeoutError`` until every rank has
    answered), ``poll()`` (None until then), ``await``. ``seq``: the call's number on the rank,
    by which the rank keeps its own reply (``probe_kept``)."""

    __slots__ = ("_handle", "_rank", "seq", "asked")

    def __init__(self, handle: Any, rank: int, seq: int):
        self._handle, self._rank, self.seq = handle, rank, seq
        self.asked = -1e9  # when the rank was last asked for its kept reply (time.monotonic())

    def get(self, timeout: float) -> Any:
        return self._handle.get(timeout).get(self._rank)

    def poll(self) -> Any:
        replies = self._handle.poll()
        return None if replies is None else replies.get(self._rank)

    def __await__(self) -> Any:
        return self._awaited().__await__()

    async def _awaited(self) -> Any:
        return (await self._handle).get(self._rank)


def probe_kept(futures: list[MonarchFuture], budget: float) -> None:
    """Read the replies that the ranks of ``futures`` (those still pending, of calls cast to the
    mesh) have kept (``RankActor.kept``), waiting at most ``budget`` seconds. Monarch gathers a
    cast's replies, so a rank that has finished waits for the slowest: past a deadline this tells
    the finished ones apart. A rank still running a plain call answers only after it (not in
    time); each future is asked at most once a second."""
    now = time.monotonic()
    asked = []
    for f in futures:
        reply = f.reply
        if (
            f.state == "pending"
            and not f.taken
            and isinstance(reply, GatheredReply)
            and now - reply.asked >= 1.0
        ):
            reply.asked = now
            asked.append((f, f._w.actor.kept.call_one(reply.seq)))
    deadline = now + budget
    for f, answer in asked:
        try:
            kept = answer.get(timeout=max(0.01, deadline - time.monotonic()))
        except Exception:  # no answer in time: the rank still runs a plain call (or it is gone)
            continue
        if kept is not None:
            read_reply(f, kept, None)


def read_reply(future: MonarchFuture, reply: Any, exc: BaseException | None) -> None:
    """Settle ``future`` from its Monarch reply, or from the exception that came instead (any
    thread: the first to take the reply reads it, once, so a linked frame is taken once)."""
    with _taking:
        if future.taken:
            return
        future.taken = True
    w = future._w
    w.pending.discard(future)
    if exc is not None and isinstance(future.reply, GatheredReply):
        # one of the mesh's ranks is gone, not necessarily this one (the watcher, or Monarch's
        # supervision of that rank's own calls, names which)
        future.settle("error", WorkerDiedError(future.rank, future.method, describe(exc)))
        return
    if exc is not None:  # the actor is gone (Monarch's SupervisionError), or Monarch failed
        fail_rank(w, WorkerDiedError(future.rank, future.method, describe(exc)), mark=True)
        return
    kind = reply[0]
    if kind == "pickle":
        future.settle("ok", Envelope(reply[3], []), reply[1], reply[2])
    elif kind == "ok":
        future.settle("ok", reply[3], reply[1], reply[2])
    elif kind == "linked":
        try:
            assert w.link is not None
            envelope = w.link.take_sealed(reply[3])
        except (EOFError, OSError) as error:
            died = WorkerDiedError(future.rank, future.method, f"its link broke: {error}")
            fail_rank(w, died, mark=True)
            future.settle("error", died)
            return
        future.settle("ok", envelope, reply[1], reply[2])
    elif kind == "lent":
        lent = reply[3]
        try:
            envelope = lent.fetch()
        except Exception as error:
            died = WorkerDiedError(future.rank, future.method, f"its result could not be read: {error}")
            fail_rank(w, died, mark=True)
            future.settle("error", died)
            return
        w.actor.release.broadcast(lent.key)
        future.settle("ok", envelope, reply[1], reply[2])
    elif kind == "error":
        future.settle("error", WorkerError(future.rank, future.method, reply[1], reply[2]))
    else:
        future.settle("error", TypeError(reply[1]))


async def await_reply(future: MonarchFuture) -> None:
    try:
        reply = await future.reply
    except Exception as exc:
        read_reply(future, None, exc)
        return
    if reply[0] == "lent":  # its buffers are read with blocking calls: not on the loop's thread
        await asyncio.get_running_loop().run_in_executor(None, read_reply, future, reply, None)
        return
    read_reply(future, reply, None)


def fail_rank(w: RankState, error: WorkerDiedError, *, mark: bool) -> None:
    """Fail every call pending on ``w`` with ``error`` (and, with ``mark``, the later ones too)."""
    if mark and w.died is None:
        w.died = error
    for future in list(w.pending):
        future.settle("error", WorkerDiedError(future.rank, future.method, error.detail))
    w.pending.clear()


def describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"Monarch reports it gone ({type(exc).__name__}: {text[-1] if text else ''})"


async def _awaited(future: Any) -> Any:
    return await future


async def gather_answers(calls: dict[int, Any], out: dict[int, Any], until_error: bool) -> None:
    """Put each rank's answer to ``calls`` into ``out`` as it comes (``MonarchBackend._control``)."""
    tasks = {asyncio.ensure_future(_awaited(f)): r for r, f in calls.items()}
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=tasks.__getitem__):
                r = tasks[task]
                try:
                    out[r] = task.result()
                except Exception as exc:
                    raise WorkerDiedError(r, "__init__", f"it did not start: {exc}") from None
                if until_error and out[r][0] == "error":
                    return
    finally:
        for task in pending:
            task.cancel()
