"""Helpers for tests that start a controller in a subprocess and watch processes come and go."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

TESTS = os.path.dirname(os.path.abspath(__file__))


def run_controller(script: str) -> subprocess.Popen:
    """Run ``script`` as its own controller process, with the tests folder importable."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([TESTS, os.path.join(TESTS, "faults"), os.path.dirname(TESTS)]),
    }
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True, env=env
    )


# A command line that runs ``python ARGS`` with SIGINT as a terminal gives it: on, and unblocked.
# A shell starts a background job (`make test &`) with SIGINT ignored, and whatever the tests start
# inherits that; a program that must see a Ctrl-C is started through this (exec keeps a default
# disposition, and Python then turns SIGINT into KeyboardInterrupt), so the runner itself can keep
# SIGINT as its shell gave it.
_SIGINT_ON = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); os.execv(sys.executable, sys.argv[1:])"
)


def with_sigint(*args: str) -> list[str]:
    """``[sys.executable, *args]``, started with SIGINT on (see above)."""
    return [sys.executable, "-c", _SIGINT_ON, sys.executable, *args]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has exited (after its name)
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after waiting up to ``seconds`` for all of them to exit."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def is_rank(cmdline: str) -> bool:
    """Whether a process's command line is a ``process`` rank's: its title (``spmdcall Class r/n``)
    or, before it set one, the command that spawns it. A template (``spmdcall template``) is not."""
    if cmdline.startswith("spmdcall "):
        return not cmdline.startswith("spmdcall template")
    return "spmdcall.backends.process.worker" in cmdline


def live_ranks(process=None) -> list:
    """The ``process`` ranks among the descendants of ``process`` (psutil; this one by default) that
    have not ended (a zombie has)."""
    import psutil

    found = []
    for child in (process or psutil.Process()).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and is_rank(" ".join(child.cmdline()).strip()):
                found.append(child)
        except psutil.Error:
            pass  # gone meanwhile
    return found
