"""Shared-memory segments a process sends from: anonymous ``memfd`` files, leased and reused.

A segment is reused once every receiver of the message it carried has let go of it, so its pages
are already in memory the next time (no page faults). Nothing is ever named in ``/dev/shm``: the
kernel frees a segment when its last descriptor and mapping go away, so a crash cannot leak one.
Free segments also lend their memory to values of this process (``SegmentPool.lend_out``): a
collected result joined into pages that are already there.
"""

from __future__ import annotations

import collections
import itertools
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

MIN_SEGMENT = 1 << 20  # smaller payloads share a segment of this size
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault every page in with one call


@dataclass
class Segment:
    id: int
    fd: int
    size: int
    mm: mmap.mmap
    holders: int = 0


class SegmentPool:
    """The shared-memory segments this process sends from; a segment is reused once every receiver
    of the message it carried has let go of it. Free segments beyond ``max_free_bytes`` are closed."""

    def __init__(self, max_free_bytes: int = 1 << 30):
        self.max_free_bytes = max_free_bytes
        self._segments: dict[int, Segment] = {}
        self._free: collections.OrderedDict[int, Segment] = collections.OrderedDict()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def acquire(self, size: int, holders: int) -> Segment:
        with self._lock:
            # the smallest free segment that fits without wasting more than half of it: a small
            # payload in a big segment leaves a big one to be made anew (page faults and all)
            fits = [s for s in self._free.values() if size <= s.size <= 2 * max(size, MIN_SEGMENT)]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                del self._free[seg.id]
                seg.holders = holders
                return seg
        seg = self._create(max(size, MIN_SEGMENT))
        seg.holders = holders
        with self._lock:
            self._segments[seg.id] = seg
        return seg

    def _create(self, size: int) -> Segment:
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        fd = os.memfd_create("spmdcall", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        try:
            mm.madvise(_MADV_POPULATE_WRITE)  # one syscall instead of a page fault per page
        except (OSError, ValueError):
            pass
        return Segment(next(self._ids), fd, size, mm)

    def borrow(self, seg_id: int, offset: int, size: int) -> np.ndarray:
        """A view of ``size`` bytes of one of our own segments that a peer handed back by reference.
        The segment is not reused while the view (or anything built on it) is alive."""
        with self._lock:
            seg = self._segments.get(seg_id)
            if seg is None or seg.holders <= 0 or offset + size > seg.size:
                raise ConnectionError(f"peer handed back bytes of segment {seg_id} that it does not hold")
            seg.holders += 1
        view = np.frombuffer(seg.mm, dtype=np.uint8, count=size, offset=offset)
        weakref.finalize(view, self.release, seg_id)
        return view

    def lend_out(self, size: int) -> np.ndarray | None:
        """``size`` bytes of a free segment for a value of this process (a collected result): its
        pages are in memory already, where new memory would fault every page in on first write.
        The segment comes back when the array (or anything built on it) is gone. None for less
        than a segment's minimum size, which new memory serves as well."""
        if size < MIN_SEGMENT:
            return None
        seg = self.acquire(size, 1)
        view = np.frombuffer(seg.mm, dtype=np.uint8, count=size)
        weakref.finalize(view, self.release, seg.id)
        return view

    def release(self, seg_id: int, count: int = 1) -> None:
        with self._lock:
            seg = self._segments.get(seg_id)
            if seg is None:
                return
            seg.holders -= count
            if seg.holders > 0:
                return
            self._free[seg_id] = seg
            self._free.move_to_end(seg_id)
            free_bytes = sum(s.size for s in self._free.values())
            while free_bytes > self.max_free_bytes and self._free:
                _, old = self._free.popitem(last=False)
                free_bytes -= old.size
                self._close(old)

    def _close(self, seg: Segment) -> None:
        del self._segments[seg.id]
        seg.mm.close()
        os.close(seg.fd)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "segments": len(self._segments),
                "free": len(self._free),
                "bytes": sum(s.size for s in self._segments.values()),
            }


_pool = SegmentPool()


def pool() -> SegmentPool:
    """This process's segment pool (shared by all its channels: a broadcast goes over several)."""
    return _pool


def lend_out(nbytes: int) -> Any:
    """Memory of ``nbytes`` from a free segment of this process's pool (pages already in memory),
    or None: what a backend whose replies arrive in segments offers for collected results."""
    return pool().lend_out(nbytes)
