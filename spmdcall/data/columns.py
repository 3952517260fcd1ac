"""How a DataProto's columns are checked, picked, joined and packed (helpers of ``proto.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

# Torch dtypes numpy can hold as-is. Any other dtype (bfloat16, float8, ...) is pickled as raw
# uint8 bytes plus its torch dtype, so the transport never depends on numpy's dtype support.
NUMPY_COMPATIBLE = {
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
}

METRICS_KEY = "metrics"


class DataProtoError(ValueError, AssertionError):
    """Bad input to a DataProto operation (mismatched rows, conflicting values, ...).

    A ValueError; also an AssertionError, because verl's DataProto asserts on the same input and
    code written for verl catches AssertionError.
    """


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise DataProtoError(f"{name} must be a positive int, got {value!r}")


def as_column(key: str, value: Any) -> np.ndarray:
    if isinstance(value, (list, tuple)):
        # Filled item by item so that a list of equal-length lists stays 1-D: one object per row.
        column = np.empty(len(value), dtype=object)
        for i, item in enumerate(value):
            column[i] = item
        return column
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"non_tensor_batch[{key!r}] must be an np.ndarray or list, got {type(value).__name__}"
        )
    if value.ndim == 0:
        raise DataProtoError(f"non_tensor_batch[{key!r}] is a 0-d array; a column needs one entry per row")
    return value


def raise_mismatch(lengths: dict[str, Any]) -> None:
    listed = ", ".join(f"{k}={v}" for k, v in lengths.items())
    raise DataProtoError(f"DataProto columns must share the first dimension, got {listed}")


def as_index_array(idxs: Any, length: int) -> np.ndarray:
    array = idxs.detach().cpu().numpy() if isinstance(idxs, torch.Tensor) else np.asarray(idxs)
    if array.ndim != 1:
        raise DataProtoError(f"row indices must be 1-D, got shape {array.shape}")
    if array.dtype == np.bool_:
        if len(array) != length:
            raise DataProtoError(f"bool mask has {len(array)} entries, the DataProto has {length} rows")
        return np.flatnonzero(array)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)  # np.asarray([]) is float64
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"row indices must be ints or a bool mask, got dtype {array.dtype}")
    if array.min() < -length or array.max() >= length:
        raise IndexError(f"row indices {array.min()}..{array.max()} out of range for {length} rows")
    return array.astype(np.int64) % length


def tensor_items(batch: TensorDict | None) -> list[tuple[Any, Any]]:
    return [] if batch is None else list(batch.items(include_nested=True, leaves_only=True))


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    return type(value).__name__


def pick(source: dict, keys: Sequence[str] | None, what: str) -> dict:
    if keys is None:
        return dict(source)
    missing = [k for k in keys if k not in source]
    if missing:
        raise KeyError(f"{what} has no keys {missing}; it has {list(source)}")
    return {k: source[k] for k in keys}


def values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:  # items may be arrays, whose `==` is no bool
            return all(values_equal(x, y) for x, y in zip(a.flat, b.flat))
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return a is b


def require_equal(what: str, a: Any, b: Any) -> None:
    if not values_equal(a, b):
        raise DataProtoError(f"union conflict: {what} differs between the two DataProtos")


def cat_rows(
    parts: list[torch.Tensor], alloc: Callable[[int], np.ndarray | None] | None = None
) -> torch.Tensor:
    """``torch.cat(parts)`` along rows. Dense CPU tensors are joined as raw bytes by numpy: one
    memcpy per part, where torch.cat's thread pool slows to a crawl on a busy machine (figures in
    docs/benchmarks-log.md)."""
    if (
        any(p.device.type != "cpu" or p.layout != torch.strided or p.dim() == 0 for p in parts)
        or len({p.dtype for p in parts}) > 1
    ):
        return torch.cat(parts, dim=0)
    row_bytes = math.prod(parts[0].shape[1:]) * parts[0].element_size()
    rows = [p.contiguous() for p in parts]
    arrays = [p.view(torch.uint8).reshape(p.shape[0], row_bytes).numpy() for p in rows]
    total_rows = sum(p.shape[0] for p in rows)
    out = alloc(total_rows * row_bytes) if alloc is not None and row_bytes else None
    joined = np.concatenate(arrays, out=out.reshape(total_rows, row_bytes) if out is not None else None)
    return torch.from_numpy(joined).view(parts[0].dtype).reshape(-1, *parts[0].shape[1:])


def cat_batches(
    batches: list[TensorDict], alloc: Callable[[int], np.ndarray | None] | None = None
) -> TensorDict:
    out = TensorDict({}, batch_size=[sum(b.batch_size[0] for b in batches)])
    for key in batches[0].keys(include_nested=True, leaves_only=True):
        out[key] = cat_rows([b[key] for b in batches], alloc)
    return out


def require_same_keys(what: str, key_lists: list[list[str]]) -> None:
    for keys in key_lists[1:]:
        if keys != key_lists[0]:
            raise DataProtoError(f"cannot concat: {what} keys differ, {key_lists[0]} vs {keys}")


def merge_meta(metas: list[dict]) -> dict:
    merged: dict = {}
    metrics: dict[str, list] | None = None
    for meta in metas:
        for key, value in meta.items():
            if key == METRICS_KEY and isinstance(value, (dict, list, tuple)):
                # One worker's metrics: a dict, or a list of dicts (one per step, say).
                metrics = {} if metrics is None else metrics
                for part in [value] if isinstance(value, dict) else value:
                    for name, v in part.items():
                        metrics.setdefault(name, []).extend(v if isinstance(v, (list, tuple)) else [v])
            elif key == METRICS_KEY and value is None:
                continue
            elif key in merged:
                if not values_equal(merged[key], value):
                    raise DataProtoError(
                        f"Conflicting values for meta_info key {key!r} in concat: {merged[key]!r} and {value!r}"
                    )
            else:
                merged[key] = value
    if metrics is not None:
        merged[METRICS_KEY] = metrics
    return merged


def pack_batch(batch: TensorDict | None) -> dict | None:
    if batch is None:
        return None
    # (key, array or other leaf, torch dtype if bytes-viewed, shape, device)
    columns: list[tuple[Any, Any, torch.dtype | None, tuple[int, ...] | None, str | None]] = []
    for key, value in tensor_items(batch):
        if not isinstance(value, torch.Tensor):
            columns.append((key, value, None, None, None))  # a non-tensor leaf: pickled as-is
            continue
        t = value.detach().resolve_conj().resolve_neg().contiguous()
        device, t = str(t.device), t.cpu()
        if t.dtype in NUMPY_COMPATIBLE:
            columns.append((key, t.numpy(), None, None, device))
        else:
            columns.append((key, t.reshape(-1).view(torch.uint8).numpy(), t.dtype, tuple(t.shape), device))
    batch_device = None if batch.device is None else str(batch.device)
    return {"batch_size": tuple(batch.batch_size), "device": batch_device, "columns": columns}


def unpack_batch(state: dict | None) -> TensorDict | None:
    if state is None:
        return None
    batch = TensorDict({}, batch_size=state["batch_size"])
    for key, array, dtype, shape, device in state["columns"]:
        if device is None:
            batch.set(key, array)
            continue
        if not array.flags.writeable:
            # The buffer is read-only memory (e.g. a bytes object) and torch tensors are
            # writable, so take a private copy. Writable buffers are wrapped without a copy.
            array = array.copy()
        t = torch.from_numpy(array)
        if dtype is not None:
            t = t.view(dtype).reshape(shape)
        batch.set(key, t if device == "cpu" else t.to(device))
    return batch if state["device"] is None else batch.to(state["device"])
