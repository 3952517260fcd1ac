"""How the ``process`` backend starts a rank: forked from a warm template (the default), or spawned.

A fresh interpreter imports everything its class needs, every time: a second for torch, several
for an RL worker. A template (``template.py``) imports that once and forks ranks that
have it all already. The controller keeps one template per environment (the variables a rank
inherits and the interpreter), made when a group first needs it; before it forks a group's ranks
it imports what the group needs: the modules the worker class's pickle names (its own module, the
classes of its init arguments, the modules a class defined in a script uses), the group's
``preload``, and what earlier ranks of that template imported while they built their objects.

A template is replaced by a fresh one when a module it holds went stale (its source file changed,
or the controller now has that module from another file), and when it died (one warning). An
import that would make it unsafe to fork (it started a thread, it initialised CUDA) is not made
there again: ranks import that package themselves, after their fork.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import pickletools
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from spmdcall.backends.process.template import library_file, recv, send

logger = logging.getLogger("spmdcall")

START_METHODS = ("template", "spawn")
MAX_TEMPLATES = 4  # environments with a template at once


class RankProcess(Protocol):
    """The controller's handle on a rank's process, however it was started."""

    pid: int

    def alive(self) -> bool: ...

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: for ever) for the process to end; whether it has."""
        ...

    def kill(self) -> None: ...

    def exit_code(self) -> int | None:
        """How it ended, as ``Popen.returncode`` says it (minus a signal's number), once it has;
        None while it runs, or where that is no longer known."""
        ...

    def close(self) -> None: ...


class SpawnedProcess:
    """A rank started as a fresh interpreter: a child of this process."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float | None) -> bool:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        self.popen.kill()

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def close(self) -> None:
        pass


class ForkedProcess:
    """A rank forked by a template: a child of the template, watched here through a pidfd (which
    also makes signalling it safe from pid reuse); its exit code comes from the template."""

    def __init__(self, pid: int, pidfd: int, template: TemplateProcess):
        self.pid = pid
        self.template = template
        self._pidfd = pidfd
        self._code: int | None = None
        self._lock = threading.Lock()

    def alive(self) -> bool:
        return not self.wait(0)

    def wait(self, timeout: float | None) -> bool:
        with self._lock:
            pidfd = self._pidfd
        if pidfd < 0:
            return True
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)  # readable once the process has ended
        return bool(poller.poll(None if timeout is None else max(0.0, timeout) * 1000))

    def kill(self) -> None:
        with self._lock, contextlib.suppress(ProcessLookupError, OSError):
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def exit_code(self) -> int | None:
        if self._code is None and self.wait(0):
            self._code = self.template.status(self.pid)
        return self._code

    def close(self) -> None:
        with self._lock:
            if self._pidfd < 0:
                return
            os.close(self._pidfd)
            self._pidfd = -1
        self.template.release()


class TemplateDied(Exception):
    """The template did not answer: it has ended."""


class TemplateProcess:
    """One template, as the controller sees it: a process it spawned, or a successor another
    template forked (``grow``). Its requests are made one at a time (a lock)."""

    def __init__(
        self,
        env: dict[str, str],
        sock: socket.socket,
        pid: int,
        pidfd: int,
        popen: subprocess.Popen | None = None,
        parent: TemplateProcess | None = None,
    ):
        self.env, self.pid, self.popen = env, pid, popen
        self._sock = sock
        self._pidfd = pidfd
        self._lock = threading.Lock()
        # What it holds: modules asked for (imported or not), and the modules and source files of
        # the ones a user may edit (file -> mtime), its parent's included.
        self.asked: set[str] = set(parent.asked) if parent else set()
        self.user_modules: dict[str, str] = dict(parent.user_modules) if parent else {}
        self.files: dict[str, int] = dict(parent.files) if parent else {}
        self.retired = False  # forks no more; ends once its ranks have
        self._ranks = 0

    @classmethod
    def spawn(cls, env: dict[str, str], timeout: float | None) -> TemplateProcess:
        """A new template: a fresh interpreter of ``env`` that imports the worker runtime."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "spmdcall.backends.process.template",
                    str(os.getpid()),
                    str(theirs.fileno()),
                ],
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in the terminal goes to the controller only
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        template = cls(env, ours, popen.pid, os.pidfd_open(popen.pid), popen=popen)
        template._first_reply(timeout)
        return template

    def grow(self, modules: list[tuple[str, str | None]], timeout: float | None) -> TemplateProcess:
        """A successor of this template that holds ``modules`` too (``(name, file)`` as
        ``modules_of`` gives them), imported within ``timeout`` seconds (``TimeoutError``). Check
        its ``tainted``: if set, an import made it unfit to fork, and it has ended."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = {"modules": modules, "sys_path": list(sys.path), "cwd": os.getcwd()}
        try:
            with theirs:
                pid, fds = self._request(("grow", request), [theirs.fileno()])
        except BaseException:
            ours.close()
            raise
        successor = TemplateProcess(self.env, ours, pid, fds[0], parent=self)
        successor.asked.update(name for name, _ in modules)
        try:
            successor._first_reply(timeout)
        except TimeoutError:
            names = ", ".join(name for name, _ in modules[:5]) + (", ..." if len(modules) > 5 else "")
            raise TimeoutError(f"the process template did not import {names} within {timeout:g} s") from None
        return successor

    def _first_reply(self, timeout: float | None) -> None:
        """Read what a new template says once it is ready (or tainted)."""
        self.tainted: str | None = None  # why it forks no more
        self.culprits: list[str] = []  # the package whose import tainted it, and those it loaded first
        body, _ = self._request(None, timeout=timeout)
        self.user_modules.update(body["modules"])
        self.files.update(body["files"])
        if body.get("tainted") is not None:
            self.tainted, self.culprits = body["tainted"], body["culprits"]
            self.close()

    def _request(
        self, message: tuple | None, fds: Iterable[int] = (), timeout: float | None = None
    ) -> tuple[Any, list[int]]:
        """Send ``message`` (None: nothing, just read) and read the reply. Raises ``TimeoutError``
        after ``timeout`` seconds (the template is killed: it is stuck), ``TemplateDied`` if it
        has ended."""
        with self._lock:
            if self._sock.fileno() < 0:
                raise TemplateDied("the template was let go")
            self._sock.settimeout(timeout)
            try:
                if message is not None:
                    send(self._sock, message, list(fds))
                got = recv(self._sock)
            except TimeoutError:
                self._kill()
                self._sock.close()
                raise
            except OSError as exc:
                raise TemplateDied(str(exc)) from None
        if got is None:
            raise TemplateDied("its socket closed")
        (kind, body), got_fds = got
        if kind == "error":
            raise RuntimeError(f"the process template (pid {self.pid}) failed: {body}")
        return body, got_fds

    def stale(self, modules: list[tuple[str, str | None]]) -> str | None:
        """Why it may no longer serve a group needing ``modules``: a module it holds whose source
        changed, or that the controller now has from another file; None if it may."""
        for name, file in modules:
            held = self.user_modules.get(name)
            if held is not None and file is not None and held != file:
                return f"{name} now comes from {file}, not {held}"
        for path, mtime in self.files.items():
            try:
                if os.stat(path).st_mtime_ns != mtime:
                    return f"{path} changed"
            except OSError:
                return f"{path} is gone"
        return None

    def fork(self, env: dict[str, str], fds: list[int]) -> ForkedProcess:
        """A rank with ``env`` (what differs from the template's) on the descriptors ``fds`` (its call
        and report sockets), with this process's current standard streams and working directory."""
        with _standard_streams() as stdio:
            pid, got = self._request(("fork", {"env": env, "cwd": os.getcwd()}), [*stdio, *fds])
        with self._lock:
            self._ranks += 1
        return ForkedProcess(pid, got[0], self)

    def status(self, pid: int) -> int | None:
        try:
            body, _ = self._request(("status", [pid]))
        except (TemplateDied, RuntimeError):
            return None
        return body.get(pid)

    def exit_detail(self) -> str:
        """How it ended, as far as this process can tell."""
        code = self.popen.poll() if self.popen is not None else None
        if code is None:
            return "it closed its socket"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def release(self) -> None:
        """A rank it forked is gone from the controller's view."""
        with self._lock:
            self._ranks -= 1
            done = self.retired and self._ranks <= 0
        if done:
            self.close()

    def retire(self) -> None:
        """Fork no more; let it go once no rank it forked is left."""
        with self._lock:
            self.retired = True
            done = self._ranks <= 0
        if done:
            self.close()

    def close(self) -> None:
        """Let it go: it ends once its ranks have (at once if they have)."""
        with self._lock:
            self._sock.close()
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(0)  # reaped here if it has ended; else by subprocess, later

    def _kill(self) -> None:
        with contextlib.suppress(OSError):
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


@functools.cache
def _have_pidfds() -> bool:
    """Whether this OS has pidfds (Linux 5.3 or later), which templates need."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


@contextlib.contextmanager
def _standard_streams() -> Iterator[list[int]]:
    """This process's standard streams (``/dev/null`` for one that is closed), to hand on."""
    opened = []
    fds = []
    try:
        for fd in (0, 1, 2):
            try:
                os.fstat(fd)
            except OSError:
                fd = os.open(os.devnull, os.O_RDWR)
                opened.append(fd)
            fds.append(fd)
        yield fds
    finally:
        for fd in opened:
            os.close(fd)


class Templates:
    """The templates of this controller, one per environment (at most ``MAX_TEMPLATES``, the
    environment used least lately let go first). Safe to use from many threads: the starts of one
    environment's groups take turns to make its template ready, then fork at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: collections.OrderedDict[tuple, TemplateProcess] = collections.OrderedDict()
        self._turns: dict[tuple, threading.Lock] = {}
        self._learned: dict[tuple, dict[str, None]] = {}
        self._refused: set[str] = set()  # packages whose import makes a template unfit to fork

    def fork(
        self,
        env: dict[str, str],
        rank_env: dict[str, str],
        fds: list[int],
        modules: list[tuple[str, str | None]],
        timeout: float | None = None,
    ) -> ForkedProcess | None:
        """A rank with ``rank_env``, forked from the template of ``env`` once that holds ``modules``
        (imported within ``timeout`` seconds, else ``TimeoutError``). None: there is no template
        to be had; start the rank as a fresh interpreter."""
        if not _have_pidfds():
            return None
        key = tuple(sorted(env.items()))
        delta = {k: v for k, v in rank_env.items() if env.get(k) != v}
        for _ in range(3):
            try:
                with self._turn(key):
                    template = self._ready(key, env, modules, timeout)
                if template is None:
                    return None
                try:
                    return template.fork(delta, fds)
                except TemplateDied:
                    self._died(key, template)
            except RuntimeError as exc:  # the template answered with an error
                logger.warning("spmdcall: %s; this rank starts as a fresh interpreter", exc)
                return None
        return None

    def learn(self, env: dict[str, str], modules: list[str]) -> None:
        """Modules a rank of ``env``'s template imported while it built its object: the template
        holds them too from its next start of a rank on."""
        key = tuple(sorted(env.items()))
        with self._lock:
            self._learned.setdefault(key, {}).update(dict.fromkeys(modules))

    def _turn(self, key: tuple) -> threading.Lock:
        with self._lock:
            return self._turns.setdefault(key, threading.Lock())

    def _ready(
        self, key: tuple, env: dict[str, str], modules: list[tuple[str, str | None]], timeout: float | None
    ) -> TemplateProcess | None:
        """The template of ``key``, grown to hold ``modules`` and what its ranks imported (made,
        or made again when stale or dead), or None when none can be had."""
        with self._lock:
            template = self._current.get(key)
            if template is not None:
                self._current.move_to_end(key)
            learned = [(name, None) for name in self._learned.pop(key, {})]
        wanted = {name: file for name, file in [*modules, *learned]}
        for _ in range(3):
            if template is not None:
                why = template.stale(list(wanted.items()))
                if why is not None:
                    logger.info("spmdcall: a new process template: %s", why)
                    # What it held, the new one holds too (each module from its file of now).
                    wanted = {name: _file_of(name) for name in template.asked} | wanted
                    self._drop(key, template)
                    template = None
            if template is None:
                template = self._spawn(key, env, timeout)
                if template is None:
                    return None
            try:
                return self._grown(key, template, wanted, timeout)
            except TemplateDied:
                self._died(key, template)
                template = None
        return None

    def _grown(
        self, key: tuple, template: TemplateProcess, wanted: dict[str, str | None], timeout: float | None
    ) -> TemplateProcess:
        """``template``, or a successor that also holds what of ``wanted`` it does not (left out:
        the packages whose import makes a template unfit to fork)."""
        for _ in range(3):
            with self._lock:
                refused = set(self._refused)
            missing = [
                (name, file)
                for name, file in wanted.items()
                if name not in template.asked and name.partition(".")[0] not in refused
            ]
            if not missing:
                return template
            successor = template.grow(missing, timeout)
            if successor.tainted is None:
                with self._lock:
                    self._current[key] = successor
                template.retire()
                return successor
            logger.warning(
                "spmdcall: %s in the process template; ranks import what it loaded themselves, after their fork: %s",
                successor.tainted,
                _some(successor.culprits),
            )
            with self._lock:
                self._refused.update(successor.culprits)
        return template

    def _spawn(self, key: tuple, env: dict[str, str], timeout: float | None) -> TemplateProcess | None:
        try:
            template = TemplateProcess.spawn(env, timeout)
        except (OSError, TemplateDied) as exc:  # a stuck one (TimeoutError) fails the start instead
            if isinstance(exc, TimeoutError):
                raise
            logger.warning("spmdcall: no process template (%s); ranks start as fresh interpreters", exc)
            return None
        with self._lock:
            self._current[key] = template
            self._current.move_to_end(key)
            evicted = []
            while len(self._current) > MAX_TEMPLATES:  # the environment used least lately
                evicted.append(self._current.popitem(last=False)[1])
        for old in evicted:
            old.retire()
        return template

    def _died(self, key: tuple, template: TemplateProcess) -> None:
        logger.warning(
            "spmdcall: the process template (pid %d) has ended (%s); starting a new one",
            template.pid,
            template.exit_detail(),
        )
        self._drop(key, template)

    def _drop(self, key: tuple, template: TemplateProcess) -> None:
        with self._lock:
            if self._current.get(key) is template:
                del self._current[key]
        template.retire()


def modules_of(payload: bytes, also: Iterable[str] = ()) -> list[tuple[str, str | None]]:
    """The modules ``also`` names, then those a pickle names (its globals' modules, and the modules
    cloudpickle imports for a class or function pickled by value), each with its source file here
    if a user may edit it (else None): importing them first makes unpickling import nothing."""
    names: dict[str, None] = dict.fromkeys(also)
    memo: dict[int, Any] = {}
    recent: list[Any] = [None, None]  # the last two values pushed
    after_subimport = False
    for op, raw, _ in pickletools.genops(payload):
        arg: Any = raw
        if op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
            memo[len(memo) if op.name == "MEMOIZE" else arg] = recent[-1]
            continue
        if op.name in ("FRAME", "PROTO", "STOP"):
            continue
        value = None
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            value = arg
        elif op.name in ("GET", "BINGET", "LONG_BINGET"):
            value = memo.get(arg)
        if after_subimport:  # the argument of cloudpickle's subimport(name): a module it imports
            if isinstance(value, str):
                names[value] = None
            after_subimport = False
        if op.name in ("GLOBAL", "STACK_GLOBAL"):
            module, qualname = arg.split(" ", 1) if op.name == "GLOBAL" else recent
            if isinstance(module, str):
                names[module] = None
            value = _Global(qualname)
        if isinstance(value, _Global):  # pushed anew, or fetched from the memo
            after_subimport = value.qualname == "subimport"
        recent = [recent[-1], value]
    return [(name, _file_of(name)) for name in names if name not in ("__main__", "builtins")]


def _some(names: list[str], shown: int = 4) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


class _Global:
    """A global a pickle pushed (what ``modules_of`` remembers of it)."""

    __slots__ = ("qualname",)

    def __init__(self, qualname: Any):
        self.qualname = qualname


def _file_of(name: str) -> str | None:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if path is None or library_file(path):
        return None
    return os.path.realpath(path)
