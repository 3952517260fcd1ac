"""The ``ray`` backend: every rank is a Ray actor in a placement group; data moves through the object store
(or shared memory, for actors on the controller's node).

    wg = sc.WorkerGroup(sc.ResourcePool([4, 4]), sc.ClassWithInitArgs(Trainer), backend="ray")

Placement (``placement.py``): one placement group per node of the pool, ranks ordered by node
then local rank. Rank 0's actor picks ``MASTER_ADDR``/``MASTER_PORT`` on its node and holds the port
for its life (``rendezvous.py``); every actor sets
its SPMD environment before it unpickles and builds the worker class, so
``torch.distributed.init_process_group()`` works inside it unchanged.

Calls (``actor.py``): the actor class has one Ray method per public method of the worker
class, so a call sends its own arguments and nothing else, and returns one object (the result and
its timings). Small arguments go packed in one ``bytes``, an async actor's turn number with them.
Ray's fixed cost per task argument and per return object is close to that of a whole no-op call,
so a group call costs about what a plain Ray actor call with one small argument does.

Data: to and from actors on the controller's node, large values go over a shared-memory link
(``transport/link.py``: the process backend's channel), the Ray task carrying only a token. Otherwise,
each distinct argument value is stored in the object store once (large ones with
``ray.put``, small ones inline in the task), and a rank only fetches its own chunk. Values are
pickled by ``spmdcall.serialize`` inside an envelope whose tensor and array bytes Ray keeps
out-of-band, so they are copied into the object store once and out of it once (object-store
memory is shared and immutable, so a method always gets tensors it may modify). Results come back
the same way, sealed; a collect that concatenates them (``DP_COMPUTE_PROTO``) opens them where Ray
stored them (``Envelope.open(shared=True)``), so the concatenation is their one copy out.

Futures: a rank future holds the ObjectRef of its result. Passed into another group's call it goes
to the consumer as that ObjectRef, so Ray moves rank i's output to rank i without the controller;
a result that came back over a link is in the controller already, and is sent on from there.

Detached groups (``detached=True``) outlive their controller; another controller finds them with
``spmdcall.group.detached.attach`` (``detached.py`` finds them). Names always carry a uuid, so no
name is ever reused across groups.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
import warnings
import weakref
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from spmdcall import serialize
from spmdcall.backends import Call, Capabilities
from spmdcall.backends.ray import detached as ray_detached
from spmdcall.backends.ray import placement as ray_placement
from spmdcall.backends.ray.actor import (
    actor_class,
    actor_method_name,
    pack_call,
)
from spmdcall.backends.ray.futures import RankState, RayFuture, settle_all
from spmdcall.backends.ray.outbox import Outbox, encode_value, holds_object_refs, store
from spmdcall.errors import WorkerDiedError, WorkerError
from spmdcall.rendezvous import START_ATTEMPTS, log_retry, port_taken
from spmdcall.resource_pool import ResourcePool, contexts_on
from spmdcall.runtime.calls import runs_on_event_loop
from spmdcall.runtime.reports import RankReport, ReportClient, ask_all, reporters, stop_all
from spmdcall.runtime.specs import public_methods
from spmdcall.transport import link as ray_link
from spmdcall.transport.envelope import Sealed
from spmdcall.transport.frames import KeptSegments
from spmdcall.transport.segments import lend_out
from spmdcall.worker import ClassWithInitArgs, SPMDContext

__all__ = ["RayBackend"]


# An async actor's calls all enter at once and wait for their turn on the actor.
_ASYNC_ACTOR_MAX_CONCURRENCY = 100_000


# -- controller side -----------------------------------------------------------------------------


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
            shared memory instead of the object store (``transport/link.py``); False: always the store.

    Example:
        >>> wg = WorkerGroup(ResourcePool([2, 2]), ClassWithInitArgs(Trainer), backend="ray",
        ...                  placement_timeout=60, ray_init_kwargs={"address": "auto"})  # doctest: +SKIP
    """

    name = "ray"
    # Rank futures of any ray group go into calls as they are: the worker resolves them (rank to
    # rank, not through the controller). Collected results may go into the link's free segments.
    capabilities = Capabilities(
        hand_off=RayFuture,
        result_alloc=lend_out,
        refs=ray.ObjectRef,
        reports=True,
        cancel=True,
        env=True,
        detached=True,
        resize=True,
        counts_bytes=True,
    )
    # The actors' segments that came over links, kept for handing on, shared by every ray group of
    # this controller (a reply of one group's rank may go to another group's rank without a copy).
    _kept = KeptSegments()

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
        self._ranks: list[RankState] = []
        self._placement: ray_placement.Placement | None = None
        self._placements: list[ray_placement.Placement] = []  # the first one's, and those grow() added
        self._slots: list[tuple[Any, int]] = []  # each rank's bundle: (placement group, bundle index)
        self._free_slots: list[tuple[Any, int]] = []  # bundles of ranks a resize stopped, for the next grow
        self._contexts: list[SPMDContext] = []
        self._env: list[dict[str, str]] = []  # each rank's environment (SPMD variables, devices, extra env)
        self._finalizer: weakref.finalize | None = None
        self._stopped = False
        self._attached: dict[str, Any] | None = None
        self._methods: frozenset[str] = frozenset()  # the worker's public methods
        self._on_loop = False  # the worker class has async methods: its actors are async actors

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, pool: ResourcePool, cls_with_init: ClassWithInitArgs, *, group_name: str) -> None:
        self._methods = frozenset(public_methods(cls_with_init.cls))  # each gets an actor method
        self._on_loop = runs_on_event_loop(cls_with_init)
        if self._attached is not None:  # built by attach(): the actors are already running
            if self._on_loop:  # go on numbering calls where the last controller stopped
                live = {r: w.actor.next_turn.remote() for r, w in enumerate(self._ranks) if w.died is None}
                for rank, turn in self._await(live, "__init__").items():
                    self._ranks[rank].next_seq = turn
            return
        self._payload = serialize.dumps_worker_class(cls_with_init)
        _init_ray(self.ray_init_kwargs)
        if not ray_detached.UNIQUE_SUFFIX.search(group_name):
            group_name = f"{group_name}-{uuid.uuid4().hex[:8]}"
        self._group_name, self._pool, self._sys_path = group_name, pool, list(sys.path)
        if self.detached:
            running = ray_detached.find(ray_detached.user_name(group_name))
            if running:
                raise ValueError(
                    f"a detached group named {ray_detached.user_name(group_name)!r} is already running ({sorted(running)}); "
                    f"attach to it with spmdcall.group.detached.attach(...) or shut it down first"
                )
        self._placement = ray_placement.acquire(
            pool,
            extra_resources=self.resources_per_worker,
            detached=self.detached,
            timeout=self.placement_timeout,
            name=group_name,
        )
        self._placements.append(self._placement)
        self._slots = [(self._placement.groups[node], local) for node, local in pool.placements()]
        if not self.detached:  # a detached group must survive this controller, even its garbage collection
            self._finalizer = weakref.finalize(self, _stop, self._ranks, self._placements, 0.0)
        try:
            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    self._start_actors(pool, generation=attempt - 1)
                    return
                except WorkerError as exc:
                    port = self._contexts[0].master_port if self._contexts else 0
                    if attempt == START_ATTEMPTS or not port_taken(exc, port):
                        raise
                    log_retry(port, attempt)
                    for w in self._ranks:
                        w.unlink()
                        _kill(w.actor)
                    self._ranks.clear()
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, pool: ResourcePool, generation: int) -> None:
        """Start an actor per rank; rank 0's reserves the rendezvous port on its node (rendezvous.py)."""
        self._ranks.extend(self._new_actor(rank, generation) for rank in range(pool.world_size))
        where = self._await({r: w.actor.locate.remote(r == 0) for r, w in enumerate(self._ranks)}, "__init__")
        self._contexts = pool.contexts(where[0]["ip"], where[0]["port"])
        self._env = [{**self.extra_env, **ctx.env()} for ctx in self._contexts]
        if pool.use_gpu:
            _share_node_gpus(pool, self._env, [where[r] for r in range(pool.world_size)])
        self._setup(list(range(pool.world_size)))

    def _new_actor(self, rank: int, generation: int = 0, *, joined: bool = False) -> RankState:
        assert self._placement is not None
        group, bundle = self._slots[rank]
        name = f"{self._group_name}:rank{rank}" + (f".{generation}" if generation else "")
        if joined:  # a rank a resize added: a name no actor of the group had before
            name = f"{self._group_name}:rank{rank}.j{uuid.uuid4().hex[:8]}"
        options: dict[str, Any] = {
            "name": name,
            "max_restarts": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=bundle
            ),
            **{k: v for k, v in self._placement.actor_resources().items() if v},
        }
        if self.detached:
            options.update(lifetime="detached", namespace=ray_detached.NAMESPACE)
        if self.runtime_env:
            options["runtime_env"] = self.runtime_env
        if self._on_loop:
            # Calls wait for their turn on the actor (see ray_actor._AsyncRankActor): Ray must let them all in.
            options["max_concurrency"] = _ASYNC_ACTOR_MAX_CONCURRENCY
        actor_cls = actor_class(tuple(sorted(self._methods)), self._on_loop)
        return RankState(actor_cls.options(**options).remote(rank), name, generation)

    def _setup(self, ranks: list[int]) -> None:
        """Build the worker class on ``ranks`` (their actors are new), each in its SPMD environment.
        Calls made meanwhile (from other threads) wait until their rank is ready."""
        try:
            refs = {
                r: self._ranks[r].actor.setup.remote(self._env[r], self._sys_path, self._payload)
                for r in ranks
            }
            for rank, info in self._await(refs, "__init__").items():
                host, port, token = info.pop("reporter")
                self._ranks[rank].reports = ReportClient(address=(host, port), token=token)
                self._ranks[rank].info = {**info, "actor_name": self._ranks[rank].name}
            if self.detached:
                self._publish()
            else:
                self._link(ranks)
        except BaseException as exc:
            for r in ranks:
                if self._ranks[r].died is None:
                    self._ranks[r].died = WorkerDiedError(r, "__init__", f"it did not start: {exc}")
            raise
        finally:
            for r in ranks:
                self._ranks[r].ready.set()

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
                for rank, link in ray_link.accept(
                    listener, len(connected), self.start_timeout, self._kept
                ).items():
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
            "reporters": [w.reports.address if w.reports else None for w in self._ranks],
            "tokens": [w.reports.token if w.reports else "" for w in self._ranks],
            "generations": [w.generation for w in self._ranks],
            "env": self._env,
            "runtime_env": self.runtime_env,
        }
        live = {r: w.actor.remember_group.remote(group) for r, w in enumerate(self._ranks) if w.died is None}
        self._await(live, "__init__")

    def _await(self, refs: dict[int, Any], method: str) -> dict[int, Any]:
        """Results of control calls (one per rank) within ``start_timeout``, errors translated."""
        futures = [RayFuture(self._ranks[r], r, method, ref, control=True) for r, ref in refs.items()]
        return dict(zip(refs, (r.open() for r in self.wait(futures, self.start_timeout))))

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

    def resize(self, keep: list[int], num_new: int, *, timeout: float | None) -> list[SPMDContext]:
        """Keep the ranks ``keep`` (renumbered in that order), stop the others, start ``num_new``
        after them (``Capabilities.resize``). A stopped rank's actor exits once the calls queued
        before its exit are done (an async actor's at once), or is killed after ``timeout``
        seconds. New ranks take the bundles of stopped ones first, then bundles of a placement
        group made for them. Rank 0's node hosts the rendezvous: a new rank 0 reserves a port."""
        if self.detached:
            raise ValueError(
                f"{self._group_name}: a detached ray group keeps its size (a controller that attaches "
                "later finds it as it was started)"
            )
        gone = [w for r, w in enumerate(self._ranks) if r not in set(keep)]
        self._free_slots += [self._slots[r] for r in range(len(self._ranks)) if r not in set(keep)]
        kept, self._slots = [self._ranks[r] for r in keep], [self._slots[r] for r in keep]
        self._end_actors(gone, timeout)
        self._ranks[:] = kept  # the same list: the finalizer stops what it holds
        self._renumber(keep)
        size = len(keep) + num_new
        self._slots += self._take_slots(num_new)
        self._ranks.extend(self._new_actor(r, joined=True) for r in range(len(keep), size))
        where = self._await(
            {
                r: w.actor.locate.remote(r == 0 and keep[0] != 0)
                for r, w in enumerate(self._ranks)
                if r == 0 or r >= len(keep)
            },
            "__init__",
        )
        master_addr, master_port = self._contexts[0].master_addr, self._contexts[0].master_port
        if keep[0] != 0:
            master_addr, master_port = where[0]["ip"], where[0]["port"]
        nodes = [w.info.get("node_id") for w in kept] + [where[r]["node_id"] for r in range(len(keep), size)]
        self._contexts = contexts_on(nodes, master_addr, master_port)
        env = [self._env[r] for r in keep] + [dict(self.extra_env) for _ in range(num_new)]
        self._env = [{**e, **ctx.env()} for e, ctx in zip(env, self._contexts)]
        self._setup(list(range(len(keep), size)))
        return self._contexts

    def _end_actors(self, ranks: list[RankState], timeout: float | None) -> None:
        for w in ranks:
            w.unlink()
        exits = [w.actor.__ray_terminate__.remote() for w in ranks]
        if exits:
            ray.wait(exits, num_returns=len(exits), timeout=timeout)
        for w in ranks:
            _kill(w.actor)

    def _renumber(self, keep: list[int]) -> None:
        """Tell the kept actors whose rank changed their new number (for their errors and logs)."""
        moved = {r: w.actor.renumber.remote(r) for r, w in enumerate(self._ranks) if keep[r] != r}
        self._await(moved, "__init__")
        for r, w in enumerate(self._ranks):
            w.info["rank"] = r

    def _take_slots(self, num: int) -> list[tuple[Any, int]]:
        """Bundles for ``num`` new ranks: freed ones first, then a placement group of their own."""
        taken, self._free_slots = self._free_slots[:num], self._free_slots[num:]
        if len(taken) < num:
            p = self._pool
            more = ResourcePool(
                [num - len(taken)],
                use_gpu=p.use_gpu,
                max_colocate_count=p.max_colocate_count,
                num_cpus_per_worker=p.num_cpus_per_worker,
            )
            placement = ray_placement.acquire(
                more,
                extra_resources=self.resources_per_worker,
                timeout=self.placement_timeout,
                name=f"{self._group_name}-grow{len(self._placements)}",
            )
            self._placements.append(placement)
            taken += [(placement.groups[0], i) for i in range(num - len(taken))]
        return taken

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
            _stop(self._ranks, self._placements, self.shutdown_grace)

    def worker_info(self) -> list[dict[str, Any]]:
        return [{"rank": r, **w.info} for r, w in enumerate(self._ranks)]

    def report(self, ranks: list[int], budget_s: float) -> dict[int, RankReport]:
        """Where each of ``ranks`` is, asked of its actor's reporter thread (``runtime/reports.py``)."""
        return ask_all(reporters({r: self._ranks[r] for r in ranks}), budget_s)

    def cancel(
        self, ranks: list[int], method: str, max_age_s: float, interrupt: bool, budget_s: float
    ) -> dict:
        """Stop a call of ``method`` on each of ``ranks`` through its actor's reporter thread
        (``Capabilities.cancel``): a side channel, as for reports, so an actor busy with the call
        is reached too (``ray.cancel`` of a sync actor's call would wait behind it)."""
        return stop_all(reporters({r: self._ranks[r] for r in ranks}), budget_s, method, max_age_s, interrupt)

    # -- calls -------------------------------------------------------------------------------

    def submit(self, calls: list[Call]) -> list[RayFuture]:
        for c in calls:
            if not self._ranks[c.rank].ready.is_set():  # restarted by another thread: wait for it
                self._ranks[c.rank].ready.wait(self.start_timeout)
            died = self._ranks[c.rank].died
            if died is not None:
                raise WorkerDiedError(c.rank, c.method, f"{died.detail}; call restart() to bring it back")
        given, calls = calls, [self._unlinked(c) for c in calls]
        # Serialise every argument before sending anything (a value shared by several ranks, as in
        # ONE_TO_ALL, once). Then store and send call by call, so rank 0 starts on its chunk while
        # the next rank's chunk is still being copied into the object store.
        encoded: dict[int, Any] = {}
        for c in calls:
            names = [f"argument {i}" for i in range(len(c.args))] + [f"argument {k!r}" for k in c.kwargs]
            for what, v in zip(names, (*c.args, *c.kwargs.values())):
                if id(v) not in encoded:
                    encoded[id(v)] = encode_value(c, what, v)
        outbox = Outbox(self._ranks, calls, encoded, self._kept)
        futures = []
        try:
            for g, c in zip(given, calls):
                w = self._ranks[c.rank]
                with w.submit_lock:
                    args = [outbox.sent(v, w) for v in c.args]
                    kwargs = {k: outbox.sent(v, w) for k, v in c.kwargs.items()}
                    ref = self._send(w, c, args, kwargs)
                g.sent_bytes, g.handed_on_bytes = outbox.moved()
                futures.append(RayFuture(w, c.rank, c.method, ref, linked=w.link is not None))
        finally:
            outbox.discard()
        return futures

    def submit_refs(self, calls: list[Call]) -> list[Any]:
        """Send ``calls`` the way a Ray actor call goes, and return the ObjectRef of each call's
        result itself: ``ray.get`` gives the values (a worker's exception raises as its
        WorkerError), and passed to another Ray call, Ray resolves it there. For code written
        against Ray, which holds on to ObjectRefs (verl drivers); a group's own calls use
        ``submit``. Results stay in the object store (never the shared-memory link)."""
        for c in calls:
            died = self._ranks[c.rank].died
            if died is not None:
                raise WorkerDiedError(c.rank, c.method, f"{died.detail}; call restart() to bring it back")
        refs = []
        for c in map(self._unlinked, calls):
            names = [f"argument {i}" for i in range(len(c.args))] + [f"argument {k!r}" for k in c.kwargs]
            values = [
                store(encode_value(c, what, v)) for what, v in zip(names, (*c.args, *c.kwargs.values()))
            ]
            w = self._ranks[c.rank]
            with w.submit_lock:
                refs.append(
                    self._send(
                        w, c, values[: len(c.args)], dict(zip(c.kwargs, values[len(c.args) :])), plain=True
                    )
                )
        return refs

    def _send(self, w: RankState, c: Call, args: list, kwargs: dict[str, Any], plain: bool = False) -> Any:
        """Submit the task of call ``c`` (holding ``w.submit_lock``); its ObjectRef (of the plain
        result, with ``plain``: see :meth:`submit_refs`)."""
        # Other calls' replies (rank futures), by position or keyword: the worker unwraps them.
        replies: tuple[int | str, ...] = tuple(i for i, v in enumerate(c.args) if isinstance(v, RayFuture))
        replies += tuple(k for k, v in c.kwargs.items() if isinstance(v, RayFuture))
        direct = c.role is None and not replies and c.method in self._methods and not plain
        if not self._on_loop:
            if direct:
                # Small arguments packed in one bytes (ray_actor.pack_call); otherwise each as it
                # goes, unless one is the caller's own ObjectRef: Ray resolves it to whatever it
                # holds, which could be bytes too, so that call takes the general method.
                packed = pack_call(None, args, kwargs) if args or kwargs else None
                if packed is not None:
                    return getattr(w.actor, actor_method_name(c.method)).remote(packed)
                if not holds_object_refs(c):
                    return getattr(w.actor, actor_method_name(c.method)).remote(*args, **kwargs)
            general = w.actor.call_plain if plain else w.actor.call
            return general.remote((c.role, c.method, replies), *args, **kwargs)
        # An async actor awaits other calls' replies itself, in the call's turn: wrapped in a
        # list, an ObjectRef does not hold the task back (see ray_actor._AsyncRankActor).
        seq = w.next_seq
        packed = pack_call(seq, args, kwargs) if direct and (args or kwargs) else None
        if packed is not None:
            ref = getattr(w.actor, actor_method_name(c.method)).remote(packed)
        elif direct:  # the call's number first: an int, never bytes
            ref = getattr(w.actor, actor_method_name(c.method)).remote(seq, *args, **kwargs)
        else:
            args = [[a] if i in replies else a for i, a in enumerate(args)]
            kwargs = {k: [v] if k in replies else v for k, v in kwargs.items()}
            general = w.actor.call_plain if plain else w.actor.call
            ref = general.remote((seq, c.role, c.method, replies), *args, **kwargs)
        w.next_seq = seq + 1  # only once the task is submitted: the actor waits for every number
        return ref

    def _unlinked(self, c: Call) -> Call:
        """``c`` with the results of calls on linked ranks among its arguments (rank futures)
        waited for: a result that came back over a link is in this process, so it is sent on as a
        value (over the consumer's link, or through the object store). Any other rank future goes
        to the consumer as its ObjectRef, rank to rank."""
        values = (*c.args, *c.kwargs.values())
        produced = [v for v in values if isinstance(v, RayFuture) and v.linked]
        if not produced:
            return c
        settle_all(produced, None)

        def value(v: Any) -> Any:
            return v.value if isinstance(v, RayFuture) and v.came_linked else v

        return dataclasses.replace(
            c, args=tuple(map(value, c.args)), kwargs={k: value(v) for k, v in c.kwargs.items()}
        )

    def wait(self, futures: list[RayFuture], timeout: float | None = None) -> list[Sealed]:
        """The sealed results: opening them copies each buffer out of the object store once (or not
        at all, ``open(shared=True)``, for a collect that copies anyway)."""
        settle_all(futures, timeout)
        return [f.value for f in futures]

    # -- attaching to a detached group -------------------------------------------------------

    @classmethod
    def adopt(
        cls,
        name: str,
        *,
        ray_init_kwargs: dict[str, Any] | None = None,
        timeout: float = 60.0,
        shutdown_grace: float = 3.0,
    ) -> tuple[RayBackend, ResourcePool, ClassWithInitArgs, str]:
        """A backend driving the running detached group called ``name``, with what a WorkerGroup
        needs around it: its pool, its class and the name it was created with (see
        ``spmdcall.group.detached.attach``, which builds the group)."""
        _init_ray(dict(ray_init_kwargs or {}))
        group_name, actors = ray_detached.find_one(name)
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
            raise TimeoutError(
                f"no rank of the detached group {group_name} described it within {timeout:g} s"
            )
        backend = cls(detached=True, shutdown_grace=shutdown_grace)
        backend._adopt(group, actors)
        return backend, group["pool"], serialize.loads(group["payload"]), group_name

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
        self._placements = [self._placement]
        self._slots = [(self._placement.groups[node], local) for node, local in self._pool.placements()]
        for rank in range(self._pool.world_size):
            actor, name = actors.get(rank, (None, ""))
            w = RankState(actor, name, group["generations"][rank], dict(group["infos"][rank]))
            address = group.get("reporters", [None] * (rank + 1))[rank]
            if address is not None:  # the same reporter this rank's first controller asked
                w.reports = ReportClient(address=tuple(address), token=group["tokens"][rank])
            if actor is None:
                w.died = WorkerDiedError(rank, None, "its actor was gone when this controller attached")
            w.ready.set()
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


def _stop(ranks: list[RankState], placements: list[ray_placement.Placement], grace: float) -> None:
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
    for placement in placements:
        ray_placement.release(placement)


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:
        pass  # already gone


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
