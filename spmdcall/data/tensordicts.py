"""A DataProto as one TensorDict and back (verl's ``to_tensordict`` / ``from_tensordict``)."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from spmdcall.data.columns import DataProtoError


def to_tensordict(self: Any) -> TensorDict:
    """See ``DataProto.to_tensordict``."""
    columns: dict[str, Any] = {} if self.batch is None else self.batch.to_dict()
    for what, source in (("non_tensor_batch", self.non_tensor_batch), ("meta_info", self.meta_info)):
        clash = sorted(set(columns) & set(source))
        if clash:
            raise DataProtoError(
                f"cannot make one TensorDict: keys {clash} of {what} are also earlier columns"
            )
        for key, value in source.items():
            rows: list[Any] = [NonTensorData(item) for item in value] if what == "non_tensor_batch" else []
            columns[key] = (
                NonTensorStack.from_list(rows) if what == "non_tensor_batch" else NonTensorData(value)
            )
    return TensorDict(columns, batch_size=[len(self)])


def from_tensordict(cls: Any, tensor_dict: TensorDict, meta_info: dict | None, num_batch_dims: int) -> Any:
    """See ``DataProto.from_tensordict``."""
    if num_batch_dims != 1:
        raise DataProtoError(
            f"a DataProto has exactly one batch dim (its rows), got num_batch_dims={num_batch_dims}"
        )
    tensors: dict[str, torch.Tensor] = {}
    non_tensors: dict[str, Any] = {}
    meta = dict(meta_info or {})
    for key in map(str, tensor_dict.keys()):
        value = tensor_dict.get(key)
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, NonTensorStack):
            non_tensors[key] = [item.data for item in value]
        elif isinstance(value, NonTensorData):
            meta[key] = value.data
        else:
            raise TypeError(
                f"tensor_dict[{key!r}] is a {type(value).__name__}: expected tensors and non-tensor data"
            )
    batch = TensorDict(tensors, batch_size=tensor_dict.batch_size[:1]) if tensors else None
    return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)
