"""Dispatch and execute modes, and the registry that third-party code extends.

A dispatch mode is a pair of plain functions with verl's signatures:

- ``dispatch_fn(group, *args, **kwargs) -> (args, kwargs)``: every returned value is a list with one
  entry per rank (``group.world_size`` long);
- ``collect_fn(group, outputs: list) -> Any``: merges the per-rank results.

Modes are found by object (``Dispatch.DP_COMPUTE_PROTO``), by name (``"DP_COMPUTE_PROTO"``), by a
``{"dispatch_fn": f, "collect_fn": g}`` dict, or from another installed package through the
entry-point group ``spmdcall.dispatch_modes``.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from spmdcall.lazy import loaded

DispatchFn = Callable[..., "tuple[tuple, dict]"]
CollectFn = Callable[[Any, list], Any]

ENTRY_POINT_GROUP = "spmdcall.dispatch_modes"


@dataclass(eq=False)
class DispatchMode:
    """A named (dispatch_fn, collect_fn) pair usable in ``@register(dispatch_mode=...)``.

    A registered mode is one object for the life of the process: ``register_dispatch_mode(name,
    ..., overwrite=True)`` replaces its two functions in place, so every method declared with it
    follows (as in verl, whose registry is read at every call).
    """

    name: str
    dispatch_fn: DispatchFn
    collect_fn: CollectFn
    splits_data: bool = False
    """``dispatch_fn`` splits every data argument into per-rank chunks, in rank order (as
    DP_COMPUTE_PROTO does): a GroupFuture from such a mode can then feed rank i's output to rank i
    of a group whose mode also splits data, without a concat and a re-split."""
    copies_data: bool = False
    """``collect_fn`` copies what it keeps of DataProto results (it concatenates them): the group
    may then give it DataProtos whose tensors are read-only views of the transport's memory (Ray's
    object store), saving a copy of each result before its own."""
    broadcasts: bool = False
    """``dispatch_fn`` gives every rank each argument as it is (ONE_TO_ALL, RANK_ZERO): a
    GroupFuture argument may then reach each rank straight from its producer ranks
    (``group/handoff.py``) instead of being collected on the controller first."""
    row_chunks: Callable[[Any], list[int]] | None = None
    """``row_chunks(group)``: ``dispatch_fn`` splits every argument, a DataProto, as
    :func:`split_data` splits it into ``max(...) + 1`` chunks, and rank r gets chunk
    ``row_chunks(group)[r]`` (DP_COMPUTE_PROTO: chunk r; ``nd_dispatch``: its dp rank's). A
    GroupFuture's rows may then go to each rank straight from the producer ranks."""
    row_sources: Callable[[Any], list[int]] | None = None
    """``row_sources(group)``: ``collect_fn`` concatenates the DataProto outputs of these ranks,
    in this order (``DataProto.concat``; DP_COMPUTE_PROTO: every rank; ``nd_dispatch``: the collect
    ranks), so a consumer can take its rows from those outputs themselves."""

    def __repr__(self) -> str:
        return f"DispatchMode({self.name!r})"

    def __reduce__(self):
        # A registered mode unpickles as the registry's object, so identity checks such as
        # ``mode is Dispatch.RANK_ZERO`` survive a trip through pickle (cloudpickle re-sets the
        # attributes of classes defined in __main__ when their instances come back).
        if _registry.get(self.name) is self:
            return (_unpickle_registered, self._fields())
        return (DispatchMode, self._fields())

    def _fields(self) -> tuple:
        return (self.name, self.dispatch_fn, self.collect_fn, self.splits_data, self.copies_data)


def _unpickle_registered(
    name: str, dispatch_fn: DispatchFn, collect_fn: CollectFn, splits_data: bool, copies_data: bool
) -> DispatchMode:
    # The registry's mode of that name where there is one; a mode registered only by the sender
    # (e.g. in a script's __main__, which worker processes never run) is registered here too.
    if name not in _registry:
        _load_entry_points()
    with _registry_lock:
        return _registry.setdefault(
            name, DispatchMode(name, dispatch_fn, collect_fn, splits_data, copies_data)
        )


class Execute(enum.Enum):
    """Which ranks run a method: every rank, or rank 0 alone (its result is returned uncollected)."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


class Chunks(list):
    """Per-rank values produced by splitting a batch, remembering the rows appended as padding.

    ``padded_rows`` is the size of the padded batch that was split, ``pad_size`` how many of its
    rows are padding. The group strips the padding's results from the collected output, so
    third-party dispatch functions that split with :func:`split_data` get unpadding for free.
    """

    def __init__(self, values, pad_size: int = 0, padded_rows: int = 0):
        super().__init__(values)
        self.pad_size = pad_size
        self.padded_rows = padded_rows


# ---------------------------------------------------------------------------------------------
# Built-in dispatch and collect functions


def is_data_proto(value: Any) -> bool:
    """Whether ``value`` is a DataProto, without importing ``spmdcall.data`` (and torch)."""
    # spmdcall.data imports torch; a value can only be a DataProto if that module was loaded.
    data = loaded("spmdcall.data")
    return data is not None and isinstance(value, data.DataProto)


def split_data(value: Any, world_size: int, *, what: str = "argument") -> Chunks:
    """Split one DataProto into ``world_size`` equal chunks, padding with leading rows if needed.

    Args:
        value: a DataProto with at least one row.
        world_size: the number of chunks.
        what: how the value is named in error messages.

    Example:
        >>> chunks = split_data(batch_of_7_rows, 2)   # doctest: +SKIP
        >>> [len(c) for c in chunks], chunks.pad_size
        ([4, 4], 1)
    """
    if not is_data_proto(value):
        raise TypeError(
            f"{what} of type {type(value).__name__} cannot be split across ranks: a data-parallel "
            "dispatch mode expects a DataProto (or a GroupFuture of one); pass other values to a "
            "ONE_TO_ALL method or wrap them with DataProto.from_dict(...)"
        )
    if len(value) == 0:
        raise ValueError(f"{what} is an empty DataProto (0 rows): there is nothing to split across ranks")
    from spmdcall.data import pad_dataproto_to_divisor

    padded, pad_size = pad_dataproto_to_divisor(value, world_size)
    return Chunks(padded.chunk(world_size), pad_size=pad_size, padded_rows=len(padded))


def _check_per_rank_list(mode: str, what: str, value: Any, world_size: int) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != world_size:
        got = (
            f"a {type(value).__name__} of length {len(value)}"
            if isinstance(value, (list, tuple))
            else f"a {type(value).__name__}"
        )
        raise ValueError(
            f"{mode}: {what} must be a list with one entry per rank ({world_size} entries), got {got}"
        )


def dispatch_one_to_all(group, *args, **kwargs):
    """Every rank receives the same arguments."""
    if not args and not kwargs:
        return (), {}
    n = group.world_size
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def dispatch_all_to_all(group, *args, **kwargs):
    """Arguments are already per-rank lists; rank i receives entry i of each."""
    for i, a in enumerate(args):
        _check_per_rank_list("ALL_TO_ALL", f"argument {i}", a, group.world_size)
    for k, v in kwargs.items():
        _check_per_rank_list("ALL_TO_ALL", f"argument {k!r}", v, group.world_size)
    return args, kwargs


def dispatch_dp_compute(group, *args, **kwargs):
    """Like ALL_TO_ALL: the caller has already split the data into one entry per rank."""
    for i, a in enumerate(args):
        _check_per_rank_list("DP_COMPUTE", f"argument {i}", a, group.world_size)
    for k, v in kwargs.items():
        _check_per_rank_list("DP_COMPUTE", f"argument {k!r}", v, group.world_size)
    return args, kwargs


def dispatch_dp_compute_data_proto(group, *args, **kwargs):
    """Split every DataProto argument into ``world_size`` chunks (padded to equal size)."""
    n = group.world_size
    split_args = tuple(split_data(a, n, what=f"argument {i}") for i, a in enumerate(args))
    split_kwargs = {k: split_data(v, n, what=f"argument {k!r}") for k, v in kwargs.items()}
    _check_same_length(list(args) + list(kwargs.values()))
    return split_args, split_kwargs


def dispatch_dp_compute_data_proto_with_func(group, fn, *args, **kwargs):
    """The first argument (a function) goes to every rank; the DataProto arguments are split."""
    if not callable(fn):
        raise TypeError(
            f"DP_COMPUTE_PROTO_WITH_FUNC expects a function as first argument, got {type(fn).__name__}"
        )
    split_args, split_kwargs = dispatch_dp_compute_data_proto(group, *args, **kwargs)
    return ([fn] * group.world_size, *split_args), split_kwargs


def _check_same_length(values: list) -> None:
    lengths = {len(v) for v in values if is_data_proto(v)}
    if len(lengths) > 1:
        raise ValueError(
            f"DataProto arguments of one call must have the same number of rows, got lengths {sorted(lengths)}"
        )


def collect_all_to_all(group, outputs: list) -> list:
    """One result per rank, in rank order."""
    return list(outputs)


def collect_dp_compute_data_proto(group, outputs: list):
    """Concatenate per-rank DataProto results in rank order (non-DataProto results stay a list).
    Large columns are joined into the memory the group's backend offers (``group.capabilities.result_alloc``:
    the process backend lends free shared-memory segments whose pages are in memory already)."""
    if outputs and all(is_data_proto(o) for o in outputs):
        from spmdcall.data import DataProto

        return DataProto.concat(outputs, alloc=group.capabilities.result_alloc)
    return list(outputs)


# ---------------------------------------------------------------------------------------------
# The registry

_registry: dict[str, DispatchMode] = {}
_registry_lock = threading.Lock()
_entry_points_loaded = False


def register_dispatch_mode(
    name: str,
    dispatch_fn: DispatchFn,
    collect_fn: CollectFn,
    *,
    splits_data: bool = False,
    copies_data: bool = False,
    overwrite: bool = False,
) -> DispatchMode:
    """Add a dispatch mode that ``@register`` can use by object or by name.

    The mode is then also ``Dispatch.<name>``.

    Args:
        name: the mode's name; ``@register(dispatch_mode=name)`` finds it.
        dispatch_fn: ``dispatch_fn(group, *args, **kwargs) -> (args, kwargs)``, each value a per-rank list.
        collect_fn: ``collect_fn(group, outputs) -> result``.
        splits_data: ``dispatch_fn`` splits every data argument into per-rank chunks in rank order
            (see :attr:`DispatchMode.splits_data`): outputs may then pass rank to rank between groups.
        copies_data: ``collect_fn`` copies what it keeps of DataProto results
            (see :attr:`DispatchMode.copies_data`).
        overwrite: give an existing mode of the same name (built-in ones included) these
            functions and declarations, in place, instead of raising: every method declared with it
            follows.

    Example:
        >>> def first_only(group, outputs): return outputs[0]
        >>> ONE_RESULT = register_dispatch_mode("ONE_RESULT", dispatch_one_to_all, first_only)
        >>> Dispatch.ONE_RESULT is ONE_RESULT
        True
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a dispatch mode name must be a non-empty string, got {name!r}")
    for what, fn in (("dispatch_fn", dispatch_fn), ("collect_fn", collect_fn)):
        if not callable(fn):
            raise TypeError(f"{what} of dispatch mode {name!r} must be callable, got {type(fn).__name__}")
    with _registry_lock:
        new = DispatchMode(name, dispatch_fn, collect_fn, bool(splits_data), bool(copies_data))
        existing = _registry.get(name)
        if existing is None:
            existing = _registry[name] = new
        elif existing._fields() != new._fields():
            if not overwrite:
                raise ValueError(
                    f"dispatch mode {name!r} is already registered; pass overwrite=True to replace it"
                )
            existing.dispatch_fn, existing.collect_fn = dispatch_fn, collect_fn
            existing.splits_data, existing.copies_data = new.splits_data, new.copies_data
            # New functions: what the old ones did with rows and futures is no longer declared.
            existing.broadcasts, existing.row_chunks, existing.row_sources = False, None, None
    return existing


def unregister_dispatch_mode(name: str) -> None:
    """Remove the third-party mode ``name`` (built-in modes stay). Methods declared with it keep it.

    Example:
        >>> unregister_dispatch_mode("ONE_RESULT")  # doctest: +SKIP
    """
    if name in _BUILTIN_NAMES:
        raise ValueError(f"{name} is a built-in dispatch mode and cannot be removed")
    with _registry_lock:
        if _registry.pop(name, None) is None:
            raise KeyError(f"no dispatch mode named {name!r} is registered")
    _nd_modes.pop(name.removeprefix("nd_dispatch:"), None)


def _every_rank(group: Any) -> list[int]:
    return list(range(group.world_size))


def _builtin(name: str, dispatch_fn: DispatchFn, collect_fn: CollectFn, **declared: Any) -> DispatchMode:
    mode = DispatchMode(name, dispatch_fn, collect_fn, **declared)
    _registry[name] = mode
    return mode


class _ModeNamespace(type):
    # ``Dispatch.<NAME>`` of a mode registered after the class was built (a third party's): the
    # registry's mode of that name, as verl's Dispatch enum grows when a mode is registered.
    def __getattr__(cls, name: str) -> DispatchMode:
        if not name.startswith("_"):
            mode = _registry.get(name)
            if mode is not None:
                return mode
        raise AttributeError(f"type object 'Dispatch' has no attribute {name!r}")


class Dispatch(metaclass=_ModeNamespace):
    """The built-in dispatch modes (verl's names), and ``Dispatch.<NAME>`` for every mode
    registered with :func:`register_dispatch_mode`: third-party modes live in the same registry."""

    ONE_TO_ALL = _builtin("ONE_TO_ALL", dispatch_one_to_all, collect_all_to_all, broadcasts=True)
    ALL_TO_ALL = _builtin("ALL_TO_ALL", dispatch_all_to_all, collect_all_to_all)
    RANK_ZERO = _builtin("RANK_ZERO", dispatch_one_to_all, collect_all_to_all, broadcasts=True)
    DP_COMPUTE = _builtin("DP_COMPUTE", dispatch_dp_compute, collect_all_to_all)
    DP_COMPUTE_PROTO = _builtin(
        "DP_COMPUTE_PROTO",
        dispatch_dp_compute_data_proto,
        collect_dp_compute_data_proto,
        splits_data=True,
        copies_data=True,
        row_chunks=_every_rank,
        row_sources=_every_rank,
    )
    DP_COMPUTE_PROTO_WITH_FUNC = _builtin(
        "DP_COMPUTE_PROTO_WITH_FUNC",
        dispatch_dp_compute_data_proto_with_func,
        collect_dp_compute_data_proto,
        copies_data=True,
    )
    DP_COMPUTE_METRIC = _builtin(
        "DP_COMPUTE_METRIC",
        dispatch_dp_compute_data_proto,
        collect_all_to_all,
        splits_data=True,
        row_chunks=_every_rank,
    )


_BUILTIN_NAMES = frozenset(_registry)


@dataclass(frozen=True)
class MeshLayout:
    """Where every rank of a group sits in one named mesh, as the workers declared it."""

    name: str
    dp_size: int
    dp_ranks: list[int]  # dp rank of every group rank
    collect_ranks: list[int]  # the group rank that reports for dp rank 0, 1, ...


_nd_modes: dict[str, DispatchMode] = {}


def nd_dispatch(mesh_name: str) -> DispatchMode:
    """A dispatch mode for workers arranged in a device mesh (dp x tp x ...).

    Each worker declares its place once with ``self.register_mesh(mesh_name, ...)`` (see
    ``sc.Worker``). Data is split over the dp ranks only (padded like DP_COMPUTE_PROTO); every rank
    gets the chunk of its dp rank, so tensor-parallel replicas receive identical data; results are
    collected from the collect rank of each dp rank, in dp order.

    Example:
        >>> class Actor(sc.Worker):  # doctest: +SKIP
        ...     @sc.register(dispatch_mode=sc.nd_dispatch("actor"))
        ...     def compute(self, batch): ...
    """
    if not isinstance(mesh_name, str) or not mesh_name:
        raise TypeError(f"nd_dispatch expects a mesh name, got {mesh_name!r}")
    if mesh_name in _nd_modes:
        return _nd_modes[mesh_name]

    def split(group, value, what):
        layout = group.mesh_layout(mesh_name)
        chunks = split_data(value, layout.dp_size, what=what)
        return Chunks(
            [chunks[d] for d in layout.dp_ranks], pad_size=chunks.pad_size, padded_rows=chunks.padded_rows
        )

    def dispatch(group, *args, **kwargs):
        _check_same_length(list(args) + list(kwargs.values()))
        return (
            tuple(split(group, a, f"argument {i}") for i, a in enumerate(args)),
            {k: split(group, v, f"argument {k!r}") for k, v in kwargs.items()},
        )

    def collect(group, outputs):
        layout = group.mesh_layout(mesh_name)
        return collect_dp_compute_data_proto(group, [outputs[r] for r in layout.collect_ranks])

    # Data is split over dp ranks, not over every rank: no same-split hand-off (splits_data False);
    # a hand-off takes rows by the mesh's layout instead (row_chunks, row_sources).
    mode = DispatchMode(
        f"nd_dispatch:{mesh_name}",
        dispatch,
        collect,
        copies_data=True,
        row_chunks=lambda group: group.mesh_layout(mesh_name).dp_ranks,
        row_sources=lambda group: group.mesh_layout(mesh_name).collect_ranks,
    )
    with _registry_lock:
        _nd_modes[mesh_name] = mode
        _registry[mode.name] = mode
    return mode


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _registry:
            continue
        try:
            mode = _coerce(ep.load(), ep.name)
        except Exception as exc:  # a broken plugin must not break unrelated groups
            import warnings

            warnings.warn(
                f"spmdcall: could not load dispatch mode {ep.name!r} from {ep.value}: {exc}", stacklevel=2
            )
            continue
        with _registry_lock:
            _registry.setdefault(ep.name, mode)


def _coerce(obj: Any, name: str) -> DispatchMode:
    if isinstance(obj, DispatchMode):
        return obj
    if isinstance(obj, dict) and {"dispatch_fn", "collect_fn"} <= obj.keys():
        splits, copies = bool(obj.get("splits_data", False)), bool(obj.get("copies_data", False))
        return DispatchMode(
            name, obj["dispatch_fn"], obj["collect_fn"], splits_data=splits, copies_data=copies
        )
    raise TypeError(
        f"dispatch mode {name!r} must be a DispatchMode or a dict with 'dispatch_fn' and 'collect_fn', got {type(obj).__name__}"
    )


def resolve_dispatch_mode(mode: DispatchMode | str | dict) -> DispatchMode:
    """Turn a mode object, a registered name or a ``{"dispatch_fn", "collect_fn"}`` dict into a DispatchMode."""
    if isinstance(mode, DispatchMode):
        return mode
    if isinstance(mode, dict):
        return _coerce(mode, mode.get("name", "custom"))
    if isinstance(mode, str):
        if mode not in _registry:
            _load_entry_points()
        try:
            return _registry[mode]
        except KeyError:
            raise ValueError(
                f"unknown dispatch mode {mode!r}; registered modes: {sorted(_registry)}"
            ) from None
    raise TypeError(
        f"dispatch_mode must be a DispatchMode, a registered name or a dict, got {type(mode).__name__}"
    )


def available_dispatch_modes() -> list[str]:
    """Names of every registered mode, plugins from installed packages included."""
    _load_entry_points()
    return sorted(_registry)


def resolve_execute_mode(mode: Execute | str) -> Execute:
    if isinstance(mode, Execute):
        return mode
    if isinstance(mode, str):
        for m in Execute:
            if mode.lower() in (m.value, m.name.lower()):
                return m
    raise ValueError(f"execute_mode must be Execute.ALL or Execute.RANK_ZERO, got {mode!r}")
