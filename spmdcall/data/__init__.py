"""DataProto: the batch container passed between a single controller and its workers.

A DataProto holds a ``TensorDict`` batch, a dict of numpy columns (``non_tensor_batch``: strings,
Python objects, ragged data) and a free-form ``meta_info`` dict. Every column shares the first
dimension, so a DataProto can be split by rows, sent to workers and concatenated back.

Method names and semantics follow ``verl.protocol.DataProto`` so code written for verl runs
unchanged; the differences are listed in ``docs/data.md`` (mainly: ``chunk`` accepts uneven sizes).
"""

import importlib

from spmdcall.errors import missing_extra

try:
    importlib.import_module("torch")  # first: without the extra, it is the one to name
    from spmdcall.data.tensordict_import import import_tensordict

    import_tensordict()
except ModuleNotFoundError as exc:  # the [torch] extra is not installed
    raise missing_extra(exc, "DataProto") from None

from spmdcall.data.columns import DataProtoError
from spmdcall.data.padding import pad_dataproto_to_divisor, unpad_dataproto
from spmdcall.data.proto import DataProto, DataProtoItem
from spmdcall.data.weights import (
    LoadStats,
    TensorPiece,
    WeightChecksumError,
    WeightGeneration,
    WeightPublisher,
    WeightReader,
    WeightStore,
)

__all__ = [
    "DataProto",
    "DataProtoItem",
    "DataProtoError",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "WeightStore",
    "WeightPublisher",
    "WeightReader",
    "WeightGeneration",
    "WeightChecksumError",
    "LoadStats",
    "TensorPiece",
]
