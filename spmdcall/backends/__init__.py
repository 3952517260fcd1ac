"""Backends: where the workers of a group live. One small protocol, several implementations.

Built in: ``inline`` (objects in the controller's process), ``process`` (local processes, the
default), ``ray`` (Ray actors) and ``monarch`` (PyTorch Monarch actors). Third parties add more with :func:`register_backend` or through
the entry-point group ``spmdcall.backends``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from spmdcall.errors import missing_extra

if TYPE_CHECKING:
    from spmdcall.resource_pool import ResourcePool
    from spmdcall.transport.envelope import Sealed
    from spmdcall.worker import ClassWithInitArgs

ENTRY_POINT_GROUP = "spmdcall.backends"


@dataclass
class Call:
    """One method call on one rank. ``role`` picks a role of a colocated worker. ``handed_off``:
    the arguments are other calls' rank outputs passed on unchanged (see ``GroupFuture``), which
    nothing in the controller writes to; a backend may pass their memory on instead of a copy.

    A backend that declares ``Capabilities.counts_bytes`` records, once it has sent the call, what
    the controller moved for it: ``sent_bytes``, the bytes it serialised or copied itself (the
    pickle and the buffers copied into its transport), and ``handed_on_bytes``, the bytes of
    other calls' results it passed on without touching them (shared-memory segments forwarded, the
    runtime's references to results passed on: the size of what they refer to).
    Calls that share one message (the same arguments to several ranks) count it once, on the
    first of them."""

    rank: int
    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    role: str | None = None
    handed_off: bool = False
    sent_bytes: int = 0
    handed_on_bytes: int = 0


@runtime_checkable
class RankFuture(Protocol):
    """The pending result of a :class:`Call` on one rank. Shared between threads: any thread may
    wait on it, and any thread may settle it (see ``backends/futures.py`` for a base class)."""

    rank: int
    method: str

    # Worker-side wall-clock times of the call (time.time_ns()), known once it finishes; for tracing.
    @property
    def started_ns(self) -> int: ...

    @property
    def finished_ns(self) -> int: ...

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any:
        """The value; raises WorkerError, WorkerDiedError or CallTimeoutError."""
        ...

    def exception(self) -> BaseException | None:
        """The error of a future that is done and failed; None if it succeeded or is still pending.
        Never blocks."""
        ...

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(self)`` once the future is done, from whatever thread finds out (at once if it
        is done already), even when no thread waits on it: asyncio awaits futures this way, so
        the backend must notice the result on its own (a reader thread, a callback of its runtime)."""
        ...


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond moving calls. Declared on the backend (its ``capabilities``) and
    read by the group: nothing about a backend is sniffed, compared by type or decided by its name.

    The defaults are a plain backend's: the group waits for rank futures passed into a call and
    sends their values on, and collected results go into ordinary memory.
    """

    hand_off: type | None = None
    """The class of rank futures that ``submit`` takes as argument values and resolves on the worker
    (rank i's output goes to rank i without passing through the controller): futures of another
    group whose every rank future is an instance of it. None: the group resolves them first."""
    result_alloc: Callable[[int], Any] | None = None
    """Memory for large collected results: ``result_alloc(nbytes)`` returns a writable uint8 numpy
    array of that size, or None for ordinary memory (``DataProto.concat(..., alloc=...)``)."""
    ranks_in_own_processes: bool = True
    """Every rank runs in a process of its own (``worker_info()`` gives its pid): it has its own
    ``os.environ``, and it can die without the controller. False for ranks inside the controller."""
    refs: type | None = None
    """The class of its runtime's own references to results (``ray.ObjectRef`` on ray), for code
    written against that runtime. When set, the backend has ``submit_refs(calls)``, which sends the
    calls and returns one such reference per call, to the call's plain result; and references of
    this class given as argument values reach the workers as the values they stand for. None: the
    backend has no references of its own (``GroupMethod.submit_refs`` refuses)."""
    counts_bytes: bool = False
    """The backend records on each :class:`Call` it sends the bytes the controller serialised or
    copied for it and those it handed on from other calls' results (``Call.sent_bytes``,
    ``Call.handed_on_bytes``), and its results are sealed with their size known (an ``Envelope``
    or ``Opened.as_sent``): ``WorkerGroup.transfer_stats()`` and traces report them. False: they report
    None."""
    reports: bool = False
    """The backend can say where its ranks are: it has ``report(ranks, budget_s)``, which returns
    ``{rank: RankReport}`` (``spmdcall.runtime.reports``): each rank's running calls and the stack
    of each of its threads, taken while the rank runs (a side thread answers even when the thread
    running a call is blocked in C), within ``budget_s`` seconds; a rank that cannot answer in
    time gets a report whose ``note`` says so. False: reports name the controller's view of the
    calls only (method and age), without stacks."""
    cancel: bool = False
    """The backend can stop a call still running on a rank: it has ``cancel(ranks, method,
    max_age_s, interrupt, budget_s)``, which on each of ``ranks`` stops the oldest running call
    of ``method`` started at most ``max_age_s`` seconds ago (``RunningCalls.stop``): an ``async
    def`` call's task is cancelled; a plain call gets ``CallInterrupted`` raised in its thread
    only with ``interrupt``. It asks from a side channel that answers while the rank is busy,
    within ``budget_s`` seconds, and returns ``{rank: "cancelled" | "interrupted" | "left" | ""
    (no such call runs there) | None (the rank did not answer in time)}``.
    False: a deadline leaves async calls running, and ``on_timeout="interrupt"`` restarts the
    ranks instead."""
    env: bool = False
    """The backend's factory takes ``env={name: value}``: variables set in every rank's process
    before its class is built, beside its SPMD variables. False: it takes no ``env=``."""
    detached: bool = False
    """The backend's workers can outlive the controller that started them: its factory takes
    ``detached=True``, and has ``adopt(name, *, timeout, shutdown_grace, **options)``, which
    returns ``(backend, pool, cls_with_init, group_name)``: a backend driving the running detached
    group called ``name`` from this controller, and what a group needs around it
    (:func:`adopt_detached`; ``attach`` adds ``ray_init_kwargs`` when it is given one). False: the
    workers end with their controller."""

    resize: bool = False
    """The backend can add and remove ranks while its group lives: it has ``resize(keep, num_new,
    timeout)``, which keeps the ranks ``keep`` (in that order, renumbered ``0..len(keep)-1``),
    starts ``num_new`` ranks after them with the new world size in their environment, stops the
    others and returns the ``SPMDContext`` of every rank it now has, in rank order. Calls in
    flight on a kept rank finish there; those on a rank it stops get ``timeout`` seconds (None:
    as long as they take) to finish before they fail with ``WorkerDiedError``. The kept ranks
    learn their new place from the group (``runtime/resize.py``), not from the backend. False:
    the group's size is fixed (``WorkerGroup.resize`` raises ``TypeError``)."""


# The future type of one backend: ``wait`` only ever gets futures its own ``submit`` returned.
_F = TypeVar("_F", bound=RankFuture)


@runtime_checkable
class Backend(Protocol[_F]):
    """Starts the workers of one group, runs calls on them, and stops them. This class is the
    whole contract: a backend has these members and nothing else is asked of it. It moves calls
    and results; what the values are (a DataProto, a tensor) is never its business.

    Every member may be called from several threads at once (and ``wait`` on futures another
    thread made); see ``docs/backends/writing-a-backend.md`` for a complete minimal backend.
    """

    name: str
    capabilities: Capabilities

    def start(self, pool: ResourcePool, cls_with_init: ClassWithInitArgs, *, group_name: str) -> None:
        """Start ``pool.world_size`` workers (each with its SPMD environment) and build the class on each."""
        ...

    def submit(self, calls: list[Call]) -> list[_F]:
        """Send every call (serialising all of them first, so nothing is sent if one cannot be)."""
        ...

    def wait(self, futures: list[_F], timeout: float | None = None) -> list[Sealed]:
        """The results in the order given, sealed (``transport.envelope``: an ``Envelope``, or
        ``Opened(value)`` for a value at hand); raises the first failure as soon as it is known,
        ``CallTimeoutError`` after ``timeout`` seconds."""
        ...

    def worker_info(self) -> list[dict[str, Any]]:
        """One dict per rank: at least ``pid`` and ``host``."""
        ...

    def restart(self, ranks: list[int] | None) -> None:
        """Start the given ranks (None: the dead ones) again: same SPMD environment, constructor run again."""
        ...

    def shutdown(self) -> None:
        """Stop every worker; safe to call twice."""
        ...


_BUILTIN = {
    "inline": "spmdcall.backends.inline:InlineBackend",
    "process": "spmdcall.backends.process.backend:ProcessBackend",
    "ray": "spmdcall.backends.ray.backend:RayBackend",
    "monarch": "spmdcall.backends.monarch.backend:MonarchBackend",
}
# The package a built-in backend needs beyond spmdcall's own dependencies (its extra installs it).
_NEEDS = {"ray": "ray", "monarch": "monarch"}
_registry: dict[str, Callable[..., Backend] | str] = dict(_BUILTIN)
_entry_points_loaded = False


def register_backend(name: str, factory: Callable[..., Backend], *, overwrite: bool = False) -> None:
    """Make ``WorkerGroup(..., backend=name)`` build its backend with ``factory(**backend_options)``.

    Example:
        >>> register_backend("my-cluster", MyClusterBackend)  # doctest: +SKIP
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a backend name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"backend factory for {name!r} must be callable, got {type(factory).__name__}")
    if name in _registry and not overwrite and _registry[name] is not factory:
        raise ValueError(f"backend {name!r} is already registered; pass overwrite=True to replace it")
    _registry[name] = factory


def available_backends() -> list[str]:
    """The backend names a group accepts here: every registered one, less a built-in one whose
    package is not installed (Ray for ``ray``: ``pip install "spmdcall[ray]"``).

    Example:
        >>> "process" in available_backends()
        True
    """
    _load_entry_points()
    return sorted(name for name in _registry if name not in _NEEDS or importlib.util.find_spec(_NEEDS[name]))


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        _registry.setdefault(ep.name, f"{ep.value}")


def _import(target: str) -> Callable[..., Backend]:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def create_backend(backend: str | Backend, **options: Any) -> Backend:
    """A backend from its registered name, or the given instance unchanged."""
    if not isinstance(backend, str):
        if options:
            raise TypeError(f"backend options {sorted(options)} only apply when the backend is given by name")
        if not isinstance(backend, Backend):
            raise TypeError(
                f"backend must be a registered name or a Backend instance, got {type(backend).__name__}"
            )
        return backend
    return _factory(backend)(**options)


def backend_options(backend: str | Backend) -> frozenset[str]:
    """The keyword options the backend's factory declares by name (what ``WorkerGroup(...,
    **backend_options)`` may pass it: ``env``, ``detached``...); none for a backend instance.

    Example:
        >>> "env" in backend_options("process")
        True
    """
    if not isinstance(backend, str):
        return frozenset()
    params = inspect.signature(_factory(backend)).parameters.values()
    return frozenset(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def backend_capabilities(backend: str | Backend) -> Capabilities:
    """What a backend declares it offers, known before one is built: an instance's own
    ``capabilities``, or for a registered name its factory's (a Backend class declares them as a
    class attribute, as the built-in ones do).

    Example:
        >>> backend_capabilities("inline").ranks_in_own_processes
        False
    """
    if not isinstance(backend, str):
        return backend.capabilities
    try:
        declared = _factory(backend).capabilities  # type: ignore[attr-defined]  # the Backend protocol's
    except AttributeError:  # a factory that is a function, not a Backend class
        declared = None
    if not isinstance(declared, Capabilities):
        raise TypeError(
            f"backend {backend!r}: its factory declares no capabilities (a Backend class has them as "
            f"a class attribute: capabilities = sc.Capabilities(...))"
        )
    return declared


def adopt_detached(
    backend: str, name: str, **options: Any
) -> tuple[Backend, ResourcePool, ClassWithInitArgs, str]:
    """A backend driving the running detached group called ``name``, with what a group needs
    around it: ``(backend, pool, cls_with_init, group_name)`` (``spmdcall.group.detached.attach``
    builds the group). ``backend``: a registered name whose capabilities declare ``detached``;
    ``options`` go to its factory's ``adopt``."""
    if not backend_capabilities(backend).detached:
        raise ValueError(
            f"the {backend!r} backend keeps no workers without their controller (its capabilities.detached "
            "is False): attach to a group of a backend that does (ray)"
        )
    return _factory(backend).adopt(name, **options)  # type: ignore[attr-defined]  # declared by capabilities.detached


def _factory(backend: str) -> Callable[..., Backend]:
    if backend not in _registry:
        _load_entry_points()
    try:
        factory = _registry[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; available: {sorted(_registry)}") from None
    if isinstance(factory, str):
        try:
            factory = _registry[backend] = _import(factory)
        except ModuleNotFoundError as exc:
            raise missing_extra(exc, f"the {backend!r} backend") from None
    return factory
