"""How values cross a process boundary: pickle protocol 5, tensors and arrays as out-of-band buffers.

``dumps`` returns the pickle (small: structure only) and the list of large buffers (tensor and
numpy bytes, still pointing at the original memory). A transport then moves each buffer once —
the process backend copies them into shared memory — and ``loads`` rebuilds tensors on top of the
received buffers without another copy. Functions, lambdas and classes defined in ``__main__`` are
pickled by value (cloudpickle), so scripts and notebooks work unchanged.
"""

from __future__ import annotations

import contextvars
import io
import pickle
import sys
import types
import warnings
from collections import ChainMap
from collections.abc import Iterable
from typing import Any

import cloudpickle

from spmdcall.lazy import loaded

# Buffers smaller than this stay inside the pickle: a separate buffer costs more than it saves.
OUT_OF_BAND_MIN_BYTES = 64 * 1024

# Values made only of these (in tuples, lists and str-keyed dicts) pickle the same with the plain C
# pickler, which costs a fifth of building cloudpickle's: most calls' arguments and replies are such.
_PLAIN_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes})
_PLAIN_MAX_ITEMS = 32
_PLAIN_MAX_DEPTH = 3


def _is_plain(obj: Any, depth: int = 0) -> bool:
    t = type(obj)
    if t in _PLAIN_TYPES:
        return True
    if t not in (tuple, list, dict) or depth == _PLAIN_MAX_DEPTH or len(obj) > _PLAIN_MAX_ITEMS:
        return False
    if t is dict:
        for k, v in obj.items():
            if type(k) is not str or not (type(v) in _PLAIN_TYPES or _is_plain(v, depth + 1)):
                return False
        return True
    for v in obj:
        if not (type(v) in _PLAIN_TYPES or _is_plain(v, depth + 1)):
            return False
    return True


def _rebuild_tensor(buf: Any, dtype: Any, shape: tuple, requires_grad: bool) -> Any:
    import torch

    if buf is None:
        t = torch.empty(shape, dtype=dtype)
    else:
        view = memoryview(buf)
        if not view.readonly:
            t = torch.frombuffer(view, dtype=torch.uint8)
        elif _read_only_ok.get():  # loads(..., read_only=True): the caller only reads it
            t = _on_read_only(view)
        else:  # torch must never write into read-only memory
            t = torch.frombuffer(memoryview(bytearray(view)), dtype=torch.uint8)
        t = t.view(dtype).reshape(shape)
    return t.requires_grad_() if requires_grad else t


# Set while loads(..., read_only=True) runs (a context variable: other threads are not affected).
_read_only_ok = contextvars.ContextVar("spmdcall_read_only_ok", default=False)
_warned_read_only = False


def _on_read_only(view: memoryview) -> Any:
    """A tensor on read-only memory, without copying it. torch warns the first time it is asked
    for one (it cannot mark tensors read-only); a caller that asked for read-only values knows."""
    import torch

    global _warned_read_only
    if _warned_read_only:
        return torch.frombuffer(view, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(view, dtype=torch.uint8)
    _warned_read_only = True
    return t


def _reduce_tensor(t: Any) -> tuple:
    torch = sys.modules["torch"]
    # Only plain dense CPU tensors take the zero-copy path; anything else keeps torch's own pickling.
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_conj() or t.is_neg() or t.is_quantized:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    requires_grad = t.requires_grad and t.is_leaf
    flat = t.detach().contiguous().reshape(-1)
    buf = pickle.PickleBuffer(flat.view(torch.uint8).numpy()) if flat.numel() else None
    return _rebuild_tensor, (buf, t.dtype, tuple(t.shape), requires_grad)


def _reduce_code(code: types.CodeType) -> Any:
    """cloudpickle's code reducer, keeping the file name: from 3.1.3 on cloudpickle writes
    ``<dynamic-code>`` there (for byte-identical pickles), and a worker's traceback through a class
    defined in a script would no longer name the script's file and line."""
    rebuild, args, *rest = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    args = tuple(code.co_filename if isinstance(a, str) and a == "<dynamic-code>" else a for a in args)
    return (rebuild, args, *rest)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, plus plain CPU tensors as out-of-band buffers (torch's own pickling copies)."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj: Any) -> Any:
        torch = loaded("torch")
        if torch is not None and type(obj) is torch.Tensor:
            return _reduce_tensor(obj)
        return super().reducer_override(obj)


def dumps(obj: Any, *, out_of_band_min_bytes: int = OUT_OF_BAND_MIN_BYTES) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; large tensor/array payloads come back separately as byte memoryviews.

    Example:
        >>> data, buffers = dumps({"x": torch.zeros(1 << 20)})  # doctest: +SKIP
        >>> len(data) < 1000, buffers[0].nbytes
        (True, 4194304)
    """
    if _is_plain(obj):
        return pickle.dumps(obj, protocol=5), []
    buffers: list[memoryview] = []

    def keep_out_of_band(pb: pickle.PickleBuffer) -> bool:
        raw = pb.raw()
        if raw.nbytes < out_of_band_min_bytes:
            return True  # true means: serialise in-band
        buffers.append(raw)
        return False

    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=keep_out_of_band).dump(obj)
    return f.getvalue(), buffers


def dumps_inline(obj: Any) -> bytes:
    """Pickle ``obj`` into one bytes object, buffers included (for a worker's class and init arguments)."""
    f = io.BytesIO()
    _Pickler(f, protocol=5).dump(obj)
    return f.getvalue()


def dumps_worker_class(cls_with_init: Any) -> bytes:
    """:func:`dumps_inline` of what a backend's ranks build their worker from; ``TypeError``
    naming it, before any rank starts, when it cannot be pickled."""
    try:
        return dumps_inline(cls_with_init)
    except Exception as exc:
        raise TypeError(f"{cls_with_init!r} (its class or init arguments) cannot be pickled: {exc}") from exc


def loads(data: bytes | memoryview, buffers: Iterable[Any] = (), *, read_only: bool = False) -> Any:
    """Inverse of :func:`dumps`; tensors wrap the given buffers without copying them. A read-only
    buffer is copied first (tensors must be writable), unless ``read_only``: then the value's
    tensors and arrays share it, for a caller that only reads them (and copies what it keeps)."""
    if not read_only:
        return pickle.loads(data, buffers=buffers)
    token = _read_only_ok.set(True)
    try:
        return pickle.loads(data, buffers=buffers)
    finally:
        _read_only_ok.reset(token)


def copy(obj: Any) -> Any:
    """A deep copy through the same path as a process boundary (tensors copied once)."""
    data, buffers = dumps(obj)
    return loads(data, [bytearray(b) for b in buffers])


def describe_unpicklable(values: dict[str, Any]) -> str | None:
    """Name the first value that cannot be pickled, with the reason, or None if all can."""
    for name, value in values.items():
        try:
            dumps(value)
        except Exception as exc:
            return f"{name} ({type(value).__name__}): {exc}"
    return None
