"""Padding a DataProto to a multiple of the world size, and taking the padding off again."""

from __future__ import annotations

import numpy as np

from spmdcall.data.columns import DataProtoError, check_positive_int
from spmdcall.data.proto import DataProto


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` so its length divides by ``size_divisor``, repeating rows from the start.

    The pad rows are rows 0, 1, 2, ... of ``data``, cycling when more are needed than there are
    rows. meta_info is kept unchanged. Undo with ``unpad_dataproto``.

    Args:
        data: the DataProto to pad; not modified, and returned as-is when no padding is needed.
        size_divisor: the length must become a multiple of this (e.g. the number of dp ranks).

    Returns:
        ``(padded, pad_size)``.

    Example:
        >>> padded, pad_size = pad_dataproto_to_divisor(DataProto.from_dict({"x": torch.arange(5)}), 4)
        >>> padded.batch["x"].tolist(), pad_size
        ([0, 1, 2, 3, 4, 0, 1, 2], 3)
    """
    check_positive_int("size_divisor", size_divisor)
    n = len(data)
    pad_size = (-n) % size_divisor
    if pad_size == 0:
        return data, 0
    if n == 0:
        raise DataProtoError("cannot pad an empty DataProto: there are no rows to repeat")
    return data.select_idxs(np.concatenate([np.arange(n), np.arange(pad_size) % n])), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows, as added by ``pad_dataproto_to_divisor``.

    Example: ``unpad_dataproto(*pad_dataproto_to_divisor(dp, 4))  # the same rows as dp``
    """
    if not 0 <= pad_size <= len(data):
        raise DataProtoError(f"pad_size must be in [0, {len(data)}], got {pad_size}")
    return data if pad_size == 0 else data.slice(0, len(data) - pad_size)
