"""The ``ray`` backend: every rank is a Ray actor in a placement group; data moves through the object store
(or shared memory, for actors on the controller's node).

    wg = sc.WorkerGroup(sc.ResourcePool([4, 4]), sc.ClassWithInitArgs(Trainer), backend="ray")

Placement (``ray_placement.py``): one placement group per node of the pool, ranks ordered by node
then local rank. Rank 0's actor picks ``MASTER_ADDR``/``MASTER_PORT`` on its node; every actor sets
its SPMD environment before it unpickles and builds the worker class, so
``torch.distributed.init_process_group()`` works inside it unchanged.

Calls (``ray_actor.py``): the actor class has one Ray method per public method of the worker
class, so a call sends its own arguments and nothing else, and returns one object (the result and
its timings). Ray's fixed cost per task argument and per return object is close to that of a
whole no-op call, so a no-op group call costs about what a plain Ray actor call does.

Data: to and from actors on the controller's node, large values go over a shared-memory link
(``ray_link.py``: the process backend's channel), the Ray task carrying only a token. Otherwise,
each distinct argument value is stored in the object store once (large ones with
``ray.put``, small ones inline in the task), and a rank only fetches its own chunk. Values are
pickled by ``spmdcall.serialize`` inside an envelope whose tensor and array bytes Ray keeps
out-of-band, so they are copied into the object store once and out of it once (object-store
memory is shared and immutable, so a method always gets tensors it may modify). Results come back
the same way; DataProto results that are concatenated (``DP_COMPUTE_PROTO``) are joined straight
out of the object store (``RayBackend.concat_results``), which is then their one copy out.

Futures: a rank future holds the ObjectRef of its result. Passed into another group's call it goes
to the consumer as that ObjectRef, so Ray moves rank i's output to rank i without the controller;
a result that came back over a link is in the controller already, and is sent on from there.

Detached groups (``detached=True``) outlive their controller; another controller finds them with
:func:`attach`. Names always carry a uuid, so no name is ever reused across groups.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import sys
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from spmdcall import serialize
from spmdcall.backends import Call, channel, ray_link, ray_placement
from spmdcall.backends.ray_actor import (
    Envelope,
    ResultNotPicklable,
    actor_class,
    actor_method_name,
    goes_linked,
    is_linked,
    unpack_linked_reply,
    unpack_reply,
)
from spmdcall.backends.ray_link import Link, Linked
from spmdcall.errors import CallTimeoutError, WorkerDiedError, WorkerError
from spmdcall.register import public_methods
from spmdcall.resource_pool import ResourcePool
from spmdcall.worker import ClassWithInitArgs, SPMDContext

if TYPE_CHECKING:
    from spmdcall.worker_group import WorkerGroup

__all__ = ["RayBackend", "attach", "NAMESPACE"]

# Detached groups' actors are named in this Ray namespace, so any controller can find them.
NAMESPACE = "spmdcall"
# How often a wait wakes up to check its deadline (Ray reports a dead actor through its futures).
_POLL_S = 0.2
# Serialised values below this size travel inside the task itself instead of through ray.put.
_INLINE_MAX_BYTES = 64 * 1024
_UNIQUE_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


# -- controller side -----------------------------------------------------------------------------


@dataclass(eq=False)
class _Rank:
    """Controller-side state of one rank's current actor (a restart makes a new one)."""

    actor: Any
    name: str
    generation: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    died: WorkerDiedError | None = None
    link: Link | None = None  # the shared-memory link, for an actor on the controller's node

    def unlink(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None


class _RayFuture:
    """The pending result of one call; ``object_ref`` is the Ray ObjectRef of its reply
    (``ray_actor.pack_reply``), or of the plain result of a control call (``control=True``)."""

    __slots__ = (
        "rank",
        "method",
        "object_ref",
        "control",
        "_backend",
        "_worker",
        "_state",
        "_value",
        "_times",
        "linked",
        "came_linked",
    )

    def __init__(
        self,
        backend: RayBackend,
        worker: _Rank,
        rank: int,
        method: str,
        object_ref: Any,
        control: bool = False,
        linked: bool = False,
    ):
        self.rank, self.method, self.object_ref, self.control = rank, method, object_ref, control
        self.linked = linked  # sent to a rank with a link: its result may come back over it
        self.came_linked = False
        self._backend, self._worker = backend, worker
        self._state = "pending"  # -> "ok" | "error"
        self._value: Any = None  # the result: its sealed Envelope until first opened
        self._times = (0, 0)  # worker-side start and end of the call

    def done(self) -> bool:
        return self._state != "pending" or bool(ray.wait([self.object_ref], timeout=0)[0])

    def result(self, timeout: float | None = None) -> Any:
        return self._backend.wait([self], timeout)[0]

    def _open(self) -> Any:
        # Opened on first use only: a result that is just concatenated needs no copy of its own.
        if isinstance(self._value, Envelope):
            self._value = self._value.open()
        return self._value

    @property
    def started_ns(self) -> int:
        return self._times[0]

    @property
    def finished_ns(self) -> int:
        return self._times[1]

    def __repr__(self) -> str:
        return f"RayRankFuture(rank={self.rank}, method={self.method!r}, state={self._state})"


class RayBackend:
    """Workers as Ray actors, one placement group per node of the pool.

    Args:
        placement_timeout: seconds to wait for the placement groups before raising
            ResourceInsufficientError.
        start_timeout: seconds for the actors to start and build the worker class.
        shutdown_grace: seconds ``shutdown`` lets busy actors finish before killing them.
        ray_init_kwargs: passed to ``ray.init()`` if Ray is not initialised yet (``ray.init()``
            itself honours ``RAY_ADDRESS``, or connects to the cluster of a Ray job).
        detached: the actors and placement groups outlive this controller; find them again
            with :func:`attach` (by the group's ``name``) and stop them with ``shutdown()``.
        resources_per_worker: custom Ray resources added to every worker's bundle, e.g.
            ``{"trainer_node": 1}`` to land on the nodes that advertise it.
        env: extra environment variables for every worker.
        runtime_env: a Ray runtime environment for the actors (pip packages, working_dir, ...).
        shared_memory: move large values to and from actors on the controller's node through
            shared memory instead of the object store (``ray_link.py``); False: always the store.

    Example:
        >>> wg = WorkerGroup(ResourcePool([2, 2]), ClassWithInitArgs(Trainer), backend="ray",
        ...                  placement_timeout=60, ray_init_kwargs={"address": "auto"})  # doctest: +SKIP
    """

    name = "ray"
    accepts_rank_futures = True

    def __init__(
        self,
        *,
        placement_timeout: float = 30.0,
        start_timeout: float = 300.0,
        shutdown_grace: float = 3.0,
        ray_init_kwargs: dict[str, Any] | None = None,
        detached: bool = False,
        resources_per_worker: dict[str, float] | None = None,
        env: dict[str, str] | None = None,
        runtime_env: dict[str, Any] | None = None,
        shared_memory: bool = True,
    ):
        for option, value in (("placement_timeout", placement_timeout), ("start_timeout", start_timeout)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{option} must be a positive number of seconds, got {value!r}")
        self.placement_timeout = placement_timeout
        self.start_timeout = start_timeout
        self.shutdown_grace = shutdown_grace
        self.ray_init_kwargs = dict(ray_init_kwargs or {})
        self.detached = bool(detached)
        self.resources_per_worker = dict(resources_per_worker or {})
        self.extra_env = dict(env or {})
        self.runtime_env = runtime_env
        self.shared_memory = bool(shared_memory)
        self._ranks: list[_Rank] = []
        self._placement: ray_placement.Placement | None = None
        self._contexts: list[SPMDContext] = []
        self._env: list[dict[str, str]] = []  # each rank's environment (SPMD variables, devices, extra env)
        self._finalizer: weakref.finalize | None = None
        self._stopped = False
        self._attached: dict[str, Any] | None = None
        self._methods: frozenset[str] = frozenset()  # the worker's public methods

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, pool: ResourcePool, cls_with_init: ClassWithInitArgs, *, group_name: str) -> None:
        self._methods = frozenset(public_methods(cls_with_init.cls))  # each gets an actor method
        if self._attached is not None:
            return  # built by attach(): the actors are already running
        try:
            self._payload = serialize.dumps_inline(cls_with_init)
        except Exception as exc:
            raise TypeError(
                f"{cls_with_init!r} (its class or init arguments) cannot be pickled: {exc}"
            ) from exc
        _init_ray(self.ray_init_kwargs)
        if not _UNIQUE_SUFFIX.search(group_name):
            group_name = f"{group_name}-{uuid.uuid4().hex[:8]}"
        self._group_name, self._pool, self._sys_path = group_name, pool, list(sys.path)
        if self.detached:
            running = _find_detached(_user_name(group_name))
            if running:
                raise ValueError(
                    f"a detached group named {_user_name(group_name)!r} is already running ({sorted(running)}); "
                    f"attach to it with spmdcall.backends.ray.attach(...) or shut it down first"
                )
        self._placement = ray_placement.acquire(
            pool,
            extra_resources=self.resources_per_worker,
            detached=self.detached,
            timeout=self.placement_timeout,
            name=group_name,
        )
        if not self.detached:  # a detached group must survive this controller, even its garbage collection
            self._finalizer = weakref.finalize(self, _stop, self._ranks, self._placement, 0.0)
        try:
            self._ranks.extend(self._new_actor(rank) for rank in range(pool.world_size))
            where = self._await({r: w.actor.locate.remote() for r, w in enumerate(self._ranks)}, "__init__")
            self._contexts = pool.contexts(where[0]["ip"], where[0]["port"])
            self._env = [{**self.extra_env, **ctx.env()} for ctx in self._contexts]
            if pool.use_gpu:
                _share_node_gpus(pool, self._env, [where[r] for r in range(pool.world_size)])
            self._setup(list(range(pool.world_size)))
        except BaseException:
            self.shutdown()
            raise

    def _new_actor(self, rank: int, generation: int = 0) -> _Rank:
        assert self._placement is not None
        node, local_rank = self._pool.placements()[rank]
        name = f"{self._group_name}:rank{rank}" + (f".{generation}" if generation else "")
        options: dict[str, Any] = {
            "name": name,
            "max_restarts": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self._placement.groups[node], placement_group_bundle_index=local_rank
            ),
            **{k: v for k, v in self._placement.actor_resources().items() if v},
        }
        if self.detached:
            options.update(lifetime="detached", namespace=NAMESPACE)
        if self.runtime_env:
            options["runtime_env"] = self.runtime_env
        return _Rank(
            actor_class(tuple(sorted(self._methods))).options(**options).remote(rank), name, generation
        )

    def _setup(self, ranks: list[int]) -> None:
        """Build the worker class on ``ranks`` (their actors are new), each in its SPMD environment."""
        refs = {
            r: self._ranks[r].actor.setup.remote(self._env[r], self._sys_path, self._payload) for r in ranks
        }
        for rank, info in self._await(refs, "__init__").items():
            self._ranks[rank].info = {**info, "actor_name": self._ranks[rank].name}
        if self.detached:
            self._publish()
        else:
            self._link(ranks)

    def _link(self, ranks: list[int]) -> None:
        """Connect the shared-memory links of ``ranks`` whose actors run on this node. (Not for a
        detached group: its actors outlive this controller, and another one may attach.)"""
        here = ray.get_runtime_context().get_node_id()
        local = [r for r in ranks if self._ranks[r].info.get("node_id") == here] if self.shared_memory else []
        if local:
            listener, address = ray_link.listen(len(local))
            with listener:
                refs = {r: self._ranks[r].actor.link.remote(address) for r in local}
                connected = [r for r, why_not in self._await(refs, "__init__").items() if why_not is None]
                for rank, link in ray_link.accept(listener, len(connected), self.start_timeout).items():
                    self._ranks[rank].link = link
        for rank in ranks:
            self._ranks[rank].info["shared_memory"] = self._ranks[rank].link is not None

    def _publish(self) -> None:
        # Every actor of a detached group keeps what attach() needs, so any live rank can answer.
        assert self._placement is not None
        group = {
            "group_name": self._group_name,
            "pool": self._pool,
            "payload": self._payload,
            "sys_path": self._sys_path,
            "contexts": self._contexts,
            "placement_groups": self._placement.groups,
            "bundle": self._placement.bundle,
            "infos": [w.info for w in self._ranks],
            "generations": [w.generation for w in self._ranks],
            "env": self._env,
            "runtime_env": self.runtime_env,
        }
        live = {r: w.actor.remember_group.remote(group) for r, w in enumerate(self._ranks) if w.died is None}
        self._await(live, "__init__")

    def _await(self, refs: dict[int, Any], method: str) -> dict[int, Any]:
        """Results of control calls (one per rank) within ``start_timeout``, errors translated."""
        futures = [_RayFuture(self, self._ranks[r], r, method, ref, control=True) for r, ref in refs.items()]
        return dict(zip(refs, self.wait(futures, self.start_timeout)))

    def restart(self, ranks: list[int] | None) -> None:
        if ranks is None:
            ranks = self._dead_ranks()
        for rank in ranks:
            old = self._ranks[rank]
            old.unlink()
            _kill(old.actor)
            self._ranks[rank] = self._new_actor(rank, old.generation + 1)
        if ranks:
            self._setup(list(ranks))

    def _dead_ranks(self) -> list[int]:
        dead = {r for r, w in enumerate(self._ranks) if w.died is not None}
        # A short ping finds actors that died while no call was watching them; a busy actor
        # answers later and counts as alive.
        probes = {r: w.actor.ping.remote() for r, w in enumerate(self._ranks) if r not in dead}
        ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=2.0)
        for rank, ref in probes.items():
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    dead.add(rank)
        return sorted(dead)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._placement is not None:
            _stop(self._ranks, self._placement, self.shutdown_grace)

    def worker_info(self) -> list[dict[str, Any]]:
        return [{"rank": r, **w.info} for r, w in enumerate(self._ranks)]

    # -- calls -------------------------------------------------------------------------------

    def submit(self, calls: list[Call]) -> list[_RayFuture]:
        for c in calls:
            died = self._ranks[c.rank].died
            if died is not None:
                raise WorkerDiedError(c.rank, c.method, f"{died.detail}; call restart() to bring it back")
        calls = [self._unlinked(c) for c in calls]
        # Serialise every argument before sending anything (a value shared by several ranks, as in
        # ONE_TO_ALL, once). Then store and send call by call, so rank 0 starts on its chunk while
        # the next rank's chunk is still being copied into the object store.
        encoded: dict[int, Any] = {}
        for c in calls:
            names = [f"argument {i}" for i in range(len(c.args))] + [f"argument {k!r}" for k in c.kwargs]
            for what, v in zip(names, (*c.args, *c.kwargs.values())):
                if id(v) not in encoded:
                    encoded[id(v)] = _encode(c, what, v)
        # Large values for linked ranks: one frame each, however many of them get it.
        linked = [c for c in calls if self._ranks[c.rank].link is not None]
        receivers = collections.Counter(
            id(v)
            for c in linked
            for v in {id(v): v for v in (*c.args, *c.kwargs.values())}.values()
            if _goes_linked(encoded[id(v)])
        )
        for c in linked:
            w = self._ranks[c.rank]
            if receivers:  # hear which of our segments it let go of, before taking new ones
                _on_link(w, Link.drain)
            if w.link is not None and w.link.channel.has_releases():  # tell it which of its we did
                _on_link(w, Link.flush)
        frames: dict[int, channel.Frame] = {}
        stored: dict[int, Any] = {}

        def sent(v: Any, w: _Rank) -> Any:
            e = encoded[id(v)]
            if w.link is not None and _goes_linked(e):
                if id(v) not in frames:
                    # A result that came over a link, handed on unopened: its bytes go on in the
                    # segments they came in (channel.py), not as a copy.
                    frames[id(v)] = channel.encode_pickled(
                        e.data, e.buffers, receivers=receivers[id(v)], forward=isinstance(v, Envelope)
                    )
                token = _on_link(w, lambda link: link.send(frames[id(v)]))
                if token is not None:
                    return Linked(token, e.is_data_proto)
            if id(v) not in stored:
                stored[id(v)] = _store(e)
            return stored[id(v)]

        futures = []
        try:
            for c in calls:
                w = self._ranks[c.rank]
                args = [sent(v, w) for v in c.args]
                kwargs = {k: sent(v, w) for k, v in c.kwargs.items()}
                # Other calls' replies (rank futures), by position or keyword: the worker unwraps them.
                replies: tuple[int | str, ...] = tuple(
                    i for i, v in enumerate(c.args) if isinstance(v, _RayFuture)
                )
                replies += tuple(k for k, v in c.kwargs.items() if isinstance(v, _RayFuture))
                if c.role is None and not replies and c.method in self._methods:
                    ref = getattr(w.actor, actor_method_name(c.method)).remote(*args, **kwargs)
                else:
                    ref = w.actor.call.remote((c.role, c.method, replies), *args, **kwargs)
                futures.append(_RayFuture(self, w, c.rank, c.method, ref, linked=w.link is not None))
        finally:
            for frame in frames.values():
                frame.discard()  # leases of frames that could not be sent
        return futures

    def submit_for_refs(self, calls: list[Call]) -> list[Any]:
        """Send ``calls`` the way a Ray actor call goes, and return the ObjectRef of each call's
        result itself: ``ray.get`` gives the values (a worker's exception raises as its
        WorkerError), and passed to another Ray call, Ray resolves it there. For code written
        against Ray, which holds on to ObjectRefs (verl drivers); a group's own calls use
        ``submit``. Results stay in the object store (never the shared-memory link).
        """
        refs = []
        for c in calls:
            died = self._ranks[c.rank].died
            if died is not None:
                raise WorkerDiedError(c.rank, c.method, f"{died.detail}; call restart() to bring it back")
        for c in map(self._unlinked, calls):
            names = [f"argument {i}" for i in range(len(c.args))] + [f"argument {k!r}" for k in c.kwargs]
            values = [_store(_encode(c, what, v)) for what, v in zip(names, (*c.args, *c.kwargs.values()))]
            args, kwargs = values[: len(c.args)], dict(zip(c.kwargs, values[len(c.args) :]))
            replies = tuple(i for i, v in enumerate(c.args) if isinstance(v, _RayFuture))
            replies += tuple(k for k, v in c.kwargs.items() if isinstance(v, _RayFuture))
            refs.append(
                self._ranks[c.rank].actor.call_plain.remote((c.role, c.method, replies), *args, **kwargs)
            )
        return refs

    def _unlinked(self, c: Call) -> Call:
        """``c`` with the results of calls on linked ranks among its arguments (rank futures)
        waited for: a result that came back over a link is in this process, so it is sent on as a
        value (over the consumer's link, or through the object store). Any other rank future goes
        to the consumer as its ObjectRef, rank to rank."""
        values = (*c.args, *c.kwargs.values())
        produced = [v for v in values if isinstance(v, _RayFuture) and v.linked]
        if not produced:
            return c
        self._settle_all(produced, None)

        def value(v: Any) -> Any:
            return v._value if isinstance(v, _RayFuture) and v.came_linked else v

        return dataclasses.replace(
            c, args=tuple(map(value, c.args)), kwargs={k: value(v) for k, v in c.kwargs.items()}
        )

    def wait(self, futures: list[_RayFuture], timeout: float | None = None) -> list[Any]:
        self._settle_all(futures, timeout)
        return [f._open() for f in futures]

    def concat_results(self, futures: list[_RayFuture], timeout: float | None = None) -> Any:
        """The DataProto results of ``futures`` concatenated (as ``DataProto.concat``), each column
        joined by one copy straight out of the object store instead of a copy of each result
        first; None when they are not all DataProtos (the caller then waits and collects as usual).
        """
        self._settle_all(futures, timeout)
        envelopes = [f._value for f in futures]
        if not all(isinstance(e, Envelope) for e in envelopes):
            return None  # opened already, or not an envelope at all
        states = [e.data_proto_state() for e in envelopes]
        if any(state is None for state in states):
            return None
        from spmdcall.data import _concat_states

        return _concat_states(states)

    def _settle_all(self, futures: list[_RayFuture], timeout: float | None) -> None:
        """Return when every future has its result; raise the first failure as soon as it is known."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for f in futures:
                if f._state == "error":
                    raise f._value
            pending = [f for f in futures if f._state == "pending"]
            if not pending:
                return
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                assert timeout is not None  # there is a deadline only when there is a timeout
                raise CallTimeoutError(pending[0].method, timeout, sorted({f.rank for f in pending}))
            refs = [f.object_ref for f in pending]
            try:
                # One round trip in the common case, like a plain ray.get (which raises at once
                # when one of the results is an error, even while others are still running; Ctrl-C
                # interrupts it too). Without a deadline, no timeout: it costs ~2% of a no-op call.
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

    def _translate(self, exc: Exception, fut: _RayFuture) -> Exception:
        """A Ray exception as the spmdcall error a user expects."""
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause
            if isinstance(cause, (WorkerError, WorkerDiedError)):
                return cause  # the user's error, or a producer's whose output this call consumed
            if isinstance(cause, ResultNotPicklable):
                return TypeError(str(cause))  # as on every backend
            if isinstance(cause, ray.exceptions.RayError):
                return self._translate(cause, fut)  # e.g. the actor that produced an input died
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
            return WorkerDiedError(
                fut.rank, fut.method, f"Ray lost the call or its result: {_short(str(exc))}"
            )
        return exc

    # -- attaching to a detached group -------------------------------------------------------

    def _adopt(self, group: dict[str, Any], actors: dict[int, tuple[Any, str]]) -> None:
        self._attached = group
        self._group_name, self._pool, self._payload = group["group_name"], group["pool"], group["payload"]
        self._sys_path, self._contexts, self._env = group["sys_path"], group["contexts"], group["env"]
        self.runtime_env = group["runtime_env"]
        self._placement = ray_placement.Placement(
            group["placement_groups"],
            group["bundle"],
            self._pool.max_colocate_count,
            detached=True,
            cluster_id="",
            num_users=1,
        )
        for rank in range(self._pool.world_size):
            actor, name = actors.get(rank, (None, ""))
            w = _Rank(actor, name, group["generations"][rank], dict(group["infos"][rank]))
            if actor is None:
                w.died = WorkerDiedError(rank, None, "its actor was gone when this controller attached")
            self._ranks.append(w)


def _share_node_gpus(pool: ResourcePool, env: list[dict[str, str]], where: list[dict[str, Any]]) -> None:
    """Let every rank see the GPUs of its node's ranks, in local-rank order, so ``cuda:LOCAL_RANK`` is
    the GPU Ray gave it (as on the process backend) and NCCL sees its peers on the node. A node
    entry whose bundles Ray spread over several machines (strategy PACK or SPREAD) keeps Ray's
    one-GPU view per rank."""
    for node in range(pool.num_nodes):
        ranks = [r for r, (n, _) in enumerate(pool.placements()) if n == node]
        if len({where[r]["node_id"] for r in ranks}) > 1 or any(len(where[r]["gpus"]) != 1 for r in ranks):
            continue
        devices = ",".join(where[r]["gpus"][0] for r in ranks)
        for r in ranks:
            env[r]["CUDA_VISIBLE_DEVICES"] = devices


def _encode(c: Call, what: str, value: Any) -> Any:
    """What a call argument travels as: its producer's ObjectRef (a rank future), the caller's own
    ObjectRef, or an envelope."""
    if isinstance(value, _RayFuture):
        return value.object_ref  # a top-level ObjectRef argument: Ray resolves it on the worker
    if isinstance(value, ray.ObjectRef):
        return value  # e.g. from ray.put: Ray resolves it on the worker, as for any Ray actor call
    if isinstance(value, Envelope):
        return value  # a result that came back over a link, sent on unopened
    try:
        return Envelope(value)
    except Exception as exc:
        culprit = serialize.describe_unpicklable({what: value}) or f"{what} ({type(value).__name__}): {exc}"
        raise TypeError(f"cannot send {c.method}() to rank {c.rank}: {culprit}") from exc


def _on_link(w: _Rank, action: Callable[[Link], Any]) -> Any:
    """``action(w.link)``; when the link is broken (its actor died), close it and return None: the
    value goes through the object store, and Ray reports the actor's death through the call."""
    assert w.link is not None
    try:
        return action(w.link)
    except (EOFError, OSError):
        w.unlink()
        return None


def _goes_linked(value: Any) -> bool:
    return isinstance(value, Envelope) and goes_linked(value)


def _store(value: Any) -> Any:
    # Small envelopes ride inside the task; large ones go to the object store once.
    if isinstance(value, Envelope) and value.nbytes >= _INLINE_MAX_BYTES:
        return ray.put(value)
    return value


def _settle(futures: list[_RayFuture]) -> None:
    """Fetch the results of finished futures (one ray.get for all of them when none failed)."""
    try:
        replies = ray.get([f.object_ref for f in futures])
    except Exception:
        for f in futures:
            try:
                _accept(f, ray.get(f.object_ref))
            except Exception as exc:
                f._value, f._state = f._backend._translate(exc, f), "error"
        return
    for f, reply in zip(futures, replies):
        _accept(f, reply)


def _accept(f: _RayFuture, reply: Any) -> None:
    if f.control:
        f._value = reply  # a control call (locate, setup, ...) returns its value as is
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
            _on_link(f._worker, Link.drain)
    f._state = "ok"


def _stop(ranks: list[_Rank], placement: ray_placement.Placement, grace: float) -> None:
    """Let idle actors exit cleanly (their atexit handlers run), kill the rest, free the bundles."""
    for w in ranks:
        w.unlink()
    if not ray.is_initialized():
        return
    actors = [w.actor for w in ranks if w.actor is not None]
    exits = []
    for actor in actors:
        try:
            exits.append(actor.__ray_terminate__.remote())
        except Exception:
            pass
    if exits and grace > 0:
        ray.wait(exits, num_returns=len(exits), timeout=grace)
    for actor in actors:
        _kill(actor)
    ray_placement.release(placement)


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:
        pass  # already gone


def _death_detail(exc: Exception, worker: _Rank) -> str:
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


def _init_ray(kwargs: dict[str, Any]) -> None:
    """Start or join Ray unless this process already did; never shut down a Ray we did not start."""
    if ray.is_initialized():
        if kwargs:
            warnings.warn(
                f"ray_init_kwargs {sorted(kwargs)} are ignored: Ray is already initialised in this process",
                stacklevel=4,
            )
        return
    ray.init(**kwargs)


def _user_name(group_name: str) -> str:
    return _UNIQUE_SUFFIX.sub("", group_name)


def _find_detached(name: str) -> dict[str, dict[int, tuple[int, str]]]:
    """Live detached groups called ``name``: group name -> rank -> (generation, actor name)."""
    pattern = re.compile(rf"^({re.escape(name)}-[0-9a-f]{{8}}):rank(\d+)(?:\.(\d+))?$")
    groups: dict[str, dict[int, tuple[int, str]]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        m = pattern.match(entry["name"]) if entry["namespace"] == NAMESPACE else None
        if m:
            rank, generation = int(m.group(2)), int(m.group(3) or 0)
            ranks = groups.setdefault(m.group(1), {})
            if rank not in ranks or ranks[rank][0] < generation:
                ranks[rank] = (generation, entry["name"])
    return groups


def attach(
    name: str,
    *,
    ray_init_kwargs: dict[str, Any] | None = None,
    timeout: float = 60.0,
    shutdown_grace: float = 3.0,
) -> WorkerGroup:
    """A WorkerGroup driving the running detached group called ``name``, from any controller.

    Args:
        name: the ``name=`` the group was built with (``WorkerGroup(..., name=name, detached=True)``),
            or its full name (``wg.name``, which ends in a unique suffix) to pick that one group.
        ray_init_kwargs: for ``ray.init()`` if this process has not joined the cluster yet.
        timeout: seconds to wait for a rank to describe the group.
        shutdown_grace: as for RayBackend; ``shutdown()`` on the returned group stops the workers.

    Example:
        >>> wg = attach("trainer", ray_init_kwargs={"address": "auto"})  # doctest: +SKIP
        >>> wg.step(batch)                                                # doctest: +SKIP
        >>> wg.shutdown()   # stops the detached workers for good           # doctest: +SKIP
    """
    from spmdcall.worker_group import WorkerGroup

    _init_ray(dict(ray_init_kwargs or {}))
    groups = _find_detached(name)
    if not groups and _UNIQUE_SUFFIX.search(name):
        # The full name of one group (its actors' names start with it): that group only.
        groups = {g: ranks for g, ranks in _find_detached(_user_name(name)).items() if g == name}
    if not groups:
        raise ValueError(
            f"no detached spmdcall group named {name!r} is running on this Ray cluster "
            f"(Ray namespace {NAMESPACE!r})"
        )
    if len(groups) > 1:
        raise ValueError(
            f"several detached groups are named {name!r}: {sorted(groups)}; shut down the stale ones"
        )
    group_name, ranks = groups.popitem()
    actors: dict[int, tuple[Any, str]] = {}
    for rank, (_, actor_name) in ranks.items():
        try:
            actors[rank] = (ray.get_actor(actor_name, namespace=NAMESPACE), actor_name)
        except ValueError:
            pass  # died between the listing and now
    answers = [actor.describe_group.remote() for actor, _ in actors.values()]
    group = None
    deadline = time.monotonic() + timeout
    while group is None and answers and time.monotonic() < deadline:
        ready, answers = ray.wait(answers, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in ready:
            try:
                group = group or ray.get(ref)  # None from a rank still starting up
            except ray.exceptions.RayError:
                pass  # that rank died: ask the others
    if group is None:
        raise TimeoutError(f"no rank of the detached group {group_name} described it within {timeout:g} s")
    backend = RayBackend(detached=True, shutdown_grace=shutdown_grace)
    backend._adopt(group, actors)
    wg = WorkerGroup(group["pool"], serialize.loads(group["payload"]), backend=backend, name=name)
    wg.name = group_name  # the name the group was created with
    return wg
