"""The ``ray`` backend's controller side of one rank: the state of its actor, and the futures of its calls.

A future holds the ObjectRef of the call's reply. Any thread may wait on it (``settle_all``): the
reply is fetched with ``ray.get`` and recorded once, under one lock, whichever thread fetched it;
a reply that names a frame on the rank's shared-memory link is read from the link then. Ray's
errors become the errors every backend raises (``WorkerError``, ``WorkerDiedError``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from spmdcall.backends.ray.actor import ResultNotPicklable, is_linked, unpack_linked_reply, unpack_reply
from spmdcall.errors import CallTimeoutError, WorkerDiedError, WorkerError
from spmdcall.runtime.reports import ReportClient
from spmdcall.transport.envelope import Opened
from spmdcall.transport.link import Link

# How often a wait with a deadline wakes up to check it (Ray reports a dead actor through its futures).
_POLL_S = 0.2
# Recording a reply: once per future, by whichever thread fetched it first.
_settling = threading.Lock()


@dataclass(eq=False)
class RankState:
    """The controller's state of one rank's current actor (a restart makes a new one)."""

    actor: Any
    name: str
    generation: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    died: WorkerDiedError | None = None
    link: Link | None = None  # the shared-memory link, for an actor on the controller's node
    # Sending a call (its linked frames, then its task) is one step, so that calls reach the actor
    # in the order their frames are on the link; ``next_seq`` numbers the calls of an async actor.
    submit_lock: threading.Lock = field(default_factory=threading.Lock)
    next_seq: int = 0
    ready: threading.Event = field(default_factory=threading.Event)  # built its worker class (or failed to)
    reports: ReportClient | None = None  # the actor's reporter (runtime/reports.py)

    def unlink(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.reports is not None:
            self.reports.close()
            self.reports = None


class RayFuture:
    """The pending result of one call; ``object_ref`` is the Ray ObjectRef of its reply
    (``ray_actor.pack_reply``), or of the plain result of a control call (``control=True``)."""

    __slots__ = (
        "rank",
        "method",
        "object_ref",
        "control",
        "_worker",
        "_state",
        "_value",
        "_times",
        "linked",
        "came_linked",
    )

    def __init__(
        self,
        worker: RankState,
        rank: int,
        method: str,
        object_ref: Any,
        control: bool = False,
        linked: bool = False,
    ):
        self.rank, self.method, self.object_ref, self.control = rank, method, object_ref, control
        self.linked = linked  # sent to a rank with a link: its result may come back over it
        self.came_linked = False
        self._worker = worker
        self._state = "pending"  # -> "ok" | "error"
        self._value: Any = None  # the result, sealed (an Envelope; a control call's: Opened)
        self._times = (0, 0)  # worker-side start and end of the call

    def done(self) -> bool:
        return self._state != "pending" or bool(ray.wait([self.object_ref], timeout=0)[0])

    def result(self, timeout: float | None = None) -> Any:
        settle_all([self], timeout)
        return self._value.open()

    def exception(self) -> BaseException | None:
        if self._state == "pending" and self.done():
            _settle([self])  # done: fetching the reply does not wait
        return self._value if self._state == "error" else None

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        if self._state != "pending":
            fn(self)
        else:  # Ray's own thread runs it when the reply is there: no thread of ours waits
            self.object_ref.future().add_done_callback(functools.partial(self._reply_came, fn))

    def _reply_came(self, fn: Callable[[Any], None], reply: concurrent.futures.Future) -> None:
        # The reply is in hand already: record it here rather than fetch it again with ray.get.
        try:
            _accept(self, reply.result())
        except Exception as exc:
            _fail(self, exc)
        fn(self)

    @property
    def state(self) -> str:
        """``"pending"``, then ``"ok"`` or ``"error"`` once settled (as ``RankFutureBase.state``)."""
        return self._state

    @property
    def value(self) -> Any:
        """The sealed result when ``"ok"``, the error when ``"error"``, None while pending."""
        return self._value

    @property
    def started_ns(self) -> int:
        return self._times[0]

    @property
    def finished_ns(self) -> int:
        return self._times[1]

    def __repr__(self) -> str:
        return f"RayRankFuture(rank={self.rank}, method={self.method!r}, state={self._state})"


def settle_all(futures: list[RayFuture], timeout: float | None) -> None:
    """Return when every future has its result; raise the first failure as soon as it is known."""
    deadline = None if timeout is None else time.monotonic() + timeout
    swept = False
    while True:
        failed = [f for f in futures if f._state == "error"]
        if failed:
            raise _first_cause(futures, failed)
        pending = [f for f in futures if f._state == "pending"]
        if not pending:
            return
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            if not swept:  # replies already in (a poll waits for all of them): not still running
                swept = True
                ready = set(ray.wait([f.object_ref for f in pending], num_returns=len(pending), timeout=0)[0])
                _settle([f for f in pending if f.object_ref in ready])
                continue
            assert timeout is not None  # there is a deadline only when there is a timeout
            raise CallTimeoutError(pending[0].method, timeout, sorted({f.rank for f in pending}))
        refs = [f.object_ref for f in pending]
        try:
            # One round trip in the common case, like a plain ray.get (which raises at once
            # when one of the results is an error, even while others are still running; Ctrl-C
            # interrupts it too). Without a deadline, no timeout: a timeout has a price of its own.
            if remaining is None:
                replies = ray.get(refs)
            else:
                replies = ray.get(refs, timeout=min(_POLL_S, remaining))
        except ray.exceptions.GetTimeoutError:
            continue
        except Exception:
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
            _settle([f for f in pending if f.object_ref in ready])  # finds and translates the failure
            continue
        for f, reply in zip(pending, replies):
            _accept(f, reply)


_DEATH_GRACE_S = 1.0  # how long a rank's error waits for the news of a peer's death
# What a collective says when its peer process is gone (gloo's TCP pairs, NCCL): only then is a
# rank's error held back for the grace, so a plain exception is raised at once.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL error")


def _first_cause(futures: list[RayFuture], failed: list[RayFuture]) -> BaseException:
    """The error to raise for a call some of whose ranks failed: a rank that died rather than the
    peers whose collectives broke because of it (gloo's "Connection reset by peer" reaches the
    controller before Ray says the actor died), looked for a moment among the ranks still out."""
    pending = [f for f in futures if f._state == "pending"]
    if pending and any(any(m in str(f._value) for m in _PEER_GONE) for f in failed):
        ready = set(
            ray.wait([f.object_ref for f in pending], num_returns=len(pending), timeout=_DEATH_GRACE_S)[0]
        )
        _settle([f for f in pending if f.object_ref in ready])
    died = [f for f in futures if f._state == "error" and isinstance(f._value, WorkerDiedError)]
    return (died or failed)[0]._value


def _settle(futures: list[RayFuture]) -> None:
    """Fetch the results of finished futures (one ray.get for all of them when none failed)."""
    try:
        replies = ray.get([f.object_ref for f in futures])
    except Exception:
        for f in futures:
            try:
                _accept(f, ray.get(f.object_ref))
            except Exception as exc:
                _fail(f, exc)
        return
    for f, reply in zip(futures, replies):
        _accept(f, reply)


def _fail(f: RayFuture, exc: Exception) -> None:
    with _settling:
        if f._state == "pending":
            f._value, f._state = _translate(exc, f), "error"


def _accept(f: RayFuture, reply: Any) -> None:
    """Record the reply of ``f``, once (several threads may fetch the same reply)."""
    with _settling:
        if f._state == "pending":
            _accept_reply(f, reply)


def _accept_reply(f: RayFuture, reply: Any) -> None:
    if f.control:
        f._value = Opened(reply)  # a control call (locate, setup, ...) returns its value as is
    elif is_linked(reply):
        link = f._worker.link
        try:
            if link is None:
                raise EOFError("it was closed")
            envelope, started, finished = unpack_linked_reply(reply, link)
        except (EOFError, OSError) as exc:
            f._worker.unlink()
            f._value, f._state = (
                WorkerDiedError(f.rank, f.method, f"its shared-memory link broke: {exc}"),
                "error",
            )
            return
        f._value, f._times, f.came_linked = envelope, (started, finished), True
    else:
        envelope, started, finished = unpack_reply(reply)
        f._value, f._times = envelope, (started, finished)
        link = f._worker.link
        if link is not None and link.channel.forwarding():
            # The actor flushed what it let go of on its link before replying through Ray; read
            # it now, so that segments passed on to it go back to the rank that made them.
            on_link(f._worker, Link.drain)
    f._state = "ok"


def _translate(exc: Exception, fut: RayFuture) -> Exception:
    """A Ray exception as the spmdcall error a user expects."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause
        if isinstance(cause, (WorkerError, WorkerDiedError)):
            return cause  # the user's error, or a producer's whose output this call consumed
        if isinstance(cause, ResultNotPicklable):
            return TypeError(str(cause))  # as on every backend
        if isinstance(cause, ray.exceptions.RayError):
            return _translate(cause, fut)  # e.g. the actor that produced an input died
        return WorkerError(
            fut.rank, fut.method, str(exc), type(cause).__name__ if cause is not None else "RayTaskError"
        )
    if isinstance(exc, ray.exceptions.RayActorError):
        own_id = fut._worker.info.get("actor_id")
        if exc.actor_id is not None and own_id is not None and exc.actor_id != own_id:
            return WorkerDiedError(
                fut.rank,
                fut.method,
                f"the Ray actor that produced an input of this call died: {_death_reason(exc)}",
            )
        died = WorkerDiedError(fut.rank, fut.method, _death_detail(exc, fut._worker))
        if fut._worker.died is None:
            fut._worker.died = died  # later calls on this rank fail at once, until restart()
            fut._worker.unlink()
        return died
    if isinstance(exc, ray.exceptions.RayError):
        return WorkerDiedError(fut.rank, fut.method, f"Ray lost the call or its result: {_short(str(exc))}")
    return exc


def on_link(w: RankState, action: Callable[[Link], Any]) -> Any:
    """``action(w.link)``; when the link is broken (its actor died), close it and return None: the
    value goes through the object store, and Ray reports the actor's death through the call."""
    assert w.link is not None
    try:
        return action(w.link)
    except (EOFError, OSError):
        w.unlink()
        return None


def _death_detail(exc: Exception, worker: RankState) -> str:
    where = (
        f"pid {worker.info['pid']} on {worker.info.get('ip', '?')}" if worker.info.get("pid") else "its actor"
    )
    return f"Ray actor {worker.name} ({where}) died: {_death_reason(exc)}"


def _death_reason(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return _short(text.partition("The actor is dead because ")[2].partition(" Some common causes")[0] or text)


def _short(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
