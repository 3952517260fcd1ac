"""Mini-batches over epochs: what ``DataProto.make_iterator`` yields."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from spmdcall.data.columns import DataProtoError, check_positive_int

if TYPE_CHECKING:
    from spmdcall.data.proto import DataProto


def mini_batches(
    data: DataProto, mini_batch_size: int, epochs: int, seed: int | None, dataloader_kwargs: dict | None
) -> Iterator[DataProto]:
    """``data.make_iterator(...)``: arguments are checked here, at call time; the generator this
    returns only iterates."""
    check_positive_int("mini_batch_size", mini_batch_size)
    if not isinstance(epochs, (int, np.integer)) or epochs < 0:
        raise DataProtoError(f"epochs must be a non-negative int, got {epochs!r}")
    kwargs = dict(dataloader_kwargs or {})
    shuffle, drop_last = bool(kwargs.pop("shuffle", False)), bool(kwargs.pop("drop_last", False))
    if kwargs:
        warnings.warn(f"make_iterator ignores dataloader_kwargs {sorted(kwargs)}", stacklevel=3)
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return _iterate(data, mini_batch_size, epochs, shuffle, drop_last, generator)


def _iterate(
    data: DataProto, size: int, epochs: int, shuffle: bool, drop_last: bool, generator: torch.Generator
) -> Iterator[DataProto]:
    n = len(data)
    stop = n - n % size if drop_last else n
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator).numpy() if shuffle else np.arange(n)
        for start in range(0, stop, size):
            yield data.select_idxs(order[start : start + size])
