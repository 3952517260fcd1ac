"""The exceptions a controller sees when something goes wrong in a worker group, and the error
that names the extra to install when a feature's optional package is missing."""

from __future__ import annotations

import re
import sys
import traceback
from dataclasses import dataclass, field

# A frame of a formatted stack: its file, line, function and source line.
_FRAME = re.compile(r'^  File "([^"]+)", line (\d+), in (\S+)\n    (.*)$', re.MULTILINE)
# Frames of these are the library's or the interpreter's, not the user's code.
_LIBRARY_PATHS = ("/spmdcall/", "/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ")


@dataclass(frozen=True)
class RankReport:
    """Where one rank is: what it runs, and the stack of each of its threads.

    ``calls`` are the calls the rank is running, oldest first, each ``(method, age_s)``: seconds
    since the rank started it. ``threads`` maps each thread's name to its Python stack, formatted
    as in a traceback (innermost frame last); an ``async def`` call in progress also shows as
    ``"task <method>"`` with the coroutine's stack. ``note`` says why ``threads`` is empty or
    partial (the rank did not answer in time, is dead, or the backend reports no stacks).

    Example:
        >>> r = RankReport(rank=1, calls=[("hang", 2.5)], threads={"MainThread": "  File ..."})
        >>> r.calls[0]
        ('hang', 2.5)
    """

    rank: int
    calls: list[tuple[str, float]] = field(default_factory=list)
    threads: dict[str, str] = field(default_factory=dict)
    pid: int | None = None
    note: str = ""

    def place(self) -> str:
        """Where the rank is, in one line: the innermost frame of user code in the first thread
        that has one (the main thread first), and whether that thread waits in a torch.distributed
        collective. Empty when the report has no stacks.

        Example:
            >>> stack = '  File "/w/train.py", line 9, in step' + chr(10) + "    time.sleep(60)"
            >>> RankReport(0, [("step", 2.0)], {"MainThread": stack}).place()
            'step() at /w/train.py:9: time.sleep(60)'
        """
        names = sorted(self.threads, key=lambda n: (n != "MainThread", not n.startswith("task "), n))
        for name in names:
            frames = _FRAME.findall(self.threads[name])
            user = [f for f in frames if not any(part in f[0] for part in _LIBRARY_PATHS)]
            if user:
                path, line, func, code = user[-1]
                collective = any("torch/distributed/" in f[0] for f in frames)
                where = f"{func}() at {path}:{line}: {code.strip()}"
                return where + (" — waiting in a torch.distributed collective" if collective else "")
        frames = _FRAME.findall(self.threads[names[0]]) if names else []
        if not frames:
            return ""
        path, line, func, code = frames[-1]  # only library frames: the innermost one
        return f"{func}() at {path}:{line}: {code.strip()}"

    def format(self, max_lines_per_thread: int = 12, max_threads: int = 8) -> str:
        """The report as text: the calls, then each thread's innermost ``max_lines_per_thread``
        lines (the main thread first), at most ``max_threads`` threads.

        Example:
            >>> print(RankReport(0, [("hang", 1.0)], note="did not answer").format())
            rank 0: running hang() for 1.0 s — did not answer
        """
        calls = ", ".join(f"{m}() for {age:.1f} s" for m, age in self.calls) or "no call"
        head = f"rank {self.rank}" + (f" (pid {self.pid})" if self.pid else "") + f": running {calls}"
        lines = [head + (f" — {self.note}" if self.note else "")]
        names = sorted(self.threads, key=lambda n: (n != "MainThread", not n.startswith("task "), n))
        for name in names[:max_threads]:
            stack = self.threads[name].rstrip("\n").splitlines()
            cut = len(stack) - max_lines_per_thread
            lines.append(f"  thread {name!r}:" + (f" ({cut} lines above left out)" if cut > 0 else ""))
            lines.extend("  " + line for line in stack[max(0, cut) :])
        if len(names) > max_threads:
            lines.append(f"  ... {len(names) - max_threads} more threads (in .reports)")
        return "\n".join(lines)


class SpmdError(Exception):
    """Base class of every spmdcall error."""


class WorkerError(SpmdError):
    """A worker method raised. Carries the rank, the method name and the remote traceback.

    The group stays usable: the exception was caught inside the worker, which goes on serving calls.
    """

    def __init__(self, rank: int, method: str, remote_traceback: str, exc_type: str = "Exception"):
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        self.exc_type = exc_type
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else exc_type
        super().__init__(
            f"rank {rank} raised in {method}(): {last}\n\nRemote traceback (rank {rank}):\n{remote_traceback}"
        )

    def __reduce__(self):
        return (type(self), (self.rank, self.method, self.remote_traceback, self.exc_type))


class WorkerDiedError(SpmdError):
    """A worker process (or actor) is gone: killed, crashed or out of memory.

    Every later call on the group raises it too, until `WorkerGroup.restart()` brings the rank back.
    """

    def __init__(self, rank: int, method: str | None = None, detail: str = ""):
        self.rank = rank
        self.method = method
        self.detail = detail
        during = f" during {method}()" if method else ""
        extra = f": {detail}" if detail else ""
        super().__init__(f"worker rank {rank} died{during}{extra}")

    def __reduce__(self):
        return (type(self), (self.rank, self.method, self.detail))


class CallTimeoutError(SpmdError, TimeoutError):
    """A group call did not finish within its timeout.

    ``reports`` maps each rank still running to its :class:`~spmdcall.RankReport`, taken when the
    deadline passed: the calls it runs and their ages, and the Python stack of each of its
    threads. The message shows them too, shortened. ``stopped`` says what the call's
    ``on_timeout`` policy did to those ranks after the reports were taken ("" for nothing).

    Example:
        >>> try:  # doctest: +SKIP
        ...     wg.train_step(batch)
        ... except sc.CallTimeoutError as exc:
        ...     print(exc.reports[1].threads["MainThread"])
    """

    def __init__(
        self,
        method: str,
        timeout: float,
        pending_ranks: list[int],
        reports: dict[int, RankReport] | None = None,
        stopped: str = "",
    ):
        self.method = method
        self.timeout = timeout
        self.pending_ranks = pending_ranks
        self.reports = dict(reports or {})
        self.stopped = stopped
        message = f"{method}() did not finish within {timeout:g} s; still running on ranks {pending_ranks}"
        if stopped:
            message += f"; {stopped}"
        if self.reports:
            message += "\n" + _where_ranks_are(self.reports) + "\n\n" + format_reports(self.reports)
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.method, self.timeout, self.pending_ranks, self.reports, self.stopped))


class CallInterrupted(BaseException):
    """Raised inside a worker method, in the thread running it, when its call passed its deadline
    under ``on_timeout="interrupt"``. A ``BaseException``, as ``KeyboardInterrupt`` is, so that an
    ``except Exception`` in the method does not swallow it; ``finally`` blocks and context managers
    run as it unwinds. It is delivered when the thread next runs Python bytecode: a thread blocked
    in C (``time.sleep``, a lock, a collective) gets it only once the C call returns.

    Example:
        >>> class Worker:  # doctest: +SKIP
        ...     def train(self):
        ...         try:
        ...             loop_forever()
        ...         except sc.CallInterrupted:
        ...             self.cleanup()
        ...             raise
    """


# The longest report text an error message carries (the full reports stay in ``.reports``).
_MAX_REPORT_CHARS = 12_000


_MAX_WHERE_LINES = 16


def _where_ranks_are(reports: dict[int, RankReport]) -> str:
    """One line per rank of where it is; then, when some wait in a torch.distributed collective
    and others do not, the ranks missing from it."""
    places = {r: reports[r].place() for r in sorted(reports)}
    lines = [f"  rank {r}: {place or reports[r].note or 'no stack'}" for r, place in places.items()]
    if len(lines) > _MAX_WHERE_LINES:  # the rest are in .reports
        lines = lines[:_MAX_WHERE_LINES] + [f"  ... {len(lines) - _MAX_WHERE_LINES} more ranks (in .reports)"]
    waiting = [r for r, place in places.items() if place.endswith("collective")]
    if waiting:
        missing = [r for r in places if r not in waiting]
        lines.append(
            f"  ranks {waiting} wait in a torch.distributed collective; "
            + (f"ranks {missing} are not in it" if missing else "no running rank is outside it")
            + " (ranks not listed here have finished this call)"
        )
    return "where:\n" + "\n".join(lines)


def format_reports(reports: dict[int, RankReport], max_chars: int = _MAX_REPORT_CHARS) -> str:
    """The reports of several ranks as text, rank by rank, cut at about ``max_chars`` characters."""
    text = "\n".join(reports[r].format() for r in sorted(reports))
    if len(text) > max_chars:
        text = text[:max_chars].rsplit("\n", 1)[0] + "\n... (cut: the full reports are in .reports)"
    return text


class ResourceInsufficientError(SpmdError):
    """A resource pool cannot be placed on the cluster (asked for more than it has)."""


def format_user_traceback(skip: int = 1) -> str:
    """The traceback of the exception being handled, without the first ``skip`` frames: those of
    the library code that called the user's method (so it starts at the user's code)."""
    exc_type, exc, tb = sys.exc_info()
    while skip > 0 and tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
        skip -= 1
    return "".join(traceback.format_exception(exc_type, exc, tb))


# The optional packages and the extra of spmdcall that installs each (see pyproject.toml).
_EXTRA_OF = {"torch": "torch", "tensordict": "torch", "ray": "ray", "monarch": "monarch"}


def missing_extra(exc: ModuleNotFoundError, feature: str) -> ModuleNotFoundError:
    """The error to raise when importing what ``feature`` needs failed with ``exc``.

    It names the extra of spmdcall that installs the missing package; ``exc`` itself when no
    extra does (a broken install of the package, say, is not cured by an extra).

    Example:
        >>> try:  # doctest: +SKIP
        ...     import torch
        ... except ModuleNotFoundError as exc:
        ...     raise missing_extra(exc, "DataProto") from None
        ModuleNotFoundError: DataProto needs torch, which is not installed: pip install "spmdcall[torch]"
    """
    package = (exc.name or "").partition(".")[0]
    extra = _EXTRA_OF.get(package)
    if extra is None:
        return exc
    return ModuleNotFoundError(
        f'{feature} needs {package}, which is not installed: pip install "spmdcall[{extra}]"', name=exc.name
    )
