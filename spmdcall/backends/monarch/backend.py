"""The ``monarch`` backend: every rank is a PyTorch Monarch actor in a process of its own.

    wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Trainer), backend="monarch")

Processes (``this_host().spawn_procs``, or a ``HostMesh`` given as ``host_mesh`` for several
hosts): one proc mesh per node of the pool, one :class:`RankActor` (``actor.py``) per
process, ranks ordered by node then local rank; a restarted rank gets a proc mesh of its own.
Rank 0 reserves ``MASTER_PORT`` on its host for its life (``rendezvous.py``); every rank sets
its SPMD environment before it builds the worker class.

Calls: a call whose arguments are the same on every rank (``ONE_TO_ALL``, none going over a
shared-memory link) goes to the group's actor mesh as one ``cast`` message whose replies Monarch
gathers, as its own ``call()`` does, while the group is the mesh it started as (one host, this
one; no rank restarted); any other call goes to each rank's actor as a ``run`` message of its own
(``call_one`` on the rank's slice of the mesh). The thread that submits a call sends it; each
rank numbers its calls and runs them in the order they were sent, whichever path they came by.
A thread that waits for calls reads their replies itself, as they come (``futures.py``);
the replies nobody waits for are read by a thread of the backend with an asyncio loop — at once
for a future with a done-callback (asyncio, ``GroupFuture``), else within ``watch_interval``.

Data: ranks on the controller's host are connected to it by a shared-memory link
(``transport/link.py``, the ``process`` backend's channel), and large values travel on it; the
Monarch message then carries only the frame's token. To and from ranks on other hosts, with
``rdma`` on, the buffers of large values are lent as Monarch RDMA buffers and read by the receiver
(``monarch_rdma.py``). Other values travel inside Monarch's messages.

Faults: a method's exception is a ``WorkerError`` (rank, method, remote traceback). A rank whose
process dies fails its pending calls with ``WorkerDiedError``: for a rank on this host, as soon
as a watcher thread sees the process gone (every ``watch_interval`` seconds); elsewhere when
Monarch's supervision reports it. Monarch's ``unhandled_fault_hook`` would exit the controller
on such a failure: the backend chains a hook of its own in front of it that keeps the failures
of its own meshes (``faults.py``).

Logs: each rank on this host writes Monarch's log to a file named after the group and the rank,
which ``worker_info()`` names and which is left in a folder of the user's (``log_dir=``, else
``$SPMDCALL_LOG_DIR`` or ``~/.local/state/spmdcall/logs``), not in ``/tmp`` (``logs.py``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import sys
import threading
import time
import uuid
import weakref
from typing import Any

from monarch.actor import this_host

from spmdcall import serialize
from spmdcall.backends import Call, Capabilities
from spmdcall.backends.futures import first_failure, wait_settled
from spmdcall.backends.monarch import faults, logs
from spmdcall.backends.monarch import rdma as rdma_buffers
from spmdcall.backends.monarch.actor import RankActor
from spmdcall.backends.monarch.futures import (
    PROBE_BUDGET_S,
    GatheredReply,
    MonarchFuture,
    RankState,
    await_reply,
    fail_rank,
    gather_answers,
    probe_kept,
    read_reply,
)
from spmdcall.backends.monarch.values import Outgoing, seal_arguments
from spmdcall.errors import CallTimeoutError, WorkerDiedError, WorkerError
from spmdcall.rendezvous import START_ATTEMPTS, PortReservation, log_retry, port_taken
from spmdcall.resource_pool import ResourcePool, contexts_on
from spmdcall.runtime.reports import RankReport, ReportClient, ask_all, reporters, stop_all
from spmdcall.transport import link as shm_link
from spmdcall.transport.envelope import Sealed
from spmdcall.transport.frames import KeptSegments
from spmdcall.transport.segments import lend_out
from spmdcall.worker import ClassWithInitArgs, SPMDContext

__all__ = ["MonarchBackend"]


class MonarchBackend:
    """Workers as PyTorch Monarch actors, one process per rank.

    Args:
        host_mesh: a Monarch ``HostMesh`` with one host per node of the pool (from a Monarch job:
            ``monarch.job``, or ``attach_to_workers``); None: every rank on this host
            (``this_host()``), which only a one-node pool fits.
        start_timeout: seconds for the processes to start and build the worker class.
        shutdown_timeout: seconds ``shutdown`` waits for Monarch to stop the processes before it
            kills those of this host.
        shutdown_grace: the same, by the name ``process`` and ``ray`` give it (seconds a busy
            rank gets at shutdown); when given, it replaces ``shutdown_timeout``.
        env: extra environment variables for every worker.
        shared_memory: move large values to and from ranks on this host through shared memory
            (``transport/link.py``) instead of inside Monarch's messages.
        watch_interval: how often (seconds) a thread looks whether the processes of ranks on
            this host are still there; a dead one fails its calls at once, without waiting for
            Monarch's supervision (about 10 s).
        rdma: how large values go to and from ranks without a shared-memory link (on other hosts,
            or with ``shared_memory=False``): True, their buffers lent as Monarch RDMA buffers and
            read by the receiver; False, inside Monarch's messages; None, RDMA where Monarch finds
            RDMA hardware (ibverbs), not over its TCP fallback, which is slower than its messages.
        log_dir: the folder for the Monarch log files of this host's ranks (each linked there
            while its process runs, and left only there once it is gone) and a link to the
            controller's; None: ``logs.default_dir()`` (``$SPMDCALL_LOG_DIR``, else
            ``~/.local/state/spmdcall/logs``), without the controller's. ``worker_info()`` names
            each rank's file.

    Example:
        >>> wg = WorkerGroup(ResourcePool([2]), ClassWithInitArgs(Trainer), backend="monarch")  # doctest: +SKIP
    """

    name = "monarch"
    capabilities = Capabilities(result_alloc=lend_out, reports=True, cancel=True, env=True, resize=True)
    _kept = KeptSegments()  # segments that came over links, shared by every monarch group here

    def __init__(
        self,
        *,
        host_mesh: Any = None,
        start_timeout: float = 120.0,
        shutdown_timeout: float = 10.0,
        shutdown_grace: float | None = None,
        env: dict[str, str] | None = None,
        shared_memory: bool = True,
        watch_interval: float = 0.2,
        rdma: bool | None = None,
        log_dir: str | os.PathLike | None = None,
    ):
        if shutdown_grace is not None:
            shutdown_timeout = shutdown_grace
        for option, value in (
            ("start_timeout", start_timeout),
            ("shutdown_grace" if shutdown_grace is not None else "shutdown_timeout", shutdown_timeout),
            ("watch_interval", watch_interval),
        ):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{option} must be a positive number of seconds, got {value!r}")
        if rdma not in (None, True, False):
            raise ValueError(f"rdma must be True, False or None (RDMA where there is hardware), got {rdma!r}")
        self.host_mesh = host_mesh
        self.rdma = rdma
        self._rdma = False  # whether large values to ranks without a link are lent (start)
        self.start_timeout = float(start_timeout)
        self.shutdown_timeout = float(shutdown_timeout)
        self.extra_env = dict(env or {})
        self.shared_memory = bool(shared_memory)
        self.watch_interval = float(watch_interval)
        self._own_log_dir = log_dir is not None
        self.log_dir = logs.default_dir() if log_dir is None else os.fspath(log_dir)
        self._ranks: list[RankState] = []
        self._proc_meshes: list[Any] = []
        self._env: list[dict[str, str]] = []
        self._stopped = threading.Event()
        self._finalizer: weakref.finalize | None = None
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._port: PortReservation | None = None
        # Every call's future until the next sweep, by weak reference: one that a thread read and
        # let go of is not kept (nor its result) for the sweep; an unread one is (in its pending set).
        self._unobserved: collections.deque[weakref.ref[MonarchFuture]] = collections.deque()
        # The actor mesh of a one-host group on this host, and its ranks as they started: a call
        # to all of them with the same arguments is cast to the mesh (a restarted rank leaves it).
        self._mesh: Any = None
        self._mesh_ranks: list[RankState] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, pool: ResourcePool, cls_with_init: ClassWithInitArgs, *, group_name: str) -> None:
        if pool.num_nodes > 1 and self.host_mesh is None:
            raise ValueError(
                f"a pool of {pool.num_nodes} nodes ({pool!r}) needs host_mesh=: a Monarch HostMesh "
                "with a host per node (see docs/backends/monarch.md); without one every rank runs here"
            )
        self._payload = serialize.dumps_worker_class(cls_with_init)
        self._rdma = rdma_buffers.wanted(self.rdma)
        self._pool, self._sys_path = pool, list(sys.path)
        label = "".join(ch if ch.isalnum() else "-" for ch in group_name.lower())[:40]
        self._mesh_name = f"spmdcall-{label}-{uuid.uuid4().hex[:8]}"
        faults.install(self._mesh_name)
        self._thread = threading.Thread(target=self._loop.run_forever, name="spmdcall-monarch", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._proc_meshes, self._ranks, self._loop, 2.0)
        try:
            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    self._ranks.extend(self._spawn(pool, attempt - 1))
                    self._setup(list(range(pool.world_size)))
                    break
                except WorkerError as exc:  # rank 0 lost its rendezvous port to another socket: again
                    port = self._contexts[0].master_port if self._ranks else 0
                    if attempt == START_ATTEMPTS or not port_taken(exc, port):
                        raise
                    log_retry(port, attempt)
                    self._discard_start()
            threading.Thread(target=self._watch, name="spmdcall-monarch-watch", daemon=True).start()
        except BaseException:
            self.shutdown()
            raise

    def _discard_start(self) -> None:
        """Stop the processes of a start that failed, to start again."""
        _stop(self._proc_meshes, self._ranks, None, self.shutdown_timeout)
        self._ranks.clear()
        self._proc_meshes.clear()
        self._mesh, self._mesh_ranks = None, []

    def _spawn(self, pool: ResourcePool, generation: int = 0) -> list[RankState]:
        """A proc mesh per node, an actor per process; rank 0 reserves the rendezvous port."""
        ranks: list[RankState] = []
        for node, size in enumerate(pool.process_on_nodes):
            host, command = self._host(node, len(ranks))
            name = f"{self._mesh_name}-n{node}" + (f"-g{generation}" if generation else "")
            procs = host.spawn_procs(per_host={"procs": size}, name=name, bootstrap_command=command)
            self._proc_meshes.append(procs)
            actors = procs.spawn(self._mesh_name, RankActor)
            ranks.extend(RankState(actors.slice(procs=i), procs) for i in range(size))
        where = self._control({r: w.actor.locate.call_one(r, r == 0) for r, w in enumerate(ranks)}, ranks)
        for r, w in enumerate(ranks):
            w.info = {"rank": r, **where[r]}
        self._link_logs(ranks, controller=True)
        here = all(i["host"] == socket.gethostname() for i in where.values())
        if here and pool.num_nodes == 1:
            self._mesh, self._mesh_ranks = actors, list(ranks)
        self._contexts = pool.contexts("127.0.0.1" if here else where[0]["ip"], where[0]["port"])
        self._env = [{**self.extra_env, **ctx.env()} for ctx in self._contexts]
        for env, ctx in zip(self._env, self._contexts):  # like torchrun: ranks of a host share its cores
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ctx.local_world_size)))
        return ranks

    def _host(self, node: int, first_rank: int, name: str | None = None) -> tuple[Any, Any]:
        """Where the processes of ``node`` start, and their bootstrap command: on this host,
        Monarch's own with each rank's log file named (``logs.py``); on the hosts of a
        ``host_mesh``, Monarch's (None), which knows how that host starts Python."""
        if self.host_mesh is None:
            return this_host(), logs.bootstrap(name or self._mesh_name, first_rank)
        return self.host_mesh.slice(hosts=node), None

    def _link_logs(self, ranks: list[RankState], *, controller: bool = False) -> None:
        """Link the Monarch logs of ``ranks`` on this host into ``log_dir``; each rank's
        ``info["monarch_log"]`` then names the link (and, with a ``log_dir`` of the user's, the
        controller's own log is linked there too)."""
        if controller and self._own_log_dir:
            logs.link(logs.own_log_path(), self.log_dir, "monarch-controller.log")
        for w in ranks:
            if w.info.get("host") == socket.gethostname():
                w.tmp_log = w.info.get("monarch_log")
                w.info["monarch_log"] = logs.link(w.tmp_log, self.log_dir, logs.link_name(w.tmp_log))

    def _setup(self, ranks: list[int]) -> None:
        """Build the worker class on ``ranks`` (their actors are new) and link the local ones.
        Calls made meanwhile (by other threads) wait until their rank is ready."""
        local = [
            r for r in ranks if self.shared_memory and self._ranks[r].info["host"] == socket.gethostname()
        ]
        listener, address = shm_link.listen(max(1, len(local)))
        try:
            with listener:
                calls = {
                    r: self._ranks[r].actor.setup.call_one(
                        self._env[r],
                        self._sys_path,
                        self._payload,
                        address if r in local else None,
                        self._rdma,
                    )
                    for r in ranks
                }
                answers = self._control(calls, self._ranks, until_error=True)
                for r, answer in sorted(answers.items()):
                    if answer[0] == "error":
                        raise WorkerError(r, "__init__", answer[1], answer[2])
                linked = [r for r in local if answers[r][1]["link_error"] is None]
                links = shm_link.accept(listener, len(linked), self.start_timeout, self._kept)
            for r in ranks:
                w = self._ranks[r]
                host, port, token = answers[r][1]["reporter"]
                w.reports = ReportClient(address=(host, port), token=token)
                w.link = links.get(r)
                w.info["shared_memory"] = w.link is not None
                w.info["rdma"] = w.link is None and self._rdma
        except BaseException as exc:
            for r in ranks:
                if self._ranks[r].died is None:
                    self._ranks[r].died = WorkerDiedError(r, "__init__", f"it did not start: {exc}")
            raise
        finally:
            for r in ranks:
                self._ranks[r].ready.set()

    def _control(
        self, calls: dict[int, Any], ranks: list[RankState], *, until_error: bool = False
    ) -> dict[int, Any]:
        """The answers of control calls (a Monarch future per rank) within ``start_timeout``; with
        ``until_error``, only until one is ``("error", ...)``: a rank whose constructor raised is
        not kept waiting for another that waits on it (a rendezvous it will not join)."""
        out: dict[int, Any] = {}
        gathered = asyncio.run_coroutine_threadsafe(gather_answers(calls, out, until_error), self._loop)
        try:
            gathered.result(self.start_timeout)
        except TimeoutError:
            gathered.cancel()
            r = min(set(calls) - set(out))
            raise WorkerDiedError(
                r, "__init__", f"it did not start within {self.start_timeout:g} s"
            ) from None
        return out

    def restart(self, ranks: list[int] | None) -> None:
        if ranks is None:
            ranks = [r for r, w in enumerate(self._ranks) if w.died is not None]
        for rank in ranks:
            old = self._ranks[rank]
            old.ready.clear()
            fail_rank(old, WorkerDiedError(rank, None, "the rank was restarted"), mark=False)
            _close_rank(old)
            _kill_local(old)
            logs.settle(old.tmp_log, old.info.get("monarch_log"))
            name = f"{self._mesh_name}-r{rank}-{uuid.uuid4().hex[:6]}"
            host, command = self._host(self._contexts[rank].node_rank, rank, name)
            procs = host.spawn_procs(per_host={"procs": 1}, name=name, bootstrap_command=command)
            self._proc_meshes.append(procs)
            new = RankState(procs.spawn(self._mesh_name, RankActor).slice(procs=0), procs)
            new.ready.clear()
            self._ranks[rank] = new
            where = self._control({rank: new.actor.locate.call_one(rank, False)}, self._ranks)[rank]
            new.info = {"rank": rank, **where}
            self._link_logs([new])
        if ranks:
            self._setup(list(ranks))

    def resize(self, keep: list[int], num_new: int, *, timeout: float | None) -> list[SPMDContext]:
        """Keep the ranks ``keep`` (renumbered in that order), stop the others once the calls
        pending on them are done (or ``timeout`` has passed), start ``num_new`` after them, in a
        proc mesh of their own on the last rank's host (``Capabilities.resize``). A new rank 0
        reserves the rendezvous port. Calls then go rank by rank (no cast to the first mesh)."""
        gone = {r: w for r, w in enumerate(self._ranks) if r not in set(keep)}
        deadline = None if timeout is None else time.monotonic() + timeout
        for future in [f for w in gone.values() for f in list(w.pending)]:
            try:
                self.wait([future], None if deadline is None else max(0.0, deadline - time.monotonic()))
            except CallTimeoutError:
                break
            except (WorkerError, WorkerDiedError):
                pass  # done: its caller gets the error
        for r, w in gone.items():
            fail_rank(w, WorkerDiedError(r, None, "the rank was stopped by a resize of its group"), mark=True)
            _close_rank(w)
            _kill_local(w)
            logs.settle(w.tmp_log, w.info.get("monarch_log"))
        node = self._contexts[-1].node_rank
        self._ranks[:] = [self._ranks[r] for r in keep]  # the same list: the finalizer stops what it holds
        self._env = [self._env[r] for r in keep]
        self._mesh, self._mesh_ranks = None, []
        size = len(keep) + num_new
        if num_new:
            name = f"{self._mesh_name}-j{uuid.uuid4().hex[:6]}"
            host, command = self._host(node, len(keep), name)
            procs = host.spawn_procs(per_host={"procs": num_new}, name=name, bootstrap_command=command)
            self._proc_meshes.append(procs)
            actors = procs.spawn(self._mesh_name, RankActor)
            self._ranks.extend(RankState(actors.slice(procs=i), procs) for i in range(num_new))
        # Every rank learns its number (a new rank 0 also reserves the rendezvous port).
        moved = {r: w.actor.locate.call_one(r, r == 0 and keep[0] != 0) for r, w in enumerate(self._ranks)}
        where = self._control(moved, self._ranks)
        for r, w in enumerate(self._ranks):
            w.info = {**w.info, "rank": r, **where[r]} if r < len(keep) else {"rank": r, **where[r]}
        self._link_logs(self._ranks[len(keep) :])
        addr, port = self._contexts[0].master_addr, self._contexts[0].master_port
        if keep[0] != 0:
            addr, port = (
                ("127.0.0.1" if where[0]["host"] == socket.gethostname() else where[0]["ip"]),
                where[0]["port"],
            )
        self._contexts = contexts_on([w.info["host"] for w in self._ranks], addr, port)
        self._env += [dict(self.extra_env) for _ in range(num_new)]
        self._env = [{**env, **ctx.env()} for env, ctx in zip(self._env, self._contexts)]
        for env, ctx in zip(self._env[len(keep) :], self._contexts[len(keep) :]):
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ctx.local_world_size)))
        if num_new:
            self._setup(list(range(len(keep), size)))
        return self._contexts

    def shutdown(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        for r, w in enumerate(self._ranks):
            fail_rank(w, WorkerDiedError(r, None, "the group was shut down"), mark=True)
        if self._finalizer is not None:
            self._finalizer.detach()
        faults.stopping(self._mesh_name)
        _stop(self._proc_meshes, self._ranks, self._loop, self.shutdown_timeout)

    def worker_info(self) -> list[dict[str, Any]]:
        return [dict(w.info) for w in self._ranks]

    def report(self, ranks: list[int], budget_s: float) -> dict[int, RankReport]:
        """Where each of ``ranks`` is, asked of its reporter thread (``runtime/reports.py``), once
        the replies they hold for a call cast to the mesh are read (``probe_kept``)."""
        start = time.monotonic()
        probe_kept(
            [f for r in ranks for f in list(self._ranks[r].pending)], min(PROBE_BUDGET_S, budget_s / 3)
        )
        return ask_all(reporters({r: self._ranks[r] for r in ranks}), budget_s - (time.monotonic() - start))

    def cancel(
        self, ranks: list[int], method: str, max_age_s: float, interrupt: bool, budget_s: float
    ) -> dict:
        """Stop a call of ``method`` on each of ``ranks`` through its reporter thread (a side
        channel that answers while the rank's call thread is busy)."""
        return stop_all(reporters({r: self._ranks[r] for r in ranks}), budget_s, method, max_age_s, interrupt)

    # -- calls -------------------------------------------------------------------------------

    def submit(self, calls: list[Call]) -> list[MonarchFuture]:
        for c in calls:
            w = self._ranks[c.rank]
            if not w.ready.is_set():  # restarted by another thread: wait for it
                w.ready.wait(self.start_timeout)
            if self._stopped.is_set():
                raise WorkerDiedError(c.rank, c.method, "the group was shut down")
            if w.died is not None:
                raise WorkerDiedError(c.rank, c.method, f"{w.died.detail}; call restart() to bring it back")
        sealed = seal_arguments(calls)  # every argument, before anything is sent
        frames = Outgoing(self._ranks, calls, sealed, self._kept, self._rdma)
        if not frames.receivers and self._castable(calls):
            return self._cast(calls, frames)
        futures: list[MonarchFuture] = []
        lending = frames.lending(len(calls))
        try:
            for c in calls:
                w = self._ranks[c.rank]
                future = MonarchFuture(c.rank, c.method, w, self, lending)
                with w.lock:
                    args = tuple(frames.sent(v, w) for v in c.args)
                    kwargs = {k: frames.sent(v, w) for k, v in c.kwargs.items()}
                    w.pending.add(future)
                    # Monarch's Handle of the reply: observed, not consumed, by a thread (get) and
                    # by asyncio (await) alike, so whoever needs the reply first can read it.
                    future.reply = w.actor.run.call_one(w.sent, (c.role, c.method, args, kwargs))._as_handle()
                    w.sent += 1
                self._unobserved.append(weakref.ref(future))
                futures.append(future)
        finally:
            frames.discard()
            if lending is not None:
                for _ in range(len(calls) - len(futures)):
                    lending.settled()  # calls not sent will not settle
        return futures

    def _castable(self, calls: list[Call]) -> bool:
        """Whether ``calls`` are one call to every rank of the mesh, with the same arguments."""
        if self._mesh is None or len(calls) != len(self._mesh_ranks):
            return False
        first = calls[0]
        for r, c in enumerate(calls):
            if c.rank != r or self._ranks[r] is not self._mesh_ranks[r]:
                return False
            if c is not first and (
                c.method != first.method
                or c.role != first.role
                or len(c.args) != len(first.args)
                or c.kwargs.keys() != first.kwargs.keys()
                or any(a is not b for a, b in zip(c.args, first.args))
                or any(v is not first.kwargs[k] for k, v in c.kwargs.items())
            ):
                return False
        return True

    def _cast(self, calls: list[Call], frames: Outgoing) -> list[MonarchFuture]:
        """Send ``calls`` (``_castable``) to the mesh as one message; Monarch gathers the replies."""
        c, ranks = calls[0], self._mesh_ranks
        args = tuple(frames.sent(v, ranks[0]) for v in c.args)
        call = (c.role, c.method, args, {k: frames.sent(v, ranks[0]) for k, v in c.kwargs.items()})
        lending = frames.lending(len(ranks))
        futures = [MonarchFuture(r, c.method, w, self, lending) for r, w in enumerate(ranks)]
        held = 0
        try:
            for w in ranks:  # in rank order, as every cast takes them: none waits on another
                w.lock.acquire()
                held += 1
            for f, w in zip(futures, ranks):
                w.pending.add(f)
            handle = self._mesh.cast.call(tuple(w.sent for w in ranks), call)._as_handle()
            for f, w in zip(futures, ranks):
                f.reply = GatheredReply(handle, f.rank, w.sent)
                w.sent += 1
        finally:
            for w in ranks[:held]:
                w.lock.release()
        self._unobserved.extend(weakref.ref(f) for f in futures)
        return futures

    def wait(self, futures: list[MonarchFuture], timeout: float | None = None) -> list[Sealed]:
        """The values of ``futures``: their replies read in this thread as they come (in slices of
        ``watch_interval``, to notice a rank the watcher found dead, or a failure elsewhere)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in futures:
            while f.state == "pending" and not f.taken and first_failure(futures) is None:
                remaining = self.watch_interval if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    reply = f.reply.get(min(remaining, self.watch_interval))
                except TimeoutError:
                    continue
                except Exception as exc:  # the actor is gone (Monarch's SupervisionError)
                    read_reply(f, None, exc)
                    break
                read_reply(f, reply, None)
        if deadline is not None and time.monotonic() >= deadline:  # what the slowest rank holds back
            probe_kept(futures, PROBE_BUDGET_S)
        return wait_settled(futures, None if deadline is None else max(0.0, deadline - time.monotonic()))

    def poll(self, future: MonarchFuture) -> None:
        """Read ``future``'s reply if it has come, without waiting (``MonarchFuture.done``)."""
        try:
            reply = future.reply.poll()
        except Exception as exc:
            read_reply(future, None, exc)
            return
        if reply is not None:
            read_reply(future, reply, None)

    def observe_soon(self, futures: list[MonarchFuture]) -> None:
        """Have the loop thread read ``futures``' replies when they come, if nobody has
        (``MonarchFuture.add_done_callback``: a callback runs without a waiting thread)."""
        if not self._stopped.is_set():
            self._loop.call_soon_threadsafe(self._observe, futures)

    def _observe(self, futures: Any) -> None:
        """On the loop thread: read each of ``futures``' replies when it comes, if nobody has."""
        for f in futures:
            if f.state == "pending" and not f.taken and not f.observed:
                f.observed = True
                self._loop.create_task(await_reply(f))

    def _sweep(self) -> None:
        """On the loop thread: observe the futures of every call so far that nobody waits for."""
        futures = []
        with contextlib.suppress(IndexError):
            while True:
                future = self._unobserved.popleft()()
                if future is not None:
                    futures.append(future)
        self._observe(futures)

    def _watch(self) -> None:
        """Look every ``watch_interval`` seconds whether the processes of this host's ranks are there."""
        here = socket.gethostname()
        while not self._stopped.wait(self.watch_interval):
            if self._unobserved:
                self._loop.call_soon_threadsafe(self._sweep)
            for r, w in enumerate(list(self._ranks)):
                if (
                    w.died is None
                    and w.ready.is_set()
                    and w.info.get("host") == here
                    and not _alive(w.info["pid"])
                ):
                    fail_rank(w, WorkerDiedError(r, None, f"its process {w.info['pid']} is gone"), mark=True)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True


def _kill_local(w: RankState) -> None:
    if w.info.get("host") == socket.gethostname() and w.info.get("pid"):
        try:
            os.kill(w.info["pid"], 9)
        except (ProcessLookupError, PermissionError):
            pass


def _close_rank(w: RankState) -> None:
    if w.link is not None:
        w.link.close()
    if w.reports is not None:
        w.reports.close()


def _stop(
    proc_meshes: list[Any], ranks: list[RankState], loop: asyncio.AbstractEventLoop | None, timeout: float
) -> None:
    """Stop every process of the group (killing those Monarch did not stop in time) and the loop
    (None: leave it running)."""
    for w in ranks:
        _close_rank(w)
    for procs in proc_meshes:
        try:
            procs.stop().get(timeout=timeout)
        except Exception:
            pass
    deadline = time.monotonic() + 2.0
    for w in ranks:  # whatever Monarch left behind on this host
        while w.info.get("pid") and _alive(w.info["pid"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        if w.info.get("pid") and _alive(w.info["pid"]):
            _kill_local(w)
        logs.settle(w.tmp_log, w.info.get("monarch_log"))
    if loop is not None and loop.is_running():
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_tasks(), loop).result(timeout)
        # Stopped only once the cancelling coroutine's result has reached this thread: a loop
        # stopped from inside it never hands the result over, and the wait above takes ``timeout``.
        loop.call_soon_threadsafe(loop.stop)


async def _cancel_tasks() -> None:
    """Cancel the loop's tasks (awaiting replies that will not come)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
