"""verl's ``single_controller.base.decorator``: ``@register``, ``Dispatch``, the mode registry and
the mesh dispatch, on top of :mod:`spmdcall.group.modes`."""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import spmdcall as sc
from spmdcall.group.modes import (
    Chunks,
    DispatchMode,
    available_dispatch_modes,
    collect_dp_compute_data_proto,
    resolve_dispatch_mode,
    resolve_execute_mode,
    split_data,
    unregister_dispatch_mode,
)

Execute = sc.Execute
register_dispatch_mode = sc.register_dispatch_mode


class Dispatch(sc.Dispatch):
    """verl's Dispatch: spmdcall's modes (``Dispatch.<NAME>`` for every registered one), plus
    verl's ``Dispatch.remove(name)`` for a mode registered with :func:`register_dispatch_mode`."""

    @classmethod
    def remove(cls, name: str) -> None:
        unregister_dispatch_mode(name)


# The built-in modes' functions and declarations, which clear() gives them back.
_BUILTIN_FUNCTIONS: dict[DispatchMode, tuple[Callable, Callable, tuple[bool, bool]]] = {
    mode: (
        mode.dispatch_fn,
        mode.collect_fn,
        (mode.splits_data, mode.copies_data),
    )
    for mode in (getattr(sc.Dispatch, name) for name in vars(sc.Dispatch) if name.isupper())
}


class _ModeFunctions(MutableMapping):
    """verl's ``DISPATCH_MODE_FN_REGISTRY`` (mode -> ``{"dispatch_fn", "collect_fn"}``) as a view of
    spmdcall's registry: setting an entry replaces that mode's functions everywhere, as in verl (and
    its declarations with the defaults, unless the functions are its own or the built-in ones).

    ``clear()`` gives the built-in modes back their own functions and keeps third-party modes (the
    methods declared with them hold them; ``del registry[mode]`` or ``Dispatch.remove(name)``
    removes one), so ``copy()``, ``clear()``, ``update(copy)`` restores a snapshot, as verl code
    does around a test.
    """

    def __getitem__(self, mode: DispatchMode) -> dict[str, Callable]:
        try:
            registered = resolve_dispatch_mode(mode.name)
        except ValueError:
            raise KeyError(mode) from None
        if registered is not mode:
            raise KeyError(mode)
        return {"dispatch_fn": mode.dispatch_fn, "collect_fn": mode.collect_fn}

    def __setitem__(self, mode: DispatchMode, functions: dict[str, Callable]) -> None:
        fns = functions["dispatch_fn"], functions["collect_fn"]
        # The mode keeps what it declares while its functions stay (or become the built-in ones).
        if fns == (mode.dispatch_fn, mode.collect_fn):
            splits, copies = mode.splits_data, mode.copies_data
        else:
            builtin = _BUILTIN_FUNCTIONS.get(mode)
            splits, copies = builtin[2] if builtin is not None and fns == builtin[:2] else (False, False)
        sc.register_dispatch_mode(mode.name, *fns, splits_data=splits, copies_data=copies, overwrite=True)

    def __delitem__(self, mode: DispatchMode) -> None:
        self[mode]  # KeyError if it is not registered
        if mode in _BUILTIN_FUNCTIONS:
            raise KeyError(f"{mode.name} is a built-in dispatch mode; clear() resets it")
        unregister_dispatch_mode(mode.name)

    def __iter__(self) -> Iterator[DispatchMode]:
        return iter([resolve_dispatch_mode(name) for name in available_dispatch_modes()])

    def __len__(self) -> int:
        return len(available_dispatch_modes())

    def clear(self) -> None:
        for mode, (dispatch_fn, collect_fn, (splits, copies)) in _BUILTIN_FUNCTIONS.items():
            sc.register_dispatch_mode(
                mode.name, dispatch_fn, collect_fn, splits_data=splits, copies_data=copies, overwrite=True
            )

    def copy(self) -> dict[DispatchMode, dict[str, Callable]]:
        return dict(self)


DISPATCH_MODE_FN_REGISTRY = _ModeFunctions()


def get_predefined_dispatch_fn(dispatch_mode: DispatchMode) -> dict[str, Callable]:
    """``{"dispatch_fn": ..., "collect_fn": ...}`` of a registered mode (verl's lookup)."""
    return DISPATCH_MODE_FN_REGISTRY[dispatch_mode]


def update_dispatch_mode(dispatch_mode: DispatchMode, dispatch_fn: Callable, collect_fn: Callable) -> None:
    """Give the registered ``dispatch_mode`` new functions; every method declared with it follows."""
    DISPATCH_MODE_FN_REGISTRY[dispatch_mode]  # KeyError for a mode that is not registered
    DISPATCH_MODE_FN_REGISTRY[dispatch_mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


def check_dispatch_mode(dispatch_mode: Any) -> None:
    """verl's check: a mode, or a dict with ``dispatch_fn`` and ``collect_fn`` (TypeError otherwise)."""
    if isinstance(dispatch_mode, dict) and {"dispatch_fn", "collect_fn"} <= dispatch_mode.keys():
        return
    if not isinstance(dispatch_mode, DispatchMode):
        raise TypeError(
            f"dispatch_mode must be a Dispatch mode or a dict with dispatch_fn and collect_fn, got {dispatch_mode!r}"
        )


# -- register --------------------------------------------------------------------------------------


def register(
    dispatch_mode: DispatchMode | str | dict = Dispatch.ALL_TO_ALL,
    execute_mode: sc.Execute | str = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
) -> Callable[[Callable], Callable]:
    """verl's ``@register``: :func:`spmdcall.register` that also accepts ``async def`` methods.

    An ``async def`` method runs to completion on the worker, on one event loop per worker
    process (kept between calls), so the group call returns its result like any other method's.
    ``ALL_TO_ALL`` with ``Execute.RANK_ZERO`` gives rank 0 the arguments as they are, as in verl
    (spmdcall's ``ONE_TO_ALL`` with ``RANK_ZERO``).

    Args:
        dispatch_mode: how arguments are split across ranks and results merged.
        execute_mode: ``Execute.ALL`` or ``Execute.RANK_ZERO``.
        blocking: ``False`` makes the group call return at once (see ``RayWorkerGroup``).
        materialize_futures: resolve future arguments before dispatching them.

    Example:
        >>> class Critic(Worker):
        ...     @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        ...     async def values(self, data): ...
    """
    if resolve_execute_mode(execute_mode) is Execute.RANK_ZERO and _is_mode(dispatch_mode, "ALL_TO_ALL"):
        dispatch_mode = Dispatch.ONE_TO_ALL
    decorate = sc.register(dispatch_mode, execute_mode, blocking, materialize_futures)

    def wrap(fn: Callable) -> Callable:
        if inspect.iscoroutinefunction(fn):
            fn = _run_to_completion(fn)
        return decorate(fn)

    return wrap


def _is_mode(mode: Any, name: str) -> bool:
    return isinstance(mode, (DispatchMode, str)) and resolve_dispatch_mode(mode).name == name


def _run_to_completion(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return _worker_event_loop().run_until_complete(fn(*args, **kwargs))

    return run


_loop: asyncio.AbstractEventLoop | None = None


def _worker_event_loop() -> asyncio.AbstractEventLoop:
    # One loop per process for its whole life, so state an async method leaves on the loop (tasks,
    # clients, engines) is still there at the next call.
    global _loop
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "an async worker method was called while an event loop is running in this thread "
            "(the inline backend inside async code?); use the process or ray backend"
        )
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop


# -- verl's mesh dispatch --------------------------------------------------------------------------

_mesh_modes: dict[str, DispatchMode] = {}


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> DispatchMode:
    """verl's mesh dispatch, for workers that call ``self._register_dispatch_collect_info(mesh_name,
    dp_rank=..., is_collect=...)``.

    The group asks its ranks once for their dp rank and whether they report (cached in
    ``group._dispatch_info`` / ``group._collect_info``, as verl does); the dp size is the largest
    dp rank plus one. A DataProto is split over the dp ranks (padded like ``DP_COMPUTE_PROTO``), a
    TensorDict too (its length must divide; jagged nested tensors are split row by row); every
    rank gets its dp rank's chunk, and the results of the reporting ranks are joined in dp order.
    (Native spmdcall: ``sc.nd_dispatch(mesh_name)`` with ``Worker.register_mesh``.)

    Example:
        >>> make_nd_compute_dataproto_dispatch_fn("actor").name
        'verl_nd_compute:actor'
    """
    if not isinstance(mesh_name, str) or not mesh_name:
        raise TypeError(f"make_nd_compute_dataproto_dispatch_fn expects a mesh name, got {mesh_name!r}")
    mode = _mesh_modes.get(mesh_name)
    if mode is None:
        mode = _mesh_modes[mesh_name] = sc.register_dispatch_mode(
            f"verl_nd_compute:{mesh_name}",
            functools.partial(_dispatch_mesh, mesh_name),
            functools.partial(_collect_mesh, mesh_name),
        )
    return mode


def _mesh_info(group: Any, mesh_name: str, what: str) -> list:
    from spmdcall.compat.verl.groups import RayWorkerGroup, mesh_info

    if not isinstance(group, RayWorkerGroup):
        raise TypeError(
            f"make_nd_compute_dataproto_dispatch_fn({mesh_name!r}) runs on a RayWorkerGroup; "
            f"on an sc.WorkerGroup use sc.nd_dispatch({mesh_name!r}) with Worker.register_mesh"
        )
    return mesh_info(group, mesh_name, what)


def _dispatch_mesh(mesh_name: str, group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    dp_ranks = _mesh_info(group, mesh_name, "dispatch")
    dp_size = max(dp_ranks) + 1
    lengths = {len(v) for v in (*args, *kwargs.values()) if _is_tensordict(v) or is_data_proto(v)}
    if len(lengths) > 1:
        raise ValueError(
            f"data arguments of one call must have the same number of rows, got {sorted(lengths)}"
        )

    def split(value: Any, what: str) -> Chunks:
        chunks = (
            _split_tensordict(value, dp_size, what)
            if _is_tensordict(value)
            else split_data(value, dp_size, what=what)
        )
        return Chunks([chunks[d] for d in dp_ranks], pad_size=chunks.pad_size, padded_rows=chunks.padded_rows)

    return (
        tuple(split(a, f"argument {i}") for i, a in enumerate(args)),
        {k: split(v, f"argument {k!r}") for k, v in kwargs.items()},
    )


def _collect_mesh(mesh_name: str, group: Any, outputs: list) -> Any:
    reports = _mesh_info(group, mesh_name, "collect")
    kept = [out for out, is_collect in zip(outputs, reports) if is_collect]
    if kept and all(_is_tensordict(out) for out in kept):
        return _concat_tensordicts(kept)
    return collect_dp_compute_data_proto(group, kept)


def is_data_proto(value: Any) -> bool:
    # DataProto loads with torch; a value can only be one if spmdcall.data was loaded.
    return "spmdcall.data" in sys.modules and isinstance(value, sc.DataProto)


def _is_tensordict(value: Any) -> bool:
    # tensordict loads with torch; a value can only be a TensorDict if it was loaded.
    tensordict = sys.modules.get("tensordict")
    return tensordict is not None and isinstance(value, tensordict.TensorDictBase)


def _split_tensordict(td: Any, chunks: int, what: str) -> Chunks:
    import torch

    if len(td) % chunks:
        raise ValueError(f"{what}: a TensorDict of {len(td)} rows does not split into {chunks} equal parts")
    size = len(td) // chunks
    nested = [k for k in td.keys() if isinstance(td.get(k), torch.Tensor) and td.get(k).is_nested]
    plain = td.exclude(*nested)
    rows = {k: td.get(k).unbind(0) for k in nested}
    parts = []
    for i in range(chunks):
        part = plain[i * size : (i + 1) * size].clone()  # its own tensors, as a DataProto chunk pickles
        for key, values in rows.items():
            part.set(
                key,
                torch.nested.as_nested_tensor(list(values[i * size : (i + 1) * size]), layout=torch.jagged),
            )
        parts.append(part)
    return Chunks(parts)


def _concat_tensordicts(parts: list) -> Any:
    import torch
    from tensordict import TensorDict

    nested = [
        k for k in parts[0].keys() if isinstance(parts[0].get(k), torch.Tensor) and parts[0].get(k).is_nested
    ]
    out = TensorDict.cat([p.exclude(*nested) for p in parts], dim=0)
    for key in nested:
        rows = [row for p in parts for row in p.get(key).unbind(0)]
        out.set(key, torch.nested.as_nested_tensor(rows, layout=torch.jagged))
    return out
