"""Hand-off: a GroupFuture passed into another group's call reaches each consumer rank from the
producer ranks' own memory; the controller only says which rows of which producer rank each
consumer rank takes.

The controller waits for the producer ranks (it must know how many rows each made) but does not
open their bytes: each consumer rank is sent an :class:`Assembled` argument, the producer ranks'
outputs as they were sent (``Opened.as_sent``, whose bytes a backend passes on without copying:
the process backend forwards the producers' shared-memory segments) and the rows to take of each.
It becomes the argument itself when the consumer rank unpickles it (:func:`assemble`), exactly what
the usual path (collect on the controller, then dispatch) would have given that rank, padding
included. A result the user also ``.get()``-s is the user's own: what goes on is what the
producer rank sent, whatever the user does to it.

When does it apply: every argument a GroupFuture of a row-collecting producer (``DispatchMode
.row_sources``, e.g. DP_COMPUTE_PROTO; or a rank-zero call) into a row-splitting consumer
(``row_chunks``: DP_COMPUTE_PROTO, DP_COMPUTE_METRIC, ``nd_dispatch``), whatever the two world sizes;
or any GroupFuture (of those producers) among the arguments of a method whose mode gives each rank
its arguments as they are (``broadcasts``: ONE_TO_ALL, RANK_ZERO). Other cases take the usual path.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

from spmdcall.group.future import GroupFuture
from spmdcall.group.modes import Chunks, Dispatch, DispatchMode, Execute, is_data_proto
from spmdcall.group.register import ResolvedSpec
from spmdcall.transport.envelope import Envelope, Opened, Sealed

__all__ = ["Assembled", "assemble", "hand_off"]

# (producer output, first row, end row): rows taken from one producer rank's output
Run = tuple[int, int, int]


class Assembled:
    """A consumer rank's argument made of producer ranks' outputs: ``pieces`` (each as its rank
    sent it, or a value), and ``runs``, the rows to take of each in order (None: ``pieces[0]``
    whole), with the ``meta_info`` the rows' DataProto gets. Pickled, it carries the pieces' bytes
    out of band (a backend passes them on); unpickled, it is the argument (:func:`assemble`)."""

    __slots__ = ("pieces", "runs", "meta_info")

    def __init__(self, pieces: list[Any], runs: list[Run] | None = None, meta_info: dict | None = None):
        self.pieces, self.runs, self.meta_info = pieces, runs, meta_info

    def __reduce__(self) -> tuple:
        return assemble, (self.pieces, self.runs, self.meta_info)

    def __repr__(self) -> str:
        return f"Assembled({len(self.pieces)} pieces, runs={self.runs})"


def assemble(pieces: list[Any], runs: list[Run] | None, meta_info: dict | None) -> Any:
    """The argument an :class:`Assembled` stands for (on the consumer rank, as it is unpickled):
    ``pieces[0]`` opened, or the rows ``runs`` name, as one DataProto. One run stays a view of its
    producer's bytes (the consumer's own copy-on-write pages); several are joined once."""

    def opened(piece: Any, shared: bool) -> Any:
        return piece.open(shared=shared) if isinstance(piece, Envelope) else piece

    if runs is None:
        return opened(pieces[0], False)
    from spmdcall.data import DataProto
    from spmdcall.transport.segments import lend_out

    used = {k for k, _, _ in runs}
    # Joined rows are copied anyway: their pieces may stay read-only (Ray's object store).
    values = {k: opened(pieces[k], len(runs) > 1) for k in used}
    parts = [values[k].slice(start, stop) for k, start, stop in runs]
    rows = parts[0] if len(parts) == 1 else DataProto.concat(parts, alloc=lend_out)
    rows.meta_info = dict(meta_info or {})
    return rows


def hand_off(group: Any, spec: ResolvedSpec, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The per-rank arguments of a call on ``group`` whose GroupFuture arguments go rank to rank
    (each a list of one entry per rank, as a dispatch function returns them), or None for the
    usual path (collect on the controller, then dispatch)."""
    mode: DispatchMode = spec.dispatch_mode
    if not (spec.materialize_futures and group.capabilities.ranks_in_own_processes):
        return None  # ranks in the controller's process get values (nothing to unpickle there)
    values = [*args, *kwargs.values()]
    futures = [v for v in values if isinstance(v, GroupFuture)]
    if not futures:
        return None
    n = group.world_size
    if mode.broadcasts:
        whole = {id(f): _whole(f) for f in futures}
        if any(w is None for w in whole.values()):
            return None

        def per_rank(v: Any) -> list:
            return [whole[id(v)] if isinstance(v, GroupFuture) else v] * n

        return tuple(per_rank(a) for a in args), {k: per_rank(v) for k, v in kwargs.items()}
    if mode.row_chunks is None or len(futures) != len(values):
        return None
    rows = {id(f): _rows(f) for f in futures}
    lengths = {r.num_rows if r is not None else None for r in rows.values()}
    if len(lengths) != 1 or None in lengths or 0 in lengths:
        return None  # the usual path says what is wrong
    chunk_of_rank = mode.row_chunks(group)
    num_rows, num_chunks = lengths.pop(), max(chunk_of_rank) + 1
    assert num_rows is not None
    pad_size = (-num_rows) % num_chunks
    per_chunk = (num_rows + pad_size) // num_chunks

    def split(f: GroupFuture) -> Chunks:
        r = rows[id(f)]
        assert r is not None
        chunks = [r.take(d * per_chunk, (d + 1) * per_chunk) for d in range(num_chunks)]
        return Chunks([chunks[d] for d in chunk_of_rank], pad_size=pad_size, padded_rows=num_rows + pad_size)

    return tuple(split(a) for a in args), {k: split(v) for k, v in kwargs.items()}


def same_split(group: Any, spec: ResolvedSpec, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Rank i's output to rank i, unjoined and unsplit, when every argument is a GroupFuture of
    a group that split its data the same way over as many ranks (padding kept as the producer
    padded); None otherwise. On a backend that resolves rank futures on the worker
    (``Capabilities.hand_off``: ray) they go as they are; on the others, as their ranks sent them."""
    if not (spec.materialize_futures and spec.dispatch_mode.splits_data):
        return None
    values = [*args, *kwargs.values()]
    for v in values:
        if not (
            isinstance(v, GroupFuture)
            and v.spec.dispatch_mode.splits_data
            and v.group.world_size == group.world_size
            and len(v.rank_futures) == group.world_size  # not made before a resize of its group
            and v.spec.execute_mode is Execute.ALL
            and v.spec.dispatch_mode.collect_fn is spec.dispatch_mode.collect_fn
        ):
            return None
    takes = group.capabilities.hand_off
    if takes is not None and all(isinstance(r, takes) for f in values for r in f.rank_futures):
        outputs = {id(f): list(f.rank_futures) for f in values}
    else:
        sealed = {id(f): f.sealed_outputs() for f in values}
        if not all(is_data_proto(s.open(shared=True)) for per_rank in sealed.values() for s in per_rank):
            return None  # not rows to hand on: the usual path collects them (and reports misuse)
        outputs = {
            id(f): [Assembled([_as_sent(s)]) for s in per_rank]
            for f, per_rank in zip(values, sealed.values())
        }

    def per_rank(f: GroupFuture) -> Chunks:
        return Chunks(outputs[id(f)], pad_size=f.pad_size, padded_rows=f.padded_rows)

    return tuple(per_rank(a) for a in args), {k: per_rank(v) for k, v in kwargs.items()}


def _as_sent(sealed: Sealed) -> Any:
    """What goes on for one producer rank's output: as it was sent where the backend kept that
    form (its bytes then pass on uncopied), else the envelope or value itself."""
    if isinstance(sealed, Opened):
        return sealed.value if sealed.as_sent is None else sealed.as_sent
    return sealed


def _rank_zero(f: GroupFuture) -> bool:
    return f.spec.execute_mode is Execute.RANK_ZERO or f.spec.dispatch_mode is Dispatch.RANK_ZERO


def _whole(f: GroupFuture) -> Assembled | None:
    """The future's collected result as one consumer argument, or None when only the controller
    can collect it."""
    if _rank_zero(f):
        return Assembled([_as_sent(f.sealed_outputs()[0])])
    rows = _rows(f)
    return None if rows is None else rows.take(0, rows.num_rows)


class _Rows:
    """The rows a future's collected result is made of: ``pieces`` (as their ranks sent them),
    the rows of each (``lengths``), the rows of the result (``num_rows``: less than their sum by
    the padding's), and the result's ``meta_info``."""

    __slots__ = ("pieces", "lengths", "num_rows", "meta_info")

    def __init__(self, pieces: list, lengths: list[int], num_rows: int, meta_info: dict):
        self.pieces, self.lengths, self.num_rows, self.meta_info = pieces, lengths, num_rows, meta_info

    def take(self, start: int, stop: int) -> Assembled:
        """Rows ``start:stop`` of the result padded as ``split_data`` pads it (rows past
        ``num_rows`` repeat rows 0, 1, ... of the result, cycling), as one consumer argument."""
        bounds = list(itertools.accumulate(self.lengths, initial=0))
        runs: list[Run] = []
        row = start
        while row < stop:
            i = row if row < self.num_rows else (row - self.num_rows) % self.num_rows
            span = min(stop - row, self.num_rows - i)  # rows in order from i on, before a wrap
            k = bisect.bisect_right(bounds, i) - 1
            while span > 0:
                take = min(span, bounds[k + 1] - i)
                if runs and runs[-1][0] == k and runs[-1][2] == i - bounds[k]:
                    runs[-1] = (k, runs[-1][1], runs[-1][2] + take)
                else:
                    runs.append((k, i - bounds[k], i - bounds[k] + take))
                row, i, span, k = row + take, i + take, span - take, k + 1
        used = sorted({k for k, _, _ in runs})  # only the pieces it takes rows of go to the rank
        index = {k: j for j, k in enumerate(used)}
        runs = [(index[k], a, b) for k, a, b in runs]
        return Assembled([self.pieces[k] for k in used], runs, self.meta_info)


def _rows(f: GroupFuture) -> _Rows | None:
    """The rows of the future's collected result; None when its result is not such rows."""
    if _rank_zero(f):
        ranks = [0]
    elif f.spec.dispatch_mode.row_sources is not None:
        ranks = f.spec.dispatch_mode.row_sources(f.group)
    else:
        return None
    sealed = f.sealed_outputs()
    outputs = [sealed[r].open(shared=True) for r in ranks]  # only their lengths and meta are read
    if not outputs or not all(is_data_proto(o) for o in outputs):
        return None
    from spmdcall.data.columns import merge_meta

    lengths = [len(o) for o in outputs]
    num_rows = sum(lengths)
    if not _rank_zero(f) and f.pad_size and f.padded_rows and num_rows % f.padded_rows == 0:
        num_rows -= f.pad_size * (num_rows // f.padded_rows)  # the padding's rows (k per padded row)
    meta = merge_meta([o.meta_info for o in outputs]) if len(outputs) > 1 else dict(outputs[0].meta_info)
    return _Rows([_as_sent(sealed[r]) for r in ranks], lengths, num_rows, meta)
