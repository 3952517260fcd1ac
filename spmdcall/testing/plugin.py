"""The pytest plugin of the conformance suite: the ``--spmdcall-backend`` option, the
``spmd_backend`` fixture, and the checks of what a backend declares (``sc.Capabilities``).

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
    """Whether a test may read each rank's own ``os.environ`` and kill its process from here: the
    backend declares ranks in processes of their own (``Capabilities.ranks_in_own_processes``) and
    every rank is on this machine. The declaration is checked: ``worker_info()`` must then give
    each rank a pid other than the controller's, the one the rank finds inside a call
    (``pids_inside``)."""
    if not group.capabilities.ranks_in_own_processes:
        return False
    info = group.worker_info()
    pids = [i.get("pid") for i in info]
    assert os.getpid() not in pids and list(pids_inside) == pids, (
        f"the backend declares ranks_in_own_processes, but worker_info() gives pids {pids} "
        f"(the controller is {os.getpid()}) and the ranks report {list(pids_inside)}"
    )
    return all(i.get("host") == socket.gethostname() for i in info)


def runs_calls_in_submit(group: Any) -> bool:
    """Whether a plain call has finished by the time the call returns (the ``inline`` backend runs
    it right there, unless the class has async methods): then nothing is left to time out, and a
    deadline cannot apply. A behaviour of the backend with this class, so it is observed here."""
    future = group.execute_all_async("sleep", 0.2)
    done = future.done()
    future.get(timeout=60)
    return done
