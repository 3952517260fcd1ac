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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
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


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a slot, and its checksum."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: int


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
    written: int = 0  # bytes the publisher wrote (the rest the slot held already)
    seconds: float = 0.0  # the publication's time, checksums included
    meta: dict[str, Any] = field(default_factory=dict)  # the publisher's, JSON-able (e.g. a canary)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def to_json(self) -> str:
        d = {
            k: getattr(self, k)
            for k in ("root", "host", "number", "version", "slot", "written", "seconds", "meta")
        }
        return json.dumps(d | {"entries": [e.__dict__ for e in self.entries]})

    @classmethod
    def from_json(cls, text: str) -> WeightGeneration:
        d = json.loads(text)
        entries = tuple(TensorEntry(**(e | {"shape": tuple(e["shape"])})) for e in d.pop("entries"))
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


class _Slot:
    """One slot's file, mapped; grown (and mapped again) when a generation needs more room."""

    def __init__(self, root: str, index: int, writable: bool):
        self.index = index
        self.path = os.path.join(root, f"slot-{index}.bin")
        self.manifest = os.path.join(root, f"slot-{index}.json")
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

    @contextlib.contextmanager
    def locked(self, exclusive: bool) -> Iterator[None]:
        fcntl.flock(self.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def generation(self) -> WeightGeneration | None:
        try:
            return WeightGeneration.from_json(Path(self.manifest).read_text())
        except FileNotFoundError:
            return None

    def view(self, e: TensorEntry) -> torch.Tensor:
        """``e``'s tensor in the slot; a reader's view is of read-only pages (writing it faults)."""
        mm = self.map()
        dtype = getattr(torch, e.dtype)
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=dtype)
        with warnings.catch_warnings():  # "not writable": a reader's map is read-only on purpose
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mm, dtype=dtype, count=e.nbytes // dtype.itemsize, offset=e.offset)
        return flat.view(e.shape)

    def close(self) -> None:
        if self.mm is not None:
            with contextlib.suppress(BufferError):
                self.mm.close()
        os.close(self.fd)


class WeightPublisher:
    """The publishing side (one rank): ``publish(tensors, version)`` writes a new generation.

    Safe from one thread at a time (a rank publishes between its training steps)."""

    def __init__(self, root: str):
        if not os.path.isdir(root):
            raise FileNotFoundError(f"no weight store at {root!r}: make one with sc.WeightStore() first")
        self.root = root
        self._slots = [_Slot(root, i, writable=True) for i in range(NUM_SLOTS)]
        newest = _read_newest(root)
        self._number = newest.number if newest is not None else 0

    def publish(
        self, tensors: Mapping[str, torch.Tensor], version: int, meta: Mapping[str, Any] | None = None
    ) -> WeightGeneration:
        """Write ``tensors`` as the next generation and return its metadata (small: send it to readers).

        Only tensors whose bytes differ from what the slot holds are written (delta). ``meta``
        (JSON-able) travels with the generation, e.g. what a reader checks after loading."""
        if not tensors:
            raise ValueError("publish() needs at least one tensor")
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"publish() takes name -> tensor; {name!r} is a {type(t).__name__}")
        start = time.perf_counter()
        number = self._number + 1
        slot = self._slots[number % NUM_SLOTS]
        sums = {name: checksum(t) for name, t in tensors.items()}
        entries, offset = [], 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            dtype = str(t.dtype).removeprefix("torch.")
            entries.append(TensorEntry(name, dtype, tuple(t.shape), offset, nbytes, sums[name]))
            offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        with slot.locked(exclusive=True):
            held = slot.generation()
            same_layout = held is not None and [
                (e.name, e.dtype, e.shape, e.offset) for e in held.entries
            ] == [(e.name, e.dtype, e.shape, e.offset) for e in entries]
            had = {e.name: e.checksum for e in held.entries} if same_layout and held else {}
            slot.map(max(offset, 1))
            stale = [e for e in entries if had.get(e.name) != e.checksum and e.nbytes]
            with torch.no_grad():
                for e in stale:
                    slot.view(e).copy_(tensors[e.name].detach().reshape(e.shape))
            gen = WeightGeneration(
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
            _write_atomically(slot.manifest, gen.to_json())
        _write_atomically(os.path.join(self.root, "newest.json"), gen.to_json())
        self._number = number
        return gen

    def close(self) -> None:
        for s in self._slots:
            s.close()


class WeightReader:
    """The reading side (each reader rank): maps the store's slots once and loads generations.

    Keeps what it loaded last, by tensor checksum, so the next load copies only what changed."""

    def __init__(self, root: str):
        self.root = root
        self._slots: list[_Slot] | None = None
        self.loaded: dict[str, int] = {}  # name -> checksum of what the destination holds
        self.number = 0

    def _slot(self, index: int) -> _Slot:
        if self._slots is None:
            if not os.path.isdir(self.root):
                raise FileNotFoundError(f"no weight store at {self.root!r} (was it closed?)")
            self._slots = [_Slot(self.root, i, writable=False) for i in range(NUM_SLOTS)]
        return self._slots[index]

    def newest(self) -> WeightGeneration | None:
        """The newest complete generation, or None before the first publication."""
        return _read_newest(self.root)

    @contextlib.contextmanager
    def read(self, at_least: int = 0) -> Iterator[tuple[WeightGeneration, dict[str, torch.Tensor]]]:
        """The newest complete generation numbered ``at_least`` or more, and read-only views of its
        tensors in the slot, valid while the block runs (the slot is locked against the publisher)."""
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
        slot = self._slot(newest.slot)
        with slot.locked(exclusive=False):
            gen = slot.generation()  # the slot may hold a newer generation than `newest` said
            assert gen is not None and gen.number >= newest.number, (gen, newest)
            views = {e.name: slot.view(e) for e in gen.entries}
            try:
                yield gen, views
            finally:
                del views

    def load_into(
        self, destination: Mapping[str, torch.Tensor], at_least: int = 0, verify: bool | str = "auto"
    ) -> LoadStats:
        """Copy the newest generation numbered ``at_least`` or more into ``destination`` (name ->
        tensor, in place), only the tensors that differ from what was loaded last; with ``verify``,
        check each copied tensor's checksum (``WeightChecksumError`` names the first that differs).
        ``"auto"`` checks where it costs little beside the copy: a destination on a GPU (the
        checksum runs at the GPU's memory speed), or at most ``AUTO_VERIFY_BYTES`` to copy."""
        start = time.perf_counter()
        with self.read(at_least) as (gen, views):
            _check_names(gen, destination)
            changed = [e for e in gen.entries if self.loaded.get(e.name) != e.checksum]
            with torch.no_grad():
                if changed:
                    torch._foreach_copy_(
                        [destination[e.name] for e in changed], [views[e.name] for e in changed]
                    )
            verify = should_verify(verify, changed, any(t.device.type != "cpu" for t in destination.values()))
            if verify:
                self.verify(destination, changed, gen.number)
        self.loaded = {e.name: e.checksum for e in gen.entries}
        self.number = gen.number
        moved = sum(e.nbytes for e in changed)
        seconds = time.perf_counter() - start
        return LoadStats(gen.number, gen.version, moved, moved / max(gen.nbytes, 1), seconds, verify, gen)

    def changed(self, gen: WeightGeneration) -> list[TensorEntry]:
        """The entries of ``gen`` that differ from what this reader loaded last."""
        return [e for e in gen.entries if self.loaded.get(e.name) != e.checksum]

    def mark_loaded(self, gen: WeightGeneration) -> None:
        """Record that the destination now holds ``gen`` (after a load done with ``read``)."""
        self.loaded = {e.name: e.checksum for e in gen.entries}
        self.number = gen.number

    @staticmethod
    def first_difference(gen: WeightGeneration, tensors: Mapping[str, torch.Tensor]) -> str | None:
        """The name of the first tensor of ``gen`` whose bytes in ``tensors`` are not what was
        published (by checksum), or None when all of them are."""
        return next(
            (e.name for e in gen.entries if e.name in tensors and checksum(tensors[e.name]) != e.checksum),
            None,
        )

    @staticmethod
    def verify(tensors: Mapping[str, torch.Tensor], entries: list[TensorEntry], number: int) -> None:
        """``WeightChecksumError`` naming the first of ``entries`` whose tensor's checksum differs."""
        for e in entries:
            got = checksum(tensors[e.name])
            if got != e.checksum:
                raise WeightChecksumError(
                    f"weight generation {number}: tensor {e.name!r} {e.shape} differs from what was "
                    f"published (checksum {got:#018x}, published {e.checksum:#018x}): corrupted on the way"
                )

    def close(self) -> None:
        for s in self._slots or ():
            s.close()
        self._slots = None


def should_verify(verify: bool | str, entries: list[TensorEntry], on_gpu: bool) -> bool:
    """Whether a load of ``entries`` (into a GPU, ``on_gpu``) checks checksums (see ``load_into``)."""
    if verify == "auto":
        return on_gpu or sum(e.nbytes for e in entries) <= AUTO_VERIFY_BYTES
    if not isinstance(verify, bool):
        raise ValueError(f"verify must be True, False or 'auto', got {verify!r}")
    return verify


def _check_names(gen: WeightGeneration, destination: Mapping[str, torch.Tensor]) -> None:
    published = {e.name: e for e in gen.entries}
    missing = sorted(published.keys() - destination.keys())
    unknown = sorted(destination.keys() - published.keys())
    wrong = [
        f"{n} {e.shape}, expected {tuple(destination[n].shape)}"
        for n, e in published.items()
        if n in destination and tuple(destination[n].shape) != e.shape
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
