"""The DataProto class: a batch of rows (tensor columns, numpy columns) and its meta_info."""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from spmdcall.data import tensordicts
from spmdcall.data.batches import mini_batches
from spmdcall.data.columns import (
    DataProtoError,
    as_column,
    as_index_array,
    cat_batches,
    check_positive_int,
    describe,
    merge_meta,
    pack_batch,
    pick,
    raise_mismatch,
    require_equal,
    require_same_keys,
    tensor_items,
    unpack_batch,
)

__all__ = ["DataProto", "DataProtoItem"]


@dataclass(eq=False)
class DataProtoItem:
    """One row of a DataProto, as returned by ``data[i]``: ``batch`` is a TensorDict with an
    empty batch size (or None), ``non_tensor_batch`` maps each column to the row's value."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass(eq=False)
class DataProto:
    """Rows of tensor columns and numpy columns, plus meta_info describing the whole batch.

    Args:
        batch: a TensorDict whose first batch dim is the number of rows, or None.
        non_tensor_batch: column name -> np.ndarray with the same first dim. Lists are converted
            to 1-D object arrays, one element per row.
        meta_info: anything about the batch as a whole; never split, copied to every part.

    Example:
        >>> dp = DataProto.from_dict({"x": torch.arange(4)}, {"uid": ["a", "b", "c", "d"]})
        >>> len(dp), dp[1].non_tensor_batch["uid"]
        (4, 'b')
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.batch is not None and not isinstance(self.batch, TensorDict):
            raise TypeError(f"batch must be a TensorDict or None, got {type(self.batch).__name__}")
        # None means "no columns" / "no meta_info", as verl accepts.
        self.non_tensor_batch = {k: as_column(k, v) for k, v in (self.non_tensor_batch or {}).items()}
        self.meta_info = {} if self.meta_info is None else self.meta_info
        self.check_consistency()

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict | None = None,
        meta_info: dict | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build a DataProto from a dict of tensors and a dict of numpy arrays or lists.

        Args:
            tensors: column name -> tensor; its first ``num_batch_dims`` dims are the batch dims.
            non_tensors: column name -> np.ndarray or list, first dim = number of rows.
            meta_info: free-form dict.
            num_batch_dims: must be 1: a DataProto's rows are the first dim of every column (as in
                verl); kept for verl's signature.
            auto_padding: verl's switch for padding this batch when it is dispatched; spmdcall
                always pads (``True`` or ``False``, a verl default that defers to the global
                setting, change nothing).

        Example:
            >>> DataProto.from_dict({"ids": torch.zeros(2, 5)}, meta_info={"step": 3}).batch.batch_size
            torch.Size([2])
        """
        tensors = dict(tensors or {})
        if num_batch_dims != 1:
            raise DataProtoError(
                f"a DataProto has exactly one batch dim (its rows), got num_batch_dims={num_batch_dims}; "
                "fold extra dims into the columns' shapes instead"
            )
        batch = None
        if tensors:
            for key, t in tensors.items():
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"tensors[{key!r}] must be a torch.Tensor, got {type(t).__name__}")
                if t.dim() == 0:
                    raise DataProtoError(
                        f"tensors[{key!r}] is a 0-d tensor; a column needs one entry per row"
                    )
            rows = {k: t.shape[0] for k, t in tensors.items()}
            if len(set(rows.values())) > 1:
                raise_mismatch(rows)
            batch = TensorDict(tensors, batch_size=[next(iter(rows.values()))])
        return cls(batch=batch, non_tensor_batch=dict(non_tensors or {}), meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(
        cls, data: dict[str, Any], meta_info: dict | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Build a DataProto from one dict: tensors go to ``batch``, arrays and lists to
        ``non_tensor_batch``.

        Args:
            data: column name -> torch.Tensor, np.ndarray or list.
            meta_info: free-form dict.
            auto_padding: as in :meth:`from_dict` (spmdcall always pads).

        Example: ``dp = DataProto.from_single_dict({"x": torch.ones(3), "tag": ["a", "b", "c"]})``
        """
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, (np.ndarray, list, tuple)):
                non_tensors[key] = value
            else:
                raise TypeError(
                    f"data[{key!r}] must be a torch.Tensor, np.ndarray or list, got {type(value).__name__}"
                )
        return cls.from_dict(tensors, non_tensors, meta_info, auto_padding=auto_padding)

    # ----------------------------------------------------------------- basic protocol
    def __len__(self) -> int:
        if self.batch is not None:
            return self.batch.batch_size[0]
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        """``dp[i]`` -> DataProtoItem; ``dp[a:b:s]``, ``dp[[...]]``, ``dp[mask]`` -> DataProto."""
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            n = len(self)
            if not -n <= item < n:  # also ends `for row in dp` on an empty DataProto
                raise IndexError(f"row {item} out of range for a DataProto of {n} rows")
            return DataProtoItem(
                batch=None if self.batch is None else self.batch[int(item)],
                non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
                meta_info=dict(self.meta_info),
            )
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"cannot index a DataProto with {type(item).__name__}")

    def check_consistency(self) -> None:
        """Raise ValueError unless every column shares the first dimension."""
        lengths = {}
        if self.batch is not None:
            if len(self.batch.batch_size) != 1:
                raise DataProtoError(
                    f"batch must have exactly one batch dim (the rows), got batch_size {list(self.batch.batch_size)}"
                )
            names = [str(k) for k in self.batch.keys()] or ["<batch>"]
            lengths.update({name: self.batch.batch_size[0] for name in names})
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(
                    f"non_tensor_batch[{key!r}] must be an np.ndarray, got {type(value).__name__}"
                )
            lengths[key] = value.shape[0]
        if len(set(lengths.values())) > 1:
            raise_mismatch(lengths)

    def __repr__(self) -> str:
        columns = [f"{k}: {describe(t)}" for k, t in tensor_items(self.batch)]
        columns += [f"{k}: {describe(v)}" for k, v in self.non_tensor_batch.items()]
        return (
            f"DataProto(rows={len(self)}, columns=[{', '.join(columns)}], meta_info={list(self.meta_info)})"
        )

    def get_data_info(self) -> str:
        """A short multi-line summary: row count, each column's dtype and shape, meta_info keys."""
        lines = [f"DataProto with {len(self)} rows"]
        lines += [f"  batch[{k!r}]: {describe(t)}" for k, t in tensor_items(self.batch)]
        lines += [f"  non_tensor_batch[{k!r}]: {describe(v)}" for k, v in self.non_tensor_batch.items()]
        lines.append(f"  meta_info keys: {list(self.meta_info)}")
        return "\n".join(lines)

    # ----------------------------------------------------------------- rows and columns
    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """Return a DataProto with a subset of the columns; None keeps every key of that kind.

        Args:
            batch_keys, non_tensor_batch_keys, meta_info_keys: names to keep.
            deepcopy: copy the data instead of sharing it with ``self``.

        Example: ``dp.select(batch_keys=["x"], non_tensor_batch_keys=[])``
        """
        batch = self.batch
        if batch is not None:
            # select() always builds a new TensorDict, so adding keys later doesn't touch self.
            batch = batch.select(*(batch.keys() if batch_keys is None else batch_keys))
        non_tensor = pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch")
        meta = pick(self.meta_info, meta_info_keys, "meta_info")
        if deepcopy:
            batch = None if batch is None else batch.clone()
            non_tensor, meta = copy.deepcopy(non_tensor), copy.deepcopy(meta)
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def select_idxs(self, idxs: Any) -> DataProto:
        """Return the rows at ``idxs`` (a copy), in that order.

        Args:
            idxs: a list, np.ndarray or torch.Tensor of row indices (negative allowed), or a bool
                mask with one entry per row.

        Example: ``dp.select_idxs([2, 0]), dp.select_idxs(np.array([True, False, True, False]))``
        """
        index = as_index_array(idxs, len(self))
        return DataProto(
            batch=None if self.batch is None else self.batch[torch.from_numpy(index)],
            non_tensor_batch={k: v[index] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``start:end:step`` as in Python slicing; positive steps share memory with ``self``.

        Example: ``dp.slice(1, 3), dp.slice(step=2)``
        """
        start, end, step = slice(start, end, step).indices(len(self))
        if step < 0:  # torch views cannot have negative strides: gather the rows instead
            return self.select_idxs(np.arange(start, end, step, dtype=np.int64))
        rows = slice(start, end, step)
        return DataProto(
            batch=None if self.batch is None else self.batch[rows],
            non_tensor_batch={k: v[rows] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the named keys from ``self`` and return them as a new DataProto.

        Example: ``labels = dp.pop(batch_keys=["labels"])``
        """
        # Every key is checked before anything is removed, so a bad key leaves self untouched.
        own_batch_keys = [] if self.batch is None else list(self.batch.keys())
        pick(dict.fromkeys(own_batch_keys), batch_keys or [], "batch")
        non_tensor = pick(self.non_tensor_batch, non_tensor_batch_keys or [], "non_tensor_batch")
        meta = pick(self.meta_info, meta_info_keys or [], "meta_info")
        batch = None
        if batch_keys:
            assert self.batch is not None  # pick above rejected batch keys of a batch-less DataProto
            tensors = {k: self.batch.pop(k) for k in batch_keys}
            batch = TensorDict(tensors, batch_size=self.batch.batch_size, device=self.batch.device)
        for source, popped in ((self.non_tensor_batch, non_tensor), (self.meta_info, meta)):
            for key in popped:
                del source[key]
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename columns (tensor or non-tensor) in place and return ``self``.

        Example: ``dp.rename("responses", "response_ids")``
        """
        old_keys = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new_keys = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old_keys) != len(new_keys):
            raise DataProtoError(f"rename needs as many new keys as old ones, got {old_keys} -> {new_keys}")
        for old, new in zip(old_keys, new_keys):
            if self.batch is not None and old in self.batch.keys():
                self.batch.rename_key_(old, new)
            elif old in self.non_tensor_batch:
                self.non_tensor_batch[new] = self.non_tensor_batch.pop(old)
            else:
                raise KeyError(f"no column named {old!r} to rename")
        return self

    def union(self, other: DataProto) -> DataProto:
        """Add ``other``'s columns and meta_info to ``self`` in place and return ``self``.
        A key present in both must hold equal values, otherwise ValueError.

        Example: ``dp.union(DataProto.from_dict({"values": torch.zeros(len(dp))}))``
        """
        has_rows = [d.batch is not None or bool(d.non_tensor_batch) for d in (self, other)]
        if all(has_rows) and len(self) != len(other):
            raise DataProtoError(f"cannot union DataProtos of {len(self)} and {len(other)} rows")
        if other.batch is not None and self.batch is None:
            self.batch = other.batch.select(*other.batch.keys())
        elif other.batch is not None and self.batch is not None:
            own_keys = set(self.batch.keys(include_nested=True, leaves_only=True))
            for key, t in tensor_items(other.batch):
                if key in own_keys:
                    require_equal(f"batch[{key!r}]", self.batch[key], t)
                else:
                    self.batch[key] = t
        for mine, theirs, what in (
            (self.non_tensor_batch, other.non_tensor_batch, "non_tensor_batch"),
            (self.meta_info, other.meta_info, "meta_info"),
        ):
            for key, v in theirs.items():
                if key in mine:
                    require_equal(f"{what}[{key!r}]", mine[key], v)
                mine.setdefault(key, v)
        self.check_consistency()
        return self

    # ----------------------------------------------------------------- splitting and joining
    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into exactly ``chunks`` parts of consecutive rows (views, no copy).

        Unlike verl, the length need not be divisible: sizes differ by at most one, the first
        ``len % chunks`` parts holding the extra row (7 rows into 2 -> 4 and 3). Parts are empty
        only when len < chunks.

        Example:
            >>> [len(p) for p in DataProto.from_dict({"x": torch.arange(7)}).chunk(3)]
            [3, 2, 2]
        """
        check_positive_int("chunks", chunks)
        base, extra = divmod(len(self), chunks)
        bounds = np.cumsum([0] + [base + (i < extra) for i in range(chunks)])
        return [self.slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]

    def split(self, split_size: int) -> list[DataProto]:
        """Split into parts of ``split_size`` rows, the last possibly shorter (views, no copy).

        Example:
            >>> [len(p) for p in DataProto.from_dict({"x": torch.arange(5)}).split(2)]
            [2, 2, 1]
        """
        check_positive_int("split_size", split_size)
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(
        data: Sequence[DataProto], alloc: Callable[[int], np.ndarray | None] | None = None
    ) -> DataProto:
        """Concatenate DataProtos with the same columns row-wise, into memory of its own.

        meta_info: under ``"metrics"`` (a dict, or a list of dicts), each metric name maps to the
        list of values from all parts, list values flattened in; any other key must hold equal
        values wherever it appears (else DataProtoError), and parts may add keys of their own.

        Args:
            data: the parts, in order; their tensors may be read-only (they are only read).
            alloc: ``alloc(nbytes)`` may give the memory a joined column goes into (a uint8 numpy
                array, e.g. a free shared-memory segment whose pages exist already), or None for
                new memory.

        Example: ``DataProto.concat(dp.chunk(2))  # the same rows as dp``
        """
        data = list(data)
        if not data:
            raise DataProtoError("concat needs at least one DataProto")
        if len({d.batch is None for d in data}) > 1:
            raise DataProtoError("cannot concat DataProtos where only some have a tensor batch")
        batch = None
        batches = [d.batch for d in data if d.batch is not None]  # all of them or none (checked above)
        if batches:
            require_same_keys("batch", [sorted(map(str, b.keys(True))) for b in batches])
            batch = cat_batches(batches, alloc)
        require_same_keys("non_tensor_batch", [sorted(d.non_tensor_batch) for d in data])
        non_tensor = {
            k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in data[0].non_tensor_batch
        }
        meta = merge_meta([d.meta_info for d in data])
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row ``repeat_times`` times.

        Args:
            repeat_times: copies of each row.
            interleave: True gives a a b b c c (a row's copies adjacent); False gives a b c a b c.

        Example: ``dp.repeat(4)  # e.g. 4 samples per prompt for GRPO``
        """
        check_positive_int("repeat_times", repeat_times)
        rows = np.arange(len(self), dtype=np.int64)
        return self.select_idxs(np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times))

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Repeat row ``i`` ``repeat_times[i]`` times, copies adjacent (a a a b c c).

        Example:
            >>> dp = DataProto.from_dict({"x": torch.tensor([1, 2, 3])})
            >>> dp.sample_level_repeat([2, 0, 1]).batch["x"].tolist()
            [1, 1, 3]
        """
        times = np.asarray(repeat_times.cpu() if isinstance(repeat_times, torch.Tensor) else repeat_times)
        if times.ndim != 1 or len(times) != len(self):
            raise DataProtoError(
                f"repeat_times needs one count per row ({len(self)}), got shape {times.shape}"
            )
        if times.size and (not np.issubdtype(times.dtype, np.integer) or times.min() < 0):
            raise DataProtoError(f"repeat_times must be non-negative ints, got {times.tolist()}")
        return self.select_idxs(np.repeat(np.arange(len(self), dtype=np.int64), times))

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> DataProto:
        """Cut each row into ``n_split`` rows: columns in ``split_keys`` are split along their
        second dim into ``n_split`` parts, every other column is repeated.

        Useful to pass grouped tensors (a row of ``n`` samples) that must not be shuffled apart.

        Example:
            >>> dp = DataProto.from_dict({"a": torch.tensor([[1, 2], [3, 4]]), "b": torch.tensor([7, 8])})
            >>> out = dp.unfold_column_chunks(2, split_keys=["a"])
            >>> out.batch["a"].tolist(), out.batch["b"].tolist()
            ([[1], [2], [3], [4]], [7, 7, 8, 8])
        """
        check_positive_int("n_split", n_split)
        split = set(split_keys or ())
        columns = [k for k, _ in tensor_items(self.batch)] + list(self.non_tensor_batch)
        unknown = sorted(split - set(columns))
        if unknown:
            raise KeyError(f"split_keys {unknown} are not columns of this DataProto; it has {columns}")

        def unfold(key: str, value: Any) -> Any:
            if key not in split:
                return (
                    value.repeat_interleave(n_split, dim=0)
                    if isinstance(value, torch.Tensor)
                    else np.repeat(value, n_split, axis=0)
                )
            if value.ndim < 2 or value.shape[1] % n_split:
                raise DataProtoError(
                    f"column {key!r} of shape {tuple(value.shape)}: its second dim does not split into {n_split}"
                )
            return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])

        batch = None
        if self.batch is not None:
            batch = TensorDict(
                {k: unfold(k, t) for k, t in tensor_items(self.batch)},
                batch_size=[len(self) * n_split],
                device=self.batch.device,
            )
        non_tensor = {k: unfold(k, v) for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the last row (``padding_candidate="first"``: of the
        first row), in place. verl's way to make a batch divisible before splitting it.

        Example:
            >>> dp = DataProto.from_dict({"x": torch.tensor([1, 2, 3])})
            >>> dp.padding(2); dp.batch["x"].tolist()
            [1, 2, 3, 3, 3]
        """
        if not isinstance(padding_size, (int, np.integer)) or padding_size < 0:
            raise DataProtoError(f"padding_size must be a non-negative int, got {padding_size!r}")
        if padding_size == 0:
            return
        if len(self) == 0:
            raise DataProtoError("cannot pad an empty DataProto: there is no row to repeat")
        source = 0 if padding_candidate == "first" else len(self) - 1
        padded = self.select_idxs(np.concatenate([np.arange(len(self)), np.full(padding_size, source)]))
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def reorder(self, indices: Any) -> None:
        """Reorder the rows in place: row ``i`` becomes old row ``indices[i]``.

        Example: ``dp.reorder(torch.tensor([2, 0, 1]))``
        """
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        dataloader_kwargs: dict | None = None,
    ) -> Iterator[DataProto]:
        """Iterate over mini-batches of ``mini_batch_size`` rows, ``epochs`` times over the data.

        Args:
            mini_batch_size: rows per mini-batch; an epoch's last one may be shorter.
            epochs: passes over the data.
            seed: seeds the shuffle's torch.Generator, so the order is reproducible.
            dataloader_kwargs: ``{"shuffle": bool, "drop_last": bool}``; other keys are ignored
                with a warning (there is no DataLoader underneath).

        Example:
            >>> for mb in dp.make_iterator(2, epochs=1, seed=0, dataloader_kwargs={"shuffle": True}):
            ...     pass
        """
        return mini_batches(self, mini_batch_size, epochs, seed, dataloader_kwargs)

    def to(self, device: str | torch.device) -> DataProto:
        """Move the tensor batch to ``device`` in place and return ``self``.

        Example: ``dp.to("cuda")``
        """
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def to_tensordict(self) -> TensorDict:
        """This DataProto as one TensorDict: tensor columns as they are, each non-tensor column
        as a ``NonTensorStack`` (one ``NonTensorData`` per row, so nested lists and dicts keep
        their shape) and each meta_info key as a ``NonTensorData``. Undo with :meth:`from_tensordict`.

        Example:
            >>> td = DataProto.from_dict({"x": torch.arange(2)}, {"tag": ["a", "b"]}, {"step": 3}).to_tensordict()
            >>> td["x"].tolist(), td["tag"], td["step"]
            ([0, 1], ['a', 'b'], 3)
        """
        return tensordicts.to_tensordict(self)

    @classmethod
    def from_tensordict(
        cls, tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1
    ) -> DataProto:
        """A DataProto from a TensorDict: tensors become ``batch``, ``NonTensorStack`` entries
        non-tensor columns, ``NonTensorData`` entries meta_info (added to ``meta_info``).

        Args:
            tensor_dict: one row per entry of its first batch dim.
            meta_info: more meta_info.
            num_batch_dims: must be 1 (a DataProto's rows are its first dim); kept for verl's signature.

        Example:
            >>> DataProto.from_tensordict(dp.to_tensordict())  # the same columns as dp  # doctest: +SKIP
        """
        return tensordicts.from_tensordict(cls, tensor_dict, meta_info, num_batch_dims)

    # ----------------------------------------------------------------- persistence and pickling
    def save_to_disk(self, path: str | os.PathLike) -> None:
        """Write this DataProto to the file ``path`` (a pickle, protocol 5).

        Example: ``dp.save_to_disk("/tmp/batch.pkl")``
        """
        with open(path, "wb") as f:
            pickle.dump(self, f, protocol=5)

    @staticmethod
    def load_from_disk(path: str | os.PathLike) -> DataProto:
        """Read a DataProto written by ``save_to_disk``. It is a pickle: load only trusted files.

        Example: ``dp = DataProto.load_from_disk("/tmp/batch.pkl")``
        """
        with open(path, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise TypeError(f"{path} holds a {type(data).__name__}, not a DataProto")
        return data

    def __getstate__(self) -> dict:
        # Tensors travel as numpy arrays sharing their memory: under pickle protocol 5 with a
        # buffer_callback numpy hands their bytes out-of-band, so each tensor is copied at most
        # once, and a row-slice (a chunk) exports only its own rows.
        return {
            "batch": pack_batch(self.batch),
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict) -> None:
        self.batch = unpack_batch(state["batch"])
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]
