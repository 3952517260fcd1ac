"""Event loops that read the ``process`` backend's replies themselves.

A future awaited from asyncio needs someone to read its reply. A thread could (the backend's
reader thread does, for callbacks added outside any loop), but then every reply crosses from that
thread to the loop: a wake-up of each, and a hand-over of the GIL. Instead, the loop that awaits
watches the workers' sockets (``loop.add_reader``) and reads the replies in its own steps.

The loop watches a duplicate of each socket's descriptor, which it alone closes. So ``restart``
and ``shutdown`` may close the sockets from any thread while a loop (in another thread, maybe not
even running) still watches them: the duplicate keeps the descriptor's number from being reused
under the loop's selector, and the loop stops watching at its next look (a worker that is gone
reads as end of file).

Reading stays one thread's job at a time (the backend's reader role): when another thread holds
the role, the loop leaves the reply to it, and looks at that socket again a millisecond later
instead of at every step (the socket stays readable until the reply is read). A reply that thread
read ahead but left unsettled is not signalled by the socket any more; the backend then pokes the
loops (``poke``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import weakref
from collections.abc import Callable

from spmdcall.backends.process.handles import WorkerHandle

# What ``read(h)`` found: it read what was there; another thread holds the reader role; ``h`` is no
# longer a live worker of the backend.
READ, BUSY, GONE = range(3)
# How long a loop leaves a socket alone while another thread reads it, in seconds.
_BUSY_PAUSE_S = 0.001


class _Watch:
    """What one loop watches: a duplicate descriptor per worker handle, and the backend's
    generation of handles it has them all for."""

    __slots__ = ("fds", "generation")

    def __init__(self) -> None:
        self.fds: dict[WorkerHandle, int] = {}
        self.generation = -1


class LoopReaders:
    """The event loops that read one backend's replies. ``read(h)`` reads the replies of ``h``
    that are there, when no other thread is reading, and says what it found (``READ``, ``BUSY``,
    ``GONE``); it runs on the loop.

    ``watch`` runs on the loop it names; ``poke`` and ``close`` from any thread."""

    def __init__(self, read: Callable[[WorkerHandle], int]):
        self._read = read
        self._watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Watch] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self.watching = False  # whether any loop has watched (a plain flag: read on every reply's path)

    def watch(self, loop: asyncio.AbstractEventLoop, handles: list[WorkerHandle], generation: int) -> None:
        """Have ``loop`` (the running one) read the replies of ``handles`` (the backend's
        ``generation`` of them; a restart makes the next one)."""
        watch = self._watches.get(loop)
        if watch is not None and watch.generation == generation:
            return
        if watch is None:
            with self._lock:
                for old, old_watch in list(self._watches.items()):
                    if old.is_closed():  # e.g. asyncio.run's loop of an earlier run: its selector is gone
                        del self._watches[old]
                        _close_all(old_watch.fds)
                watch = self._watches.setdefault(loop, _Watch())
                self.watching = True
            weakref.finalize(loop, _close_all, watch.fds)  # a loop dropped unclosed lets them go too
        complete = True
        for h in handles:
            if h in watch.fds:
                continue
            if h.died is not None or not h.ready.is_set():
                complete = False  # dead, or coming back from a restart: looked at again next time
                continue
            fd = os.dup(h.channel.fileno())
            watch.fds[h] = fd
            loop.add_reader(fd, self._on_readable, loop, watch, h)
        if complete:
            watch.generation = generation

    def _on_readable(self, loop: asyncio.AbstractEventLoop, watch: _Watch, h: WorkerHandle) -> None:
        found = self._read(h)
        if found == GONE:
            _unwatch(loop, watch, h)
        elif found == BUSY and h in watch.fds:
            loop.remove_reader(watch.fds[h])
            loop.call_later(_BUSY_PAUSE_S, self._rewatch, loop, watch, h)

    def _rewatch(self, loop: asyncio.AbstractEventLoop, watch: _Watch, h: WorkerHandle) -> None:
        fd = watch.fds.get(h)
        if fd is not None:
            loop.add_reader(fd, self._on_readable, loop, watch, h)

    def poke(self) -> None:
        """Have every watching loop look at every socket once more, readable or not: another
        thread read replies ahead and left them buffered, which the sockets no longer signal."""
        for loop, watch in list(self._watches.items()):
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits there any more
                loop.call_soon_threadsafe(self._read_all, loop, watch)

    def _read_all(self, loop: asyncio.AbstractEventLoop, watch: _Watch) -> None:
        for h in list(watch.fds):
            self._on_readable(loop, watch, h)

    def close(self) -> None:
        """Stop every loop watching (the backend shuts down)."""
        with self._lock:
            watches = list(self._watches.items())
            self._watches.clear()
        for loop, watch in watches:
            if loop.is_closed():
                _close_all(watch.fds)
            elif not loop.is_running() or running_loop() is loop:
                _unwatch_all(loop, watch)
            else:
                try:
                    loop.call_soon_threadsafe(_unwatch_all, loop, watch)
                except RuntimeError:  # closed in the meantime: its selector is gone already
                    _close_all(watch.fds)


def _unwatch(loop: asyncio.AbstractEventLoop, watch: _Watch, h: WorkerHandle) -> None:
    fd = watch.fds.pop(h, None)
    if fd is not None:
        with contextlib.suppress(Exception):  # the loop may be closing
            loop.remove_reader(fd)
        os.close(fd)


def _unwatch_all(loop: asyncio.AbstractEventLoop, watch: _Watch) -> None:
    for h in list(watch.fds):
        _unwatch(loop, watch, h)


def _close_all(fds: dict[WorkerHandle, int]) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.popitem()[1])


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or None."""
    return asyncio._get_running_loop()  # get_running_loop() without raising: on every call's path


# Flushes of the calls that process backends hold back until an event loop's step ends. A wait on
# any process group runs them first: the call it waits for may need one of them to run (a call of
# another group, through a collective). Only the process backend uses them.
_held_flushes: set[weakref.WeakMethod] = set()
_held_lock = threading.Lock()


def hold_back(flush: Callable[[], None]) -> None:
    """Register the bound method ``flush`` to run at the next :func:`send_held` (its owner may
    also run it earlier, and may be collected before: then it is skipped)."""
    with _held_lock:
        _held_flushes.add(weakref.WeakMethod(flush))


def send_held() -> None:
    """Run every registered flush: before a thread blocks on a call's result."""
    if not _held_flushes:
        return
    with _held_lock:
        flushes = list(_held_flushes)
        _held_flushes.clear()
    for ref in flushes:
        flush = ref()
        if flush is not None:
            flush()


def read_for_callbacks(backend_ref: weakref.ref) -> None:
    """The backend's reader thread: reads replies while calls are pending, for the futures that
    asyncio awaits without a thread of their own. It holds the backend only while there is work,
    so a group dropped without shutdown() is still collected."""
    while True:
        backend = backend_ref()
        if backend is None or backend.stopping:
            return
        wanted = backend.reader_wanted
        del backend
        if not wanted.wait(timeout=1.0):
            continue
        wanted.clear()
        backend = backend_ref()
        if backend is None:
            return
        try:
            backend.read_while_pending()
        except (OSError, ValueError):
            if not backend.stopping:
                raise
        del backend
