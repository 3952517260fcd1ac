"""A template of the ``process`` backend: ``python -m spmdcall.backends.process.template PID FD``.

A template is a process that has imported the worker runtime, and then whatever modules its
controller asks for (the worker classes' modules, the group's ``preload``, what earlier ranks
imported while they built their objects), and that forks ranks on request: a rank starts with all
of that imported already, a ``fork`` instead of an interpreter that imports everything again.
The controller keeps one template per environment (``start.py``).

What must not cross a fork never does. A template runs one thread and computes nothing, and it
never imports anything itself once it serves: to import more it forks a *successor*, which
imports the modules and then serves in its place. An import that starts a thread or initialises
CUDA *taints* the successor: it says which module did and ends, and the template it was forked
from goes on as it was (ranks import that module themselves, after their fork). Each rank takes on
its own environment (SPMD variables, thread counts, working directory, standard streams, a session
of its own) in the child, before any of its code runs.

Requests come on a Unix stream socket, one pickled message each (a 4-byte length first), with
file descriptors attached; each gets one reply (or ``("error", why)``):

- ``("fork", {"env": ..., "cwd": ...})`` with stdin, stdout, stderr, the rank's call and report
  sockets -> ``("forked", pid)``, with a pidfd of the rank;
- ``("grow", {"modules": [(name, file)], "sys_path": [...], "cwd": ...})`` with the successor's
  socket -> ``("grown", pid)``, with a pidfd of the successor, which says on its own socket
  ``("preloaded", {"tainted": None or why, "culprits": [packages], "modules": {name: file},
  "files": {file: mtime_ns}})``: the modules it imported, beyond its parent's, that do not come
  from an installed library, with their source files (a module whose file changed makes it stale);
- ``("status", [pid, ...])`` -> ``("status", {pid: exit code, or None while it runs})``: ranks are
  this process's children, so only it can read how they ended.

A template's first message, unasked, is ``("ready", {"modules": ..., "files": ...})``. It ends with
its controller (it waits on a pidfd of it), or once the controller has closed its socket and the
ranks it forked have all ended.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import importlib
import importlib.util
import os
import pickle
import select
import signal
import socket
import struct
import sys
import sysconfig
import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from spmdcall.backends.process import worker as process_worker

_LENGTH = struct.Struct("!I")
_MAX_FDS = 8
_ENDED_KEPT = 4096  # exit codes kept for the controller to ask for


def send(sock: socket.socket, message: Any, fds: list[int] = ()) -> None:  # type: ignore[assignment]
    """Send one message (and ``fds``) on a stream socket."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    data = _LENGTH.pack(len(data)) + data
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """The next message and the descriptors that came with it; None at end of stream."""
    head, fds, _, _ = socket.recv_fds(sock, _LENGTH.size, _MAX_FDS)
    if not head:
        return None
    while len(head) < _LENGTH.size:
        more = sock.recv(_LENGTH.size - len(head))
        if not more:
            return None
        head += more
    (size,) = _LENGTH.unpack(head)
    body = bytearray()
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return pickle.loads(body), fds


_LIBRARY_DIRS = tuple(
    os.path.join(os.path.realpath(path), "")
    for path in {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    if path
)


def library_file(path: str | None) -> bool:
    """Whether ``path`` belongs to an installed library or the standard library (not to code a
    user edits: a script's folder, an editable install's sources)."""
    return path is not None and os.path.realpath(path).startswith(_LIBRARY_DIRS)


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


class Template:
    """The template's state and its loop (see the module docstring)."""

    def __init__(self, sock: socket.socket, controller: int):
        self.sock: socket.socket | None = sock
        self.controller = controller  # a pidfd of the controller, inherited by every rank
        self.children: set[int] = set()
        self.ended: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.reported: set[str] = set()  # user modules whose files the controller was told of
        self.wake_r, self.wake_w = -1, -1
        self._wake_on_sigchld()

    def _wake_on_sigchld(self) -> None:
        """SIGCHLD wakes the loop, through a pipe of this process's own, to reap ranks that ended."""
        for fd in (self.wake_r, self.wake_w):
            if fd >= 0:
                os.close(fd)
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    def serve(self) -> None:
        while self.sock is not None or self.children:
            poller = select.poll()
            for fd in [self.controller, self.wake_r] + (
                [self.sock.fileno()] if self.sock is not None else []
            ):
                poller.register(fd, select.POLLIN)
            ready = {fd for fd, _ in poller.poll()}
            if self.controller in ready:
                os._exit(0)  # the controller ended: so do its templates (its ranks watch it too)
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.wake_r, 4096):
                        pass
            self.reap()
            if self.sock is not None and self.sock.fileno() in ready:
                self.answer()

    def answer(self) -> None:
        assert self.sock is not None
        try:
            message = recv(self.sock)
        except OSError:
            message = None
        if message is None:  # the controller let go of this template: end once the ranks have
            self.sock.close()
            self.sock = None
            return
        (kind, body), fds = message
        reply_fds: list[int] = []
        try:
            if kind == "fork":
                pid = self.fork(fds, lambda: self.become_rank(body, fds))
                self.children.add(pid)
                reply: tuple = ("forked", pid)
            elif kind == "grow":
                pid = self.fork(fds, lambda: self.become_successor(body, fds[0]))
                reply = ("grown", pid)
            elif kind == "status":
                self.reap()
                reply = ("status", {pid: self.ended.get(pid) for pid in body})
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}")
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if reply[0] in ("forked", "grown"):
            reply_fds = [os.pidfd_open(reply[1])]
        try:
            send(self.sock, reply, reply_fds)
        finally:
            for fd in reply_fds:
                os.close(fd)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.ended[pid] = os.waitstatus_to_exitcode(status)
            while len(self.ended) > _ENDED_KEPT:
                self.ended.popitem(last=False)

    def fork(self, fds: list[int], child: Callable[[], None]) -> int:
        """Fork a child that runs ``child`` (and never comes back here); the parent lets go of
        ``fds``, which were the child's. A rank is one of ``children`` (the template outlives
        them); a successor is not (it serves in the template's place)."""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                child()
            except (BrokenPipeError, ConnectionError):
                pass  # the controller is gone (the successor had nobody to answer)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)
        return pid

    def become_rank(self, request: dict, fds: list[int]) -> None:
        """In a forked child: drop the template's descriptors and signal handling, take on the
        rank's environment, then be the rank (never returns)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(self.wake_r)
        os.close(self.wake_w)
        if self.sock is not None:
            self.sock.close()
        os.setsid()  # a session of its own: Ctrl-C in a terminal reaches the controller only
        *stdio, calls, reports = fds
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
            os.close(fd)
        with contextlib.suppress(OSError):  # a folder removed since: the rank stays in the template's
            os.chdir(request["cwd"])
        _take_environment(request["env"])
        modules_before = set(sys.modules)
        process_worker.run(calls, reports, self.controller, lambda: _learned(modules_before))

    def become_successor(self, request: dict, fd: int) -> None:
        """In a forked child: be a template of its own on the socket ``fd``, once it has imported
        ``request["modules"]``; or, if an import taints it, say so and end (the template it was
        forked from goes on as it was)."""
        if self.sock is not None:
            self.sock.close()
        self.sock = socket.socket(fileno=fd)
        self.children.clear()
        self.ended.clear()
        self._wake_on_sigchld()  # the pipe it inherited is its parent's
        reply = self.preload(**request)
        send(self.sock, ("preloaded", reply))
        if reply["tainted"] is None:
            self.serve()

    def preload(self, modules: list[tuple[str, str | None]], sys_path: list[str], cwd: str) -> dict:
        """Import ``modules`` in turn (``(name, file)``: skipped unless the name leads to that
        file here too), stopping at the first that taints this process."""
        with contextlib.suppress(OSError):
            os.chdir(cwd)
        sys.path[:0] = [p for p in sys_path if p not in sys.path]
        for name, file in modules:
            if name in sys.modules or not _same_module(name, file):
                continue
            threads, before = _native_threads(), set(sys.modules)
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: S110 - a rank that needs it fails with its own clear error
                continue
            why = _taint(threads)
            if why is not None:
                # The thread may come from any package this import loaded first: all are suspects.
                suspects = {n.partition(".")[0] for n in sys.modules if n not in before}
                culprits = [name.partition(".")[0], *sorted(suspects - {name.partition(".")[0]})]
                return {
                    "tainted": f"importing {name} {why}",
                    "culprits": culprits,
                    "files": {},
                    "modules": {},
                }
        gc.freeze()  # what the ranks inherit is never collected, so never copied on write by the GC
        return {"tainted": None, "culprits": [], **self.new_user_modules()}

    def new_user_modules(self) -> dict[str, dict]:
        """The modules imported since the last call that a user may edit (not from an installed
        library): ``{"modules": {name: file}, "files": {file: mtime_ns}}``."""
        modules, files = {}, {}
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if path is None or name in self.reported or library_file(path):
                continue
            self.reported.add(name)
            path = os.path.realpath(path)
            modules[name] = path
            with contextlib.suppress(OSError):
                files[path] = os.stat(path).st_mtime_ns
        return {"modules": modules, "files": files}


def _same_module(name: str, file: str | None) -> bool:
    """Whether importing ``name`` here loads ``file`` (None: any file will do)."""
    if file is None:
        return True
    try:
        spec = importlib.util.find_spec(name)
    except BaseException:  # noqa: S110 - its parent package fails to import: then so would it
        return False
    return spec is not None and spec.origin is not None and os.path.realpath(spec.origin) == file


def _taint(threads_before: int) -> str | None:
    """What an import just did that must not cross a fork, if anything."""
    if threading.active_count() > 1:
        names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        return f"started a thread ({', '.join(names)})"
    if _native_threads() > threads_before:
        return "started a native thread"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "initialised CUDA"
    return None


def _take_environment(changes: dict[str, str]) -> None:
    """Set the rank's own variables (where its environment differs from the template's), and apply
    what libraries loaded already read when they loaded: OpenMP's thread count, through torch
    (libgomp read it in the template)."""
    os.environ.update(changes)
    torch = sys.modules.get("torch")
    threads = changes.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    if "numpy.random" in sys.modules:  # each rank its own unseeded stream, as a fresh interpreter has
        sys.modules["numpy.random"].seed()


def _learned(before: set[str]) -> list[str]:
    """Library modules this rank imported since its fork, in the order they were imported."""
    return [
        name
        for name, module in list(sys.modules.items())
        if name not in before and library_file(getattr(module, "__file__", None))
    ]


def main(controller_pid: int, fd: int) -> None:
    process_worker.set_title("spmdcall template")
    # 3.12+ warns at every fork of a process with more than one thread: a template has one, plus
    # the idle pool of a BLAS library numpy loaded, which handles forks itself.
    warnings.filterwarnings(
        "ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning
    )
    controller = process_worker.controller_pidfd(controller_pid)
    if controller is None:
        raise SystemExit("a template needs pidfds (Linux 5.3 or later)")
    template = Template(socket.socket(fileno=fd), controller)
    assert template.sock is not None
    send(template.sock, ("ready", template.new_user_modules()))
    template.serve()


if __name__ == "__main__":
    try:
        main(int(sys.argv[1]), int(sys.argv[2]))
    finally:
        os._exit(0)  # no interpreter teardown: a template's modules may not expect one (gc.freeze)
