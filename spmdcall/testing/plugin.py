"""The pytest plugin of the conformance suite: the ``--spmdcall-backend`` option, the
``spmd_backend`` fixture, and the probes by which the suite learns what a backend declares.

``python -m spmdcall.testing`` loads it (``-p spmdcall.testing.plugin``). A project that runs the
suite inside its own test session loads it too and overrides ``spmd_backend`` in its conftest
(spmdcall's own tests/conftest.py does, to run the suite over every built-in backend).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

from spmdcall.testing import resolve_backend


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--spmdcall-backend",
        default=None,
        metavar="BACKEND",
        help="the backend spmdcall's conformance suite tests: a registered name, an entry point of "
        "'spmdcall.backends', or an import path module:factory",
    )


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("timeout"):  # pytest-timeout is optional
        config.addinivalue_line(
            "markers", "timeout(seconds): a deadline, kept when pytest-timeout is installed"
        )
    spec = config.getoption("--spmdcall-backend")
    if spec is not None:
        try:
            config.stash[_RESOLVED] = resolve_backend(spec)
        except ValueError as exc:
            raise pytest.UsageError(f"--spmdcall-backend: {exc}") from None


_RESOLVED = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def spmd_backend(pytestconfig: pytest.Config) -> str:
    """The name ``sc.WorkerGroup(..., backend=...)`` takes for the backend under test."""
    if _RESOLVED not in pytestconfig.stash:
        pytest.exit(
            "spmdcall's conformance suite needs the backend to test: --spmdcall-backend=NAME or "
            "--spmdcall-backend=module:factory (or run python -m spmdcall.testing BACKEND)",
            returncode=4,
        )
    return pytestconfig.stash[_RESOLVED]


# -- what the suite reads off a running group --------------------------------------------------


def own_processes(group: Any, pids_inside: list[int]) -> bool:
    """Whether every rank of ``group`` is a process of its own on this machine: ``worker_info()``
    gives each rank a pid other than the controller's, on this host, and the same pid the rank
    found with ``os.getpid()`` inside a call (``pids_inside``). Only then may a test read a rank's
    own ``os.environ`` or kill its process."""
    info = group.worker_info()
    pids = [i.get("pid") for i in info]
    here = socket.gethostname()
    return all(i.get("host") == here for i in info) and os.getpid() not in pids and list(pids_inside) == pids


def runs_calls_in_submit(group: Any) -> bool:
    """Whether a plain call has finished by the time the call returns (the ``inline`` backend runs
    it right there): such a backend has nothing left to time out, and a deadline cannot apply."""
    future = group.execute_all_async("sleep", 0.2)
    done = future.done()
    future.get(timeout=60)
    return done
