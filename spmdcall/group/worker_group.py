"""WorkerGroup: N copies of a class driven from one controller (dispatch -> execute -> collect)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
import uuid
from collections.abc import Callable
from typing import Any

from spmdcall import tracing
from spmdcall.backends import Backend, Call, Capabilities, create_backend
from spmdcall.errors import WorkerError
from spmdcall.group.future import GroupFuture
from spmdcall.group.handoff import hand_off as handoff
from spmdcall.group.handoff import same_split
from spmdcall.group.modes import Dispatch, DispatchMode, Execute, MeshLayout
from spmdcall.group.register import ResolvedSpec, check_on_timeout, check_seconds, resolve_spec
from spmdcall.group.resize import ResizeGate
from spmdcall.group.stats import StatsCounter, TransferStats
from spmdcall.group.supervision import SlowCallWatch, gather_reports
from spmdcall.resource_pool import ResourcePool
from spmdcall.runtime import resize as rank_resize
from spmdcall.runtime.reports import RankReport
from spmdcall.runtime.specs import UNREGISTERED, MethodSpec, method_spec, public_methods
from spmdcall.worker import ClassWithInitArgs

__all__ = ["GroupFuture", "GroupMethod", "WorkerGroup"]


class GroupMethod:
    """A worker method as the group offers it: ``group.method(...)`` calls it on the ranks and,
    unless it was registered with ``blocking=False``, waits for the collected result.

    ``group.method.submit(...)`` makes the same call without waiting, whatever the method's
    ``blocking``, and returns its :class:`GroupFuture`; ``await group.method.submit(...)`` waits
    for it from asyncio. ``dispatch_mode``, ``execute_mode`` and ``blocking`` say how it is called
    (``group.bind`` chooses them at the call site).

    Example:
        >>> outs = await asyncio.gather(*(wg.generate.submit(b) for b in batches))  # doctest: +SKIP
    """

    def __init__(self, group: WorkerGroup, name: str, spec: ResolvedSpec, fn: Callable | None = None):
        self._group, self._name, self._spec = group, name, spec
        if fn is not None:
            functools.update_wrapper(self, fn)  # name, docstring and signature of the worker method

    dispatch_mode = property(lambda self: self._spec.dispatch_mode, doc="How arguments are split.")
    execute_mode = property(lambda self: self._spec.execute_mode, doc="Which ranks run it.")
    blocking = property(lambda self: self._spec.blocking, doc="Whether a call waits for the result.")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._group._call(self._name, self._spec, args, kwargs)

    def submit(self, *args: Any, **kwargs: Any) -> GroupFuture:
        """Call the method on the ranks and return at once; the result is the future's."""
        return self._group._call(self._name, self._spec, args, kwargs, blocking=False)

    def submit_refs(self, *args: Any, **kwargs: Any) -> list:
        """Call the method on the ranks and return the backend runtime's own reference to each
        running rank's result, uncollected: Ray ObjectRefs on the ray backend (``ray.get`` them or
        pass them to other Ray calls). For code written against that runtime, as verl drivers are;
        the backend must declare ``capabilities.refs``.

        Example:
            >>> ray.get(wg.bind("step", dispatch_mode=sc.Dispatch.ALL_TO_ALL).submit_refs([1, 2]))  # doctest: +SKIP
            [2, 4]
        """
        return self._group._submit_refs(self._name, self._spec, args, kwargs)

    def __repr__(self) -> str:
        return f"<group method {self._group.name}.{self._name}>"


def _layout_from_roles(mesh_name: str, roles: list) -> MeshLayout:
    missing = [r for r, role in enumerate(roles) if role is None]
    if missing:
        raise ValueError(
            f"ranks {missing} did not declare mesh {mesh_name!r}: call self.register_mesh({mesh_name!r}, ...) "
            f"on every rank (e.g. in __init__) before using nd_dispatch({mesh_name!r})"
        )
    dp_sizes = {role.dp_size for role in roles}
    if len(dp_sizes) != 1:
        raise ValueError(
            f"ranks disagree on the dp size of mesh {mesh_name!r}: {[role.dp_size for role in roles]}"
        )
    dp_size = dp_sizes.pop()
    dp_ranks = [role.dp_rank for role in roles]
    if set(dp_ranks) != set(range(dp_size)):
        raise ValueError(f"mesh {mesh_name!r}: dp ranks {dp_ranks} do not cover 0..{dp_size - 1}")
    collect = {
        d: [r for r, role in enumerate(roles) if role.dp_rank == d and role.is_collect]
        for d in range(dp_size)
    }
    bad = {d: ranks for d, ranks in collect.items() if len(ranks) != 1}
    if bad:
        raise ValueError(
            f"mesh {mesh_name!r}: every dp rank needs exactly one collect rank, got {bad} (dp rank -> collect ranks)"
        )
    return MeshLayout(mesh_name, dp_size, dp_ranks, [collect[d][0] for d in range(dp_size)])


# What a view from spawn() shares with its group (the processes, the pool and their settings).
_SHARED_WITH_VIEWS = (
    "resource_pool",
    "_gate",
    "cls_with_init",
    "default_timeout",
    "warn_after",
    "on_timeout",
    "_slow_calls",
    "_backend",
)


class WorkerGroup:
    """N copies of a class, one per rank of ``resource_pool``, called as if they were one object.

    Args:
        resource_pool: how many ranks, on which nodes.
        cls_with_init: the class to build on every rank, with its constructor arguments.
        backend: ``"process"`` (default), ``"inline"``, ``"ray"``, a registered name, or a Backend.
        name: a readable name (made unique) for traces and Ray actors.
        default_timeout: seconds after which any call without its own timeout raises
            CallTimeoutError, which carries where each rank still running is (``.reports``).
        warn_after: seconds after which a call still running (of a method without its own
            ``register(warn_after=...)``) logs where every rank is, once, on
            ``logging.getLogger("spmdcall")`` at WARNING, and goes on. None: no warning.
        on_timeout: what a deadline does to the ranks still running the call (for methods
            without their own ``register(on_timeout=...)``): ``"leave"`` (default: the call goes
            on; an ``async def`` call's task is cancelled), ``"interrupt"`` (``CallInterrupted``
            raised in the thread running it; ranks blocked in C past a grace period are
            restarted) or ``"restart"`` (the ranks are restarted). See docs/reliability.md.
        **backend_options: passed to the backend's constructor (e.g. ``start_timeout=60``).

    Example:
        >>> with WorkerGroup(ResourcePool([2]), ClassWithInitArgs(Counter, start=1)) as wg:  # doctest: +SKIP
        ...     wg.add(3)
        [4, 4]
    """

    def __init__(
        self,
        resource_pool: ResourcePool,
        cls_with_init: ClassWithInitArgs,
        backend: str | Backend = "process",
        *,
        name: str | None = None,
        default_timeout: float | None = None,
        warn_after: float | None = None,
        on_timeout: str = "leave",
        **backend_options: Any,
    ):
        if not isinstance(resource_pool, ResourcePool):
            raise TypeError(f"resource_pool must be a ResourcePool, got {type(resource_pool).__name__}")
        if not isinstance(cls_with_init, ClassWithInitArgs):
            raise TypeError(
                f"cls_with_init must be a ClassWithInitArgs, got {type(cls_with_init).__name__}; "
                f"wrap the class: ClassWithInitArgs(MyClass, *args, **kwargs)"
            )
        check_seconds("default_timeout", default_timeout)
        check_seconds("warn_after", warn_after)
        check_on_timeout(on_timeout, allow_none=False)
        self.resource_pool = resource_pool
        self._world_size = resource_pool.world_size  # changed by resize() only (views read the owner's)
        self._gate = ResizeGate()
        self.cls_with_init = cls_with_init
        self.default_timeout = default_timeout
        self.warn_after = warn_after
        self.on_timeout = on_timeout
        self.name = f"{name or cls_with_init.cls.__name__}-{uuid.uuid4().hex[:8]}"
        self._slow_calls = SlowCallWatch(self.name)
        self._cls = cls_with_init.cls
        self._role: str | None = None
        self._bound: dict[str, Callable] = {}
        self._mesh_layouts: dict[str, tuple[int, MeshLayout]] = {}  # name -> (resizes then, layout)
        self._closed = False
        self._parent: WorkerGroup | None = None  # the group a view from spawn() shares processes with
        self._stats = StatsCounter()
        self._backend = create_backend(backend, **backend_options)
        self._backend.start(resource_pool, cls_with_init, group_name=self.name)

    # -- views of colocated roles ------------------------------------------------------------

    def spawn(self, prefix_set: set[str] | list[str]) -> dict[str, WorkerGroup]:
        """One view per role of a colocated group; the views share this group's processes.

        Example:
            >>> views = WorkerGroup(pool, colocate({"actor": a, "critic": c})).spawn({"actor", "critic"})  # doctest: +SKIP
        """
        roles = self.cls_with_init.roles
        if not roles:
            raise TypeError(
                f"spawn() needs a group built from sc.colocate(...), this one runs {self._cls.__qualname__}"
            )
        unknown = sorted(set(prefix_set) - roles.keys())
        if unknown:
            raise ValueError(f"unknown roles {unknown}; this group colocates {sorted(roles)}")
        return {role: self._view(role, roles[role].cls) for role in prefix_set}

    def _view(self, role: str, cls: type) -> WorkerGroup:
        # A view is of this group's own class; attributes a subclass adds are not carried over.
        view = object.__new__(type(self))
        view.__dict__.update({k: self.__dict__[k] for k in _SHARED_WITH_VIEWS})
        view._cls, view._role, view._bound, view._mesh_layouts = cls, role, {}, {}
        view.name, view._closed, view._parent = f"{self.name}/{role}", False, self
        view._stats = StatsCounter()  # a view counts its own calls
        return view

    def _owner(self) -> WorkerGroup:
        """The group that started the processes (a view's parent, else this group)."""
        return self if self._parent is None else self._parent

    # -- methods -----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """How many ranks the group has now (``resize`` changes it)."""
        return self._owner()._world_size

    @property
    def capabilities(self) -> Capabilities:
        """What this group's backend declares it offers (``sc.Capabilities``); e.g. for a collect
        function, ``DataProto.concat(outputs, alloc=group.capabilities.result_alloc)``."""
        return self._backend.capabilities

    @property
    def backend(self) -> Backend:
        """The backend running this group's ranks (shared with its views): what the group's futures
        wait with and its supervision reports and stops calls with. Its ``capabilities`` are the
        group's; ``name`` says which backend it is."""
        return self._backend

    def worker_info(self) -> list[dict[str, Any]]:
        """``{"rank", "pid", "host"}`` of every rank."""
        return self._backend.worker_info()

    def status(self) -> dict[int, RankReport]:
        """Where every rank is now: ``{rank: RankReport}`` with the calls it runs, their ages, and
        the Python stack of each of its threads, taken while they run (on ``process`` and
        ``ray``, a side thread of each rank answers even while a call blocks in C). A rank that
        cannot answer within a second and a half gets a report whose ``note`` says why. What
        a backend reports is its own: see ``Capabilities.reports``.

        The name is the group's: a worker method called ``status`` is reached with
        ``group.bind("status")()`` or ``group.execute_all("status")``.

        Example:
            >>> fut = wg.train_step.submit(batch)  # doctest: +SKIP
            >>> for rank, report in wg.status().items():  # doctest: +SKIP
            ...     print(report.format())
            rank 0 (pid 4242): running train_step() for 12.3 s
              thread 'MainThread':
                File "train.py", line 40, in train_step
                  dist.all_reduce(t)
        """
        return gather_reports(self._backend, list(range(self.world_size)))

    def transfer_stats(self) -> TransferStats:
        """What this group's calls moved through the controller so far (:class:`TransferStats`):
        the bytes it serialised or copied for their arguments, the bytes of other groups'
        results it handed on rank to rank without copying them, and the bytes ``.get()``
        collected. The same figures are in ``sc.trace`` spans (each dispatch's and collect's
        ``args``).

        Example:
            >>> wg.transfer_stats().sent_bytes  # doctest: +SKIP
            2189
        """
        return self._stats.snapshot(self.capabilities.counts_bytes)

    def method_names(self) -> list[str]:
        return public_methods(self._cls)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.method_names()))

    def __getattr__(self, name: str) -> Callable:
        if name.startswith("_"):
            raise AttributeError(name)
        bound = self.__dict__.get("_bound", {}).get(name)
        if bound is not None:
            return bound
        cls = self.__dict__.get("_cls")
        spec = method_spec(cls, name) if cls is not None else None
        if spec is None:
            raise AttributeError(
                f"{cls.__qualname__ if cls else 'the worker'} has no public method {name!r}; "
                f"methods: {public_methods(cls) if cls else []}"
            )
        method = GroupMethod(self, name, resolve_spec(spec), getattr(cls, name))
        # Kept on the instance too: the next lookup finds it without coming here.
        self._bound[name] = self.__dict__[name] = method
        return method

    def bind(
        self,
        method: str,
        *,
        dispatch_mode: DispatchMode | str | dict | None = None,
        execute_mode: Execute | str | None = None,
        blocking: bool | None = None,
    ) -> GroupMethod:
        """The worker method ``method``, called with the modes chosen here: each one not given
        stays the method's own (its ``@register``; ONE_TO_ALL, ALL and blocking when unregistered).

        Example:
            >>> wg.bind("load", dispatch_mode=sc.Dispatch.ALL_TO_ALL)(["a.pt", "b.pt"])  # rank i loads entry i  # doctest: +SKIP
        """
        if not isinstance(method, str) or not method:
            raise TypeError(f"bind() takes a method name, got {method!r}")
        spec = method_spec(self._cls, method) or UNREGISTERED
        given: dict[str, Any] = {
            "dispatch_mode": dispatch_mode,
            "execute_mode": execute_mode,
            "blocking": blocking,
        }
        spec = dataclasses.replace(spec, **{k: v for k, v in given.items() if v is not None})
        return GroupMethod(self, method, resolve_spec(spec), getattr(self._cls, method, None))

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Run ``method`` on every rank with the same arguments; one result per rank."""
        return self._call(method, resolve_spec(UNREGISTERED), args, kwargs)

    def execute_all_async(self, method: str, *args: Any, **kwargs: Any) -> GroupFuture:
        spec = resolve_spec(MethodSpec(Dispatch.ONE_TO_ALL, Execute.ALL, blocking=False))
        return self._call(method, spec, args, kwargs)

    def execute_rank_zero(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on rank 0 only and return its result."""
        return self._call(
            method, resolve_spec(MethodSpec(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)), args, kwargs
        )

    def _call(
        self, method: str, spec: ResolvedSpec, args: tuple, kwargs: dict, blocking: bool | None = None
    ) -> Any:
        trace = tracing.active()
        start = time.time_ns()
        with self._gate:  # the ranks chosen are the ones the calls go to (group/resize.py)
            calls, pad_size, padded_rows = self._calls(method, spec, args, kwargs, hand_off=True)
            futures = self._backend.submit(calls)
        counts_bytes = self.capabilities.counts_bytes
        sent, handed_on = self._stats.add_calls(calls, counts_bytes)
        if trace is not None:
            moved = {"sent_bytes": sent, "handed_on_bytes": handed_on} if counts_bytes else {}
            trace.controller_span(
                f"{method} dispatch", start, {"group": self.name, "mode": spec.dispatch_mode.name, **moved}
            )
        stats = self._stats if self.capabilities.counts_bytes else None
        future = GroupFuture(self, method, spec, futures, pad_size, padded_rows, stats=stats)
        if future.warn_after is not None:
            self._slow_calls.watch(future, future.warn_after)
        return future.get() if (spec.blocking if blocking is None else blocking) else future

    def _submit_refs(self, method: str, spec: ResolvedSpec, args: tuple, kwargs: dict) -> list:
        if self._backend.capabilities.refs is None:
            raise TypeError(
                f"{method}.submit_refs(): the {self._backend.name} backend has no references of its own "
                "(its capabilities.refs is None); use .submit() for a GroupFuture"
            )
        with self._gate:
            calls, _, _ = self._calls(method, spec, args, kwargs, hand_off=False)
            return self._backend.submit_refs(calls)  # type: ignore[attr-defined]  # declared by capabilities.refs

    def _calls(
        self, method: str, spec: ResolvedSpec, args: tuple, kwargs: dict, *, hand_off: bool
    ) -> tuple[list[Call], int, int]:
        """The per-rank calls of one group call, with its padding (``pad_size``, ``padded_rows``)."""
        if self._closed or (self._parent is not None and self._parent._closed):
            raise RuntimeError(f"worker group {self.name} has been shut down")
        mode: DispatchMode = spec.dispatch_mode
        handed_off = None
        if hand_off and (args or kwargs):
            handed_off = same_split(self, spec, args, kwargs) or handoff(self, spec, args, kwargs)
        if handed_off is not None:
            dispatched_args, dispatched_kwargs = handed_off
        else:
            if spec.materialize_futures and (args or kwargs):
                args = tuple([a.get() if isinstance(a, GroupFuture) else a for a in args])
                if kwargs:
                    kwargs = {k: v.get() if isinstance(v, GroupFuture) else v for k, v in kwargs.items()}
            dispatched_args, dispatched_kwargs = mode.dispatch_fn(self, *args, **kwargs)
            self._check_dispatched(mode, method, dispatched_args, dispatched_kwargs)
        rank_zero = spec.execute_mode is Execute.RANK_ZERO or mode is Dispatch.RANK_ZERO
        ranks = [0] if rank_zero else range(self.world_size)
        pad_size = padded_rows = 0
        if dispatched_args or dispatched_kwargs:
            per_rank = list(itertools.chain(dispatched_args, dispatched_kwargs.values()))
            pad_size = max(getattr(v, "pad_size", 0) for v in per_rank)
            padded_rows = max(getattr(v, "padded_rows", 0) for v in per_rank)
            calls = [
                Call(
                    r,
                    method,
                    tuple([a[r] for a in dispatched_args]),
                    {k: v[r] for k, v in dispatched_kwargs.items()},
                    self._role,
                    handed_off=handed_off is not None,
                )
                for r in ranks
            ]
        else:  # nothing to split (a no-op, a query): the same empty arguments for every rank
            calls = [Call(r, method, (), {}, self._role) for r in ranks]
        return calls, pad_size, padded_rows

    def _check_dispatched(self, mode: DispatchMode, method: str, args: Any, kwargs: Any) -> None:
        if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
            raise TypeError(
                f"dispatch mode {mode.name} must return (args, kwargs), got ({type(args).__name__}, {type(kwargs).__name__})"
            )
        for what, v in itertools.chain(enumerate(args), kwargs.items()):
            if not isinstance(v, (list, tuple)) or len(v) != self.world_size:
                got = f"{len(v)} entries" if isinstance(v, (list, tuple)) else type(v).__name__
                raise ValueError(
                    f"{method}(): dispatch mode {mode.name} must give argument {what!r} as a list with one "
                    f"entry per rank ({self.world_size}), got {got}"
                )

    def mesh_layout(self, mesh_name: str) -> MeshLayout:
        """Where every rank sits in the mesh ``mesh_name``, asked from the workers once and cached."""
        resizes, layout = self._mesh_layouts.get(mesh_name, (-1, None))
        if layout is None or resizes != self._gate.resizes:  # asked again once the ranks changed
            try:
                roles = self._call("_spmd_mesh_role", resolve_spec(UNREGISTERED), (mesh_name,), {})
            except WorkerError as exc:
                if exc.exc_type != "AttributeError":
                    raise
                raise TypeError(
                    f"nd_dispatch({mesh_name!r}) needs workers that subclass sc.Worker and declare their place "
                    f"with self.register_mesh({mesh_name!r}, ...); {self._cls.__qualname__} does not"
                ) from None
            layout = _layout_from_roles(mesh_name, roles)
            self._mesh_layouts[mesh_name] = (self._gate.resizes, layout)
        return layout

    # -- lifecycle ---------------------------------------------------------------------------

    def grow(self, num_new: int, *, timeout: float | None = None) -> None:
        """Add ``num_new`` ranks after the last one (see :meth:`resize`).

        Example:
            >>> wg.grow(1); wg.world_size  # doctest: +SKIP
            3
        """
        if not (isinstance(num_new, int) and num_new >= 1):
            raise ValueError(f"grow() takes a number of new ranks >= 1, got {num_new!r}")
        self._resize(list(range(self.world_size)), num_new, timeout)

    def shrink(self, ranks: list[int], *, timeout: float | None = None) -> None:
        """Stop the ranks named (their numbers now); the others are renumbered ``0..n-1`` in order.
        Calls in flight on a stopped rank get ``timeout`` seconds (None: as long as they take) to
        finish, then fail with ``WorkerDiedError`` (see :meth:`resize`).

        Example:
            >>> wg.shrink([0]); wg.world_size  # rank 1 is rank 0 now  # doctest: +SKIP
            1
        """
        gone = set(ranks)
        bad = sorted(r for r in gone if not (isinstance(r, int) and 0 <= r < self.world_size))
        if bad or not gone:
            raise ValueError(f"shrink() takes ranks of this group (0..{self.world_size - 1}), got {ranks!r}")
        if len(gone) == self.world_size:
            raise ValueError(f"shrink({sorted(gone)}) would leave no rank; shutdown() stops them all")
        self._resize([r for r in range(self.world_size) if r not in gone], 0, timeout)

    def resize(self, num_ranks: int, *, timeout: float | None = None) -> None:
        """Grow or shrink the live group to ``num_ranks`` ranks: new ranks go after the last one,
        and shrinking stops the highest ranks.

        Calls in flight finish on the ranks they started on; calls made meanwhile wait until the
        resize is done and are split over the ranks it leaves. The ranks that stay are renumbered
        ``0..n-1`` in their order; each live rank is then told its place: ``RANK``,
        ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (and a ``Worker``'s ``self.rank``,
        ``self.world_size``) are its new ones, and its ``on_resize(rank, world_size)`` runs, if
        the class has one. New ranks are built with the new world size in their environment.

        A group whose ranks joined torch.distributed refuses (``RuntimeError``, before anything
        changes) unless the class overrides ``on_resize`` to rebuild the process group, on every
        rank at once (new ones included). The group must run on a backend that declares
        ``capabilities.resize`` (``TypeError`` otherwise). Views from ``spawn`` share the ranks:
        resizing one resizes all. The group's ``resource_pool`` stays the one it was built with.
        If a rank's ``on_resize`` raises, ``resize`` raises its ``WorkerError``, the group at its
        new size. A call in flight during a resize is supervised (reports, ``on_timeout``) by the
        rank numbers it was sent with.

        Args:
            num_ranks: the world size wanted (>= 1).
            timeout: seconds to wait for calls in flight, None: as long as they take. A resize
                first asks every rank whether it can be renumbered, a question each rank answers
                once the plain calls sent to it before are done (``CallTimeoutError`` past
                ``timeout``, and nothing changed); then calls still running on a rank that is
                stopped (``async def`` ones) get ``timeout`` seconds more before they fail with
                ``WorkerDiedError``.

        Example:
            >>> wg.resize(3)  # doctest: +SKIP
            >>> wg.add(1)   # ONE_TO_ALL now reaches 3 ranks  # doctest: +SKIP
            [2, 2, 2]
        """
        if not (isinstance(num_ranks, int) and num_ranks >= 1):
            raise ValueError(f"resize() takes a world size >= 1, got {num_ranks!r}")
        size = self.world_size
        self._resize(list(range(min(size, num_ranks))), max(0, num_ranks - size), timeout)

    def _resize(self, keep: list[int], num_new: int, timeout: float | None) -> None:
        owner, backend = self._owner(), self._backend
        if not backend.capabilities.resize:
            raise TypeError(
                f"the {backend.name} backend cannot resize a live group (its capabilities.resize is False); "
                "build a new group of the size wanted instead"
            )
        check_seconds("timeout", timeout)
        with owner._gate.resizing():
            if owner._closed:
                raise RuntimeError(f"worker group {owner.name} has been shut down")
            size = owner._world_size
            if keep == list(range(size)) and not num_new:
                return
            # Asked in turn with each rank's calls: a rank answers once its plain calls in flight are done.
            refusals = self._on_every_rank(rank_resize.CAN_RESIZE, [() for _ in range(size)], timeout)
            refused = [f"rank {r}: {why}" for r, why in enumerate(refusals) if why]
            if refused:
                raise RuntimeError(f"cannot resize {owner.name}: " + "; ".join(refused))
            contexts = backend.resize(keep, num_new, timeout=timeout)  # type: ignore[attr-defined]  # declared by capabilities.resize
            owner._world_size = len(contexts)
            self._on_every_rank(rank_resize.RESIZE, [(ctx,) for ctx in contexts], self.default_timeout)

    def _on_every_rank(self, method: str, args: list[tuple], timeout: float | None) -> list:
        """Run one of the runtime's own calls (``runtime/resize.py``) on every rank, rank r with ``args[r]``."""
        futures = self._backend.submit([Call(r, method, a) for r, a in enumerate(args)])
        return [sealed.open() for sealed in self._backend.wait(futures, timeout)]

    def restart(self, ranks: list[int] | None = None) -> None:
        """Bring ranks back (all dead ones by default) by building the class again with the same environment."""
        owner = self._owner()
        if ranks is not None:
            bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.world_size)]
            if bad:
                raise ValueError(f"ranks {bad} are not in this group (world size {self.world_size})")
            ranks = sorted(set(ranks))
        owner._backend.restart(ranks)
        self._mesh_layouts.clear()  # restarted ranks declare their meshes again

    @property
    def closed(self) -> bool:
        """Whether ``shutdown()`` has been called (on this group or a view of its processes)."""
        return self._owner()._closed

    def shutdown(self) -> None:
        """Stop every worker process. Views from ``spawn`` share processes: shutting one down stops all."""
        owner = self._owner()
        if not owner._closed:
            owner._closed = True
            owner._slow_calls.close()
            owner._backend.shutdown()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name}, world_size={self.world_size}, backend={self._backend.name})"
