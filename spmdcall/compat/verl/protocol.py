"""The helpers verl code imports from ``verl.protocol`` beside DataProto itself (which is
:class:`spmdcall.data.DataProto`): unions of column dicts, folding the batch dim, raw tensor
serialisation, and ``DataProtoConfig``. Imports torch."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch

# isort: split
from spmdcall.data import DataProto, DataProtoError  # first: it imports tensordict without dynamo

# isort: split
from tensordict import TensorDict

__all__ = [
    "DataProtoConfig",
    "union_tensor_dict",
    "union_numpy_dict",
    "fold_batch_dim",
    "unfold_batch_dim",
    "serialize_single_tensor",
    "deserialize_single_tensor",
    "serialize_tensordict",
    "deserialize_tensordict",
]


class _AutoPadding(type):
    # verl's switch for padding data-parallel batches; spmdcall always pads them.
    @property
    def auto_padding(cls) -> bool:
        return True

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not enabled:
            warnings.warn(
                "DataProtoConfig.auto_padding = False has no effect: spmdcall pads every data-parallel "
                "dispatch (and DataProto.chunk accepts any length)",
                stacklevel=2,
            )


class DataProtoConfig(metaclass=_AutoPadding):
    """verl's global DataProto settings: ``auto_padding`` is always True in spmdcall."""


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add the columns of ``tensor_dict2`` to ``tensor_dict1`` (in place, and returned); a column in
    both must be equal, else DataProtoError (verl code catches it as AssertionError).

    Example:
        >>> union_tensor_dict(TensorDict({"a": torch.zeros(2)}, [2]), TensorDict({"b": torch.ones(2)}, [2]))  # doctest: +SKIP
    """
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise DataProtoError(
            f"cannot union TensorDicts of batch sizes {tensor_dict1.batch_size} and {tensor_dict2.batch_size}"
        )
    for key in tensor_dict2.keys():
        value = tensor_dict2.get(key)
        if key not in tensor_dict1.keys():
            tensor_dict1.set(key, value)
        elif not _same(tensor_dict1.get(key), value):
            raise DataProtoError(f"{key} in tensor_dict1 and tensor_dict2 are not the same object")
    return tensor_dict1


def union_numpy_dict(
    tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Add the arrays of ``tensor_dict2`` to ``tensor_dict1`` (in place, and returned); an array in
    both must be equal (NaN equal to NaN, object arrays compared item by item, cycles allowed),
    else DataProtoError.

    Example:
        >>> union_numpy_dict({"a": np.array([1.0, np.nan])}, {"a": np.array([1.0, np.nan])})["a"].shape
        (2,)
    """
    for key, value in tensor_dict2.items():
        if key in tensor_dict1:
            if not (isinstance(value, np.ndarray) and isinstance(tensor_dict1[key], np.ndarray)):
                raise TypeError(f"union_numpy_dict holds np.ndarrays, got {type(value).__name__} for {key!r}")
            if not _same(tensor_dict1[key], value):
                raise DataProtoError(f"`{key}` in tensor_dict1 and tensor_dict2 are not the same object.")
        tensor_dict1[key] = value
    return tensor_dict1


def _same(a: Any, b: Any, seen: frozenset[int] = frozenset()) -> bool:
    """Equal values, NaN equal to NaN, object arrays item by item; an array met again inside
    itself (a cycle) counts as equal there."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype != object:
            return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
        if id(a) in seen:
            return True
        return all(_same(x, y, seen | {id(a)}) for x, y in zip(a.flat, b.flat))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return a is b


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Rows ``[n, ...]`` regrouped as ``[new_batch_size, n // new_batch_size, ...]``: each new row
    holds consecutive old rows.

    Example:
        >>> fold_batch_dim(DataProto.from_dict({"x": torch.arange(4)}), 2).batch["x"].tolist()
        [[0, 1], [2, 3]]
    """
    if not new_batch_size > 0 or len(data) % new_batch_size:
        raise DataProtoError(f"{len(data)} rows do not fold into {new_batch_size}")
    batch = None
    if data.batch is not None:
        columns = {k: t.reshape(new_batch_size, -1, *t.shape[1:]) for k, t in data.batch.items()}
        batch = TensorDict(columns, batch_size=[new_batch_size], device=data.batch.device)
    non_tensor = {k: v.reshape(new_batch_size, -1, *v.shape[1:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Undo :func:`fold_batch_dim`: the first ``batch_dims`` dims of every column become the rows.

    Example:
        >>> unfold_batch_dim(DataProto.from_dict({"x": torch.arange(4).reshape(2, 2)})).batch["x"].tolist()
        [0, 1, 2, 3]
    """
    batch = None
    if data.batch is not None:
        columns = {k: t.reshape(-1, *t.shape[batch_dims:]) for k, t in data.batch.items()}
        rows = {c.shape[0] for c in columns.values()}
        if len(rows) > 1:
            raise DataProtoError(f"the first {batch_dims} dims of the columns differ: {sorted(rows)} rows")
        batch = TensorDict(columns, batch_size=[rows.pop()] if rows else [0], device=data.batch.device)
    non_tensor = {k: v.reshape(-1, *v.shape[batch_dims:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def serialize_single_tensor(tensor: torch.Tensor) -> tuple[str, torch.Size, np.ndarray]:
    """``(dtype name, shape, bytes as a uint8 array)`` of a CPU tensor, any dtype (bfloat16, float8).

    Example:
        >>> serialize_single_tensor(torch.zeros(2, dtype=torch.bfloat16))[:2]
        ('bfloat16', torch.Size([2]))
    """
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return str(tensor.dtype).removeprefix("torch."), tensor.shape, data


def deserialize_single_tensor(encoded: Any) -> torch.Tensor:
    """The tensor :func:`serialize_single_tensor` described (its own memory)."""
    dtype_name, shape, data = encoded
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{dtype_name!r} is not a torch dtype")
    raw = torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))  # a copy of its own, writable
    return raw.view(dtype).reshape(shape)


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, tuple]]:
    """``(batch size, device, {key: encoded tensor})``; a nested tensor is ``(layout, [encoded rows])``.

    Example:
        >>> serialize_tensordict(TensorDict({"a": torch.zeros(2)}, [2]))[0]
        (2,)
    """
    encoded: dict[str, tuple] = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"serialize_tensordict holds tensors only, got {type(value).__name__} for {key!r}"
            )
        if value.is_nested:
            encoded[key] = (
                str(value.layout).removeprefix("torch."),
                [serialize_single_tensor(t) for t in value.unbind()],
            )
        else:
            encoded[key] = serialize_single_tensor(value)
    device = None if batch.device is None else str(batch.device)
    return tuple(batch.batch_size), device, encoded


def deserialize_tensordict(encoded: Any) -> TensorDict:
    """The TensorDict :func:`serialize_tensordict` described."""
    batch_size, device, items = encoded
    columns: dict[str, torch.Tensor] = {}
    for key, value in items.items():
        if len(value) == 2:
            layout, rows = value
            columns[key] = torch.nested.as_nested_tensor(
                [deserialize_single_tensor(r) for r in rows], layout=getattr(torch, layout)
            )
        else:
            columns[key] = deserialize_single_tensor(value)
    return TensorDict(columns, batch_size=batch_size, device=device)
