"""Weights published once, read in place: numbered generations of named tensors in shared memory.

The data plane for weights (an actor's policy going to rollout ranks of another group). The
controller never holds the bytes: it makes a ``WeightStore`` (a folder in ``/dev/shm`` it owns
and removes), one rank publishes into it, every reader on the machine maps it, and a call carries
only a ``WeightGeneration`` (a few hundred bytes of metadata).

- **Written once, into memory kept across syncs.** The store has two slots (files); generation
  ``g`` goes into slot ``g % 2``, whose pages the publisher has mapped since the first sync. A
  tensor is written only if the slot does not hold it already (delta: its checksum differs).
- **Read in place or copied once.** A reader maps both slots once and copies into its model the
  tensors whose checksum differs from what it loaded last (``WeightReader.load_into``), or hands
  out views of the slot (``WeightReader.read``) for an engine that converts them itself.
- **Verified.** Every tensor's checksum is published with it; a reader checks what it copied and
  raises ``WeightChecksumError`` naming the first tensor that differs.
- **Versioned.** A generation is immutable once complete: the publisher takes a slot's lock
  (``flock``, exclusive) while it writes, readers take it shared while they copy, so a reader never
  sees half a generation; ``newest()`` is the newest complete one, for a rank that (re)starts with
  no help from the trainer. A generation asked for after its slot was reused gives the newest.

One machine: a reader on another host gets a clear error (its generation names the host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import mmap
import os
import shutil
import socket
import tempfile
import time
import warnings
import weakref
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "TensorPiece",
    "commit",
    "next_number",
    "WeightStore",
    "WeightPublisher",
    "WeightReader",
    "WeightGeneration",
    "WeightChecksumError",
    "LoadStats",
    "checksum",
]

NUM_SLOTS = 2
_ALIGN = 64  # every tensor starts on a cache line
_PREFIX = "spmdcall-weights-"
_MASK = (1 << 64) - 1
_BLOCK_WORDS = 512  # 4 KiB blocks, each weighted by its position (a swap of two blocks changes the sum)
# verify="auto" checks a load of at most this many bytes on CPU: the call's own fixed costs keep the
# checksum (about half a memcpy of the bytes) within a tenth of the sync (docs/benchmarks-log.md)
AUTO_VERIFY_BYTES = 16 << 20


class WeightChecksumError(ValueError):
    """What a reader loaded is not what was published (corrupted on the way, or a stale slot)."""


def checksum(t: torch.Tensor) -> int:
    """A 64-bit checksum of ``t``'s bytes, the same on CPU and GPU: the wrapping sum of its 64-bit
    words, and the sum of its 4 KiB blocks' sums weighted by position. One read of the bytes
    (about half a memcpy); any changed word changes it, and so does a swap of two blocks."""
    flat = t.detach().reshape(-1)
    if flat.device.type == "cpu" and flat.numel() * flat.element_size() <= _SMALL_BYTES:
        # a copy (of at most 1 MiB): numpy on the tensor's own storage would make it unresizable,
        # and FSDP frees the storage of gathered parameters by resizing it to 0
        return _small_checksum(flat.view(torch.uint8).clone().numpy())
    try:
        raw = flat.view(torch.uint8)
        num_words = raw.numel() // 8
        words = raw[: num_words * 8].view(torch.int64)
    except RuntimeError:  # a view at an offset int64 cannot start at: copy it once
        raw = flat.clone().view(torch.uint8)
        num_words = raw.numel() // 8
        words = raw[: num_words * 8].view(torch.int64)
    tail = int(raw[num_words * 8 :].to(torch.int64).sum()) if raw.numel() % 8 else 0
    if num_words <= _BLOCK_WORDS:
        weights = torch.arange(1, num_words + 1, dtype=torch.int64, device=words.device)
        total, weighted = int(words.sum()), int((words * weights).sum())
    else:
        num_blocks = num_words // _BLOCK_WORDS
        blocks = words[: num_blocks * _BLOCK_WORDS].view(num_blocks, _BLOCK_WORDS).sum(1)
        weights = torch.arange(1, num_blocks + 1, dtype=torch.int64, device=words.device)
        total = int(blocks.sum()) + int(words[num_blocks * _BLOCK_WORDS :].sum())
        weighted = int((blocks * weights).sum())
    return ((total + tail) ^ (weighted * 0x9E3779B97F4A7C15)) & _MASK


_SMALL_BYTES = 1 << 20  # below this, numpy's few microseconds a call beat torch's dispatch


def _small_checksum(raw: np.ndarray) -> int:
    """``checksum`` of a small CPU tensor's bytes, with numpy (the same value: sums mod 2**64)."""
    num_words = raw.size // 8
    words = raw[: num_words * 8].view(np.uint64)
    tail = int(raw[num_words * 8 :].sum(dtype=np.uint64)) if raw.size % 8 else 0
    with np.errstate(over="ignore"):
        if num_words <= _BLOCK_WORDS:
            weights = np.arange(1, num_words + 1, dtype=np.uint64)
            total, weighted = int(words.sum(dtype=np.uint64)), int((words * weights).sum(dtype=np.uint64))
        else:
            num_blocks = num_words // _BLOCK_WORDS
            blocks = (
                words[: num_blocks * _BLOCK_WORDS].reshape(num_blocks, _BLOCK_WORDS).sum(1, dtype=np.uint64)
            )
            weights = np.arange(1, num_blocks + 1, dtype=np.uint64)
            total = int(blocks.sum(dtype=np.uint64)) + int(
                words[num_blocks * _BLOCK_WORDS :].sum(dtype=np.uint64)
            )
            weighted = int((blocks * weights).sum(dtype=np.uint64))
    return ((total + tail) ^ (weighted * 0x9E3779B97F4A7C15)) & _MASK


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor, or one piece of its rows, lies in a writer's slot, and its checksum."""

    name: str
    dtype: str
    shape: tuple[int, ...]  # the whole tensor's
    offset: int
    nbytes: int
    checksum: int
    rows: tuple[int, int] | None = None  # the rows [start, stop) of dim 0 this piece holds; None: all
    writer: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return self.name, 0 if self.rows is None else self.rows[0]

    @property
    def piece_shape(self) -> tuple[int, ...]:
        return self.shape if self.rows is None else (self.rows[1] - self.rows[0], *self.shape[1:])

    def part_of(self, t: torch.Tensor) -> torch.Tensor:
        """This piece's rows of the whole tensor ``t``."""
        return t if self.rows is None else t[self.rows[0] : self.rows[1]]


@dataclass(frozen=True)
class TensorPiece:
    """Rows ``[row, row + len(tensor))`` of a tensor of ``shape``: what one writer of a sharded
    model holds (an FSDP shard), published without gathering the whole."""

    tensor: torch.Tensor
    shape: tuple[int, ...]
    row: int


@dataclass(frozen=True)
class WeightGeneration:
    """One complete, numbered publication: metadata only (what a call to a reader carries).

    ``number`` counts publications from 1; ``version`` is the caller's (a policy version)."""

    root: str
    host: str
    number: int
    version: int
    slot: int
    entries: tuple[TensorEntry, ...]
    written: int = 0  # bytes the publishers wrote (the rest the slots held already)
    seconds: float = 0.0  # the publication's time, checksums included (the slowest writer's)
    meta: dict[str, Any] = field(default_factory=dict)  # the publisher's, JSON-able (e.g. a canary)
    writers: int = 1  # ranks that wrote a part, each into slot files of its own

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def to_json(self) -> str:
        d = {
            k: getattr(self, k)
            for k in ("root", "host", "number", "version", "slot", "written", "seconds", "meta", "writers")
        }
        return json.dumps(d | {"entries": [e.__dict__ for e in self.entries]})

    @classmethod
    def from_json(cls, text: str) -> WeightGeneration:
        d = json.loads(text)
        entries = tuple(
            TensorEntry(**(e | {"shape": tuple(e["shape"]), "rows": e["rows"] and tuple(e["rows"])}))
            for e in d.pop("entries")
        )
        return cls(**d, entries=entries)


@dataclass
class LoadStats:
    """What one load did: the generation it loaded, the bytes it copied and their share of the
    whole, its seconds, and whether it checked checksums."""

    number: int
    version: int
    bytes: int
    changed_fraction: float
    seconds: float
    verified: bool
    generation: WeightGeneration | None = None  # the one loaded (its meta included)

    @classmethod
    def of(
        cls, gen: WeightGeneration, copied: list[TensorEntry], seconds: float, verified: bool
    ) -> LoadStats:
        """The stats of a load of ``gen`` that copied the pieces ``copied``."""
        moved = sum(e.nbytes for e in copied)
        return cls(gen.number, gen.version, moved, moved / max(gen.nbytes, 1), seconds, verified, gen)

    def metrics(self, prefix: str = "sync/") -> dict[str, float]:
        return {
            f"{prefix}bytes": float(self.bytes),
            f"{prefix}changed_fraction": self.changed_fraction,
            f"{prefix}seconds": self.seconds,
            f"{prefix}generation": float(self.number),
        }


def _shm_dir() -> str:
    return (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WeightStore:
    """The folder a run's weights are published into; made and removed by its owner (the controller).

    Pass ``store.root`` to the publishing rank and to the readers. Folders left by an owner that
    died (SIGKILL) are removed when the next store is made.

    Example:
        >>> with sc.WeightStore() as store:  # doctest: +SKIP
        ...     gen = actor.publish_weights(version=1, root=store.root)
        ...     rollout.load_weights(gen, version=1)
    """

    def __init__(self, parent: str | None = None):
        parent = parent or _shm_dir()
        self._sweep(parent)
        self.root = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=parent)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)

    @staticmethod
    def _sweep(parent: str) -> None:
        for path in Path(parent).glob(f"{_PREFIX}*"):
            pid = path.name[len(_PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Remove the folder (readers that still map a slot keep their pages until they let go)."""
        self._finalizer()

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"WeightStore({self.root})"


class _Manifest:
    """A generation's JSON file, parsed again only when the file changed (a load that finds nothing
    new costs a ``stat``, not a parse of every entry)."""

    def __init__(self, path: str):
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._gen: WeightGeneration | None = None

    def read(self) -> WeightGeneration | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)  # written by rename: a new file each time
        if key != self._seen:
            self._gen, self._seen = WeightGeneration.from_json(Path(self.path).read_text()), key
        return self._gen


class _Slot:
    """One writer's file of one slot, mapped; grown (and mapped again) when a part needs more room."""

    def __init__(self, root: str, index: int, writer: int, writable: bool):
        self.index, self.writer = index, writer
        self.path = os.path.join(root, f"slot-{index}-{writer}.bin")
        self.manifest = os.path.join(root, f"slot-{index}-{writer}.json")
        self._part = _Manifest(self.manifest)
        flags = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
        self.fd = os.open(self.path, flags | os.O_CLOEXEC, 0o600)
        self.writable = writable
        self.mm: mmap.mmap | None = None
        self.size = 0

    def map(self, size: int | None = None) -> mmap.mmap:
        """The slot mapped (at ``size`` bytes, growing the file, for the publisher)."""
        if size is not None and size > os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, size)
        current = os.fstat(self.fd).st_size
        if self.mm is None or self.size != current:
            if self.mm is not None:
                with contextlib.suppress(BufferError):  # views still alive keep the old map
                    self.mm.close()
            access = mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ
            self.mm = mmap.mmap(self.fd, current, access=access) if current else None
            self.size = current
        assert self.mm is not None
        return self.mm

    def lock(self, exclusive: bool) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def part(self) -> WeightGeneration | None:
        return self._part.read()

    def view(self, e: TensorEntry) -> torch.Tensor:
        """``e``'s piece in the slot; a reader's view is of read-only pages (writing it faults)."""
        dtype = getattr(torch, e.dtype)
        if e.nbytes == 0:
            return torch.empty(e.piece_shape, dtype=dtype)
        with warnings.catch_warnings():  # "not writable": a reader's map is read-only on purpose
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(
                self.map(), dtype=dtype, count=e.nbytes // dtype.itemsize, offset=e.offset
            )
        return flat.view(e.piece_shape)

    def close(self) -> None:
        if self.mm is not None:
            with contextlib.suppress(BufferError):
                self.mm.close()
        os.close(self.fd)


class WeightPublisher:
    """The publishing side: ``publish(tensors, version)`` writes a new generation from one rank.

    Ranks of a sharded model each write their own rows without gathering: every writer calls
    ``write(pieces, next_number(root), version)`` with a ``writer`` index of its own, and whoever
    holds all the parts (the controller, in a collect function) calls ``commit(parts)``.
    Safe from one thread at a time (a rank publishes between its training steps)."""

    def __init__(self, root: str, writer: int = 0):
        if not os.path.isdir(root):
            raise FileNotFoundError(f"no weight store at {root!r}: make one with sc.WeightStore() first")
        self.root, self.writer = root, writer
        self._slots = [_Slot(root, i, writer, writable=True) for i in range(NUM_SLOTS)]

    def publish(
        self, tensors: Mapping[str, torch.Tensor], version: int, meta: Mapping[str, Any] | None = None
    ) -> WeightGeneration:
        """Write ``tensors`` as the next generation and return its metadata (small: send it to readers).

        Only tensors whose bytes differ from what the slot holds are written (delta). ``meta``
        (JSON-able) travels with the generation, e.g. what a reader checks after loading."""
        return commit([self.write(tensors, next_number(self.root), version, meta)])

    def write(
        self,
        tensors: Mapping[str, torch.Tensor | TensorPiece],
        number: int,
        version: int,
        meta: Mapping[str, Any] | None = None,
    ) -> WeightGeneration:
        """Write this writer's part of generation ``number``: whole tensors, or ``TensorPiece`` rows of
        them. Returns the part (``commit`` makes the generation of all parts)."""
        if not tensors:
            raise ValueError("publish() needs at least one tensor")
        start = time.perf_counter()
        pieces = {name: _as_piece(name, t) for name, t in tensors.items()}
        slot = self._slots[number % NUM_SLOTS]
        entries, offset = [], 0
        for name, p in pieces.items():
            nbytes = p.tensor.numel() * p.tensor.element_size()
            rows = None if p.row == 0 and tuple(p.tensor.shape) == p.shape else (p.row, p.row + len(p.tensor))
            dtype = str(p.tensor.dtype).removeprefix("torch.")
            entries.append(
                TensorEntry(name, dtype, p.shape, offset, nbytes, checksum(p.tensor), rows, self.writer)
            )
            offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        slot.lock(exclusive=True)
        try:
            held = slot.part()
            layout = [(e.name, e.dtype, e.shape, e.rows, e.offset) for e in entries]
            same = (
                held is not None
                and [(e.name, e.dtype, e.shape, e.rows, e.offset) for e in held.entries] == layout
            )
            had = {e.key: e.checksum for e in held.entries} if same and held is not None else {}
            slot.map(max(offset, 1))
            stale = [e for e in entries if had.get(e.key) != e.checksum and e.nbytes]
            with torch.no_grad():
                for e in stale:
                    slot.view(e).copy_(pieces[e.name].tensor.detach().reshape(e.piece_shape))
            part = WeightGeneration(
                self.root,
                socket.gethostname(),
                number,
                version,
                slot.index,
                tuple(entries),
                written=sum(e.nbytes for e in stale),
                seconds=time.perf_counter() - start,
                meta=dict(meta or {}),
            )
            _write_atomically(slot.manifest, part.to_json())
        finally:
            slot.unlock()
        return part

    def close(self) -> None:
        for s in self._slots:
            s.close()


class _Views(Mapping[tuple[str, int], torch.Tensor]):
    """Read-only views of a generation's pieces in the slots, made when first looked at (a load
    that copies a few pieces does not build a view of every one)."""

    def __init__(self, gen: WeightGeneration, slots: list[_Slot]):
        self._entries = {e.key: e for e in gen.entries}
        self._slots = slots
        self._made: dict[tuple[str, int], torch.Tensor] = {}

    def __getitem__(self, key: tuple[str, int]) -> torch.Tensor:
        view = self._made.get(key)
        if view is None:
            e = self._entries[key]
            view = self._made[key] = self._slots[e.writer].view(e)
        return view

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _as_piece(name: str, t: object) -> TensorPiece:
    if isinstance(t, TensorPiece):
        return t
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"publish() takes name -> tensor; {name!r} is a {type(t).__name__}")
    return TensorPiece(t, tuple(t.shape), 0)


def next_number(root: str) -> int:
    """The number the next generation of the store at ``root`` takes."""
    newest = _read_newest(root)
    return 1 if newest is None else newest.number + 1


def commit(parts: list[WeightGeneration | None]) -> WeightGeneration:
    """The generation made of every writer's part (Nones, from ranks that wrote nothing, left out),
    recorded as the store's newest. Each tensor's pieces must cover its rows exactly once."""
    written = [p for p in parts if p is not None]
    if not written:
        raise ValueError("commit() needs at least one part")
    first = written[0]
    if len({(p.root, p.number, p.slot) for p in written}) != 1:
        raise ValueError(f"parts of different generations: {sorted({(p.root, p.number) for p in written})}")
    writers = sorted(e.writer for p in written for e in p.entries[:1])
    if writers != list(range(len(written))):
        raise ValueError(f"the parts' writers must be 0..{len(written) - 1}, got {writers}")
    entries = tuple(e for p in written for e in p.entries)
    _check_coverage(entries)
    gen = dataclasses.replace(
        first,
        entries=entries,
        written=sum(p.written for p in written),
        seconds=max(p.seconds for p in written),
        writers=len(written),
    )
    _write_atomically(os.path.join(first.root, "newest.json"), gen.to_json())
    return gen


def _check_coverage(entries: tuple[TensorEntry, ...]) -> None:
    rows: dict[str, list[tuple[int, int]]] = {}
    for e in entries:
        rows.setdefault(e.name, []).append(e.rows or (0, e.shape[0] if e.shape else 1))
    for name, spans in rows.items():
        spans.sort()
        whole = next(e for e in entries if e.name == name).shape
        end = whole[0] if whole else 1
        covered = (
            spans[0][0] == 0 and spans[-1][1] == end and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        )
        if not covered:
            raise ValueError(f"the pieces of {name!r} {whole} cover rows {spans}, not each row once")


class WeightReader:
    """The reading side (each reader rank): maps the store's slots once and loads generations.

    Keeps what it loaded last, by piece checksum, so the next load copies only what changed."""

    def __init__(self, root: str):
        self.root = root
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._whole: dict[str, torch.Tensor] = {}  # tensors joined from pieces, for ``whole``
        self._newest = _Manifest(os.path.join(root, "newest.json"))
        self.loaded: dict[tuple[str, int], int] = {}  # piece key -> checksum of what the destination holds
        self.number = 0

    def _slot(self, index: int, writer: int) -> _Slot:
        slot = self._slots.get((index, writer))
        if slot is None:
            if not os.path.isdir(self.root):
                raise FileNotFoundError(f"no weight store at {self.root!r} (was it closed?)")
            slot = self._slots[index, writer] = _Slot(self.root, index, writer, writable=False)
        return slot

    def newest(self) -> WeightGeneration | None:
        """The newest complete generation, or None before the first publication."""
        return self._newest.read()

    @contextlib.contextmanager
    def read(
        self, at_least: int = 0
    ) -> Iterator[tuple[WeightGeneration, Mapping[tuple[str, int], torch.Tensor]]]:
        """The newest complete generation numbered ``at_least`` or more, and read-only views of its
        pieces (by ``TensorEntry.key``) in the slots, valid while the block runs (the slots are
        locked against the publishers)."""
        for _ in range(1000):
            newest = self.newest()
            if newest is None or newest.number < at_least:
                have = "nothing" if newest is None else f"generation {newest.number}"
                raise LookupError(
                    f"the weight store {self.root} holds {have}; generation {at_least} was asked for"
                )
            if newest.host != socket.gethostname():
                raise RuntimeError(
                    f"the weights were published on host {newest.host!r}; this reader runs on "
                    f"{socket.gethostname()!r} and a weight store is read on its own machine only"
                )
            slots = [self._slot(newest.slot, w) for w in range(newest.writers)]
            locked: list[_Slot] = []
            try:
                for slot in slots:
                    slot.lock(exclusive=False)
                    locked.append(slot)
                parts = [slot.part() for slot in slots]
                numbers = {p.number if p is not None else -1 for p in parts}
                if len(numbers) == 1 and numbers.pop() >= newest.number:
                    # the slots may hold a newer generation than `newest` said, whole in every part
                    gen = dataclasses.replace(
                        newest if parts[0] is None else parts[0],
                        entries=tuple(e for p in parts if p is not None for e in p.entries),
                        writers=newest.writers,
                    )
                    views = _Views(gen, slots)
                    try:
                        yield gen, views
                    finally:
                        del views
                    return
            finally:
                for slot in locked:
                    slot.unlock()
            time.sleep(0.001)  # a writer is between its part and the others': look again
        raise TimeoutError(f"the weight store {self.root} kept changing while being read")

    def load_into(
        self, destination: Mapping[str, torch.Tensor], at_least: int = 0, verify: bool | str = "auto"
    ) -> LoadStats:
        """Copy the newest generation numbered ``at_least`` or more into ``destination`` (name ->
        tensor, in place), only the pieces that differ from what was loaded last; with ``verify``,
        check each copied piece's checksum (``WeightChecksumError`` names the first that differs).
        ``"auto"`` checks where it costs little beside the copy: a destination on a GPU (the
        checksum runs at the GPU's memory speed), or at most ``AUTO_VERIFY_BYTES`` to copy."""
        start = time.perf_counter()
        with self.read(at_least) as (gen, views):
            _check_names(gen, {n: tuple(t.shape) for n, t in destination.items()})
            changed = self.changed(gen)
            with torch.no_grad():
                if changed:
                    torch._foreach_copy_(
                        [e.part_of(destination[e.name]) for e in changed], [views[e.key] for e in changed]
                    )
            verify = should_verify(verify, changed, any(t.device.type != "cpu" for t in destination.values()))
            if verify:
                self.verify({e.key: e.part_of(destination[e.name]) for e in changed}, changed, gen.number)
        self.mark_loaded(gen)
        return LoadStats.of(gen, changed, time.perf_counter() - start, verify)

    def whole(
        self, gen: WeightGeneration, views: Mapping[tuple[str, int], torch.Tensor], names: Collection[str]
    ) -> dict[str, torch.Tensor]:
        """The whole tensors ``names`` of ``gen`` (from ``read``'s views): a view where one piece
        holds it all, else joined from its pieces into memory this reader keeps for the next time."""
        out = {}
        for name in names:
            pieces = [e for e in gen.entries if e.name == name]
            if len(pieces) == 1 and pieces[0].rows is None:
                out[name] = views[pieces[0].key]
                continue
            buffer = self._whole.get(name)
            if (
                buffer is None
                or tuple(buffer.shape) != pieces[0].shape
                or str(buffer.dtype) != f"torch.{pieces[0].dtype}"
            ):
                buffer = self._whole[name] = torch.empty(
                    pieces[0].shape, dtype=getattr(torch, pieces[0].dtype)
                )
            for e in pieces:
                e.part_of(buffer).copy_(views[e.key])
            out[name] = buffer
        return out

    def changed(self, gen: WeightGeneration) -> list[TensorEntry]:
        """The pieces of ``gen`` that differ from what this reader loaded last."""
        return [e for e in gen.entries if self.loaded.get(e.key) != e.checksum]

    def mark_loaded(self, gen: WeightGeneration) -> None:
        """Record that the destination now holds ``gen`` (after a load done with ``read``)."""
        self.loaded = {e.key: e.checksum for e in gen.entries}
        self.number = gen.number

    @staticmethod
    def first_difference(gen: WeightGeneration, tensors: Mapping[str, torch.Tensor]) -> str | None:
        """The name of the first tensor of ``gen`` whose bytes in ``tensors`` (whole tensors by
        name) are not what was published (by checksum), or None when all of them are."""
        return next(
            (
                e.name
                for e in gen.entries
                if e.name in tensors and checksum(e.part_of(tensors[e.name])) != e.checksum
            ),
            None,
        )

    @staticmethod
    def first_mismatch(
        pieces: Mapping[tuple[str, int], torch.Tensor], entries: list[TensorEntry]
    ) -> TensorEntry | None:
        """The first of ``entries`` whose piece (by key) is not what was published, by checksum."""
        return next((e for e in entries if checksum(pieces[e.key]) != e.checksum), None)

    @staticmethod
    def verify(
        pieces: Mapping[tuple[str, int], torch.Tensor], entries: list[TensorEntry], number: int
    ) -> None:
        """``WeightChecksumError`` naming the first of ``entries`` whose piece (by key) differs."""
        e = WeightReader.first_mismatch(pieces, entries)
        if e is not None:
            rows = "" if e.rows is None else f" rows {e.rows[0]}:{e.rows[1]}"
            raise WeightChecksumError(
                f"weight generation {number}: tensor {e.name!r} {e.shape}{rows} differs from what was "
                f"published (checksum {checksum(pieces[e.key]):#018x}, published {e.checksum:#018x}): "
                "corrupted on the way"
            )

    def close(self) -> None:
        for s in self._slots.values():
            s.close()
        self._slots = {}


def should_verify(verify: bool | str, entries: list[TensorEntry], on_gpu: bool) -> bool:
    """Whether a load of ``entries`` (into a GPU, ``on_gpu``) checks checksums (see ``load_into``)."""
    if verify == "auto":
        return on_gpu or sum(e.nbytes for e in entries) <= AUTO_VERIFY_BYTES
    if not isinstance(verify, bool):
        raise ValueError(f"verify must be True, False or 'auto', got {verify!r}")
    return verify


def _check_names(gen: WeightGeneration, destination: Mapping[str, tuple[int, ...]]) -> None:
    published = {e.name: e for e in gen.entries}
    missing = sorted(published.keys() - destination.keys())
    unknown = sorted(destination.keys() - published.keys())
    wrong = [
        f"{n} {e.shape}, expected {destination[n]}"
        for n, e in published.items()
        if n in destination and destination[n] != e.shape
    ]
    if missing or unknown or wrong:
        raise ValueError(
            f"weight generation {gen.number} does not fit: published but not here {missing[:8]}, "
            f"here but not published {unknown[:8]}, shapes {wrong[:8]}"
        )


def _read_newest(root: str) -> WeightGeneration | None:
    try:
        return WeightGeneration.from_json(Path(root, "newest.json").read_text())
    except FileNotFoundError:
        return None


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)
