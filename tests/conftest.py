"""Shared fixtures: the backend parametrization, a Ray session, and a check for leftover workers."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("spmdcall.backends.ray") is not None
BACKENDS = ["inline", "process"] + (["ray"] if HAVE_RAY else [])
# Backends whose workers are separate processes (death, timeouts, torch.distributed).
PROCESS_BACKENDS = [b for b in BACKENDS if b != "inline"]


def pytest_collection_modifyitems(config, items):
    # GPU tests run only where torch sees a GPU.
    try:
        import torch

        have_gpu = torch.cuda.is_available()
    except ImportError:
        have_gpu = False
    if not have_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """One local Ray for the whole run (bounded CPUs, temp dir under pytest's), shut down at the end."""
    if not HAVE_RAY:
        pytest.skip("ray is not installed")
    import ray

    if ray.is_initialized():
        yield ray
        return
    tmp = tmp_path_factory.mktemp("ray")
    os.environ.setdefault("RAY_TMPDIR", str(tmp))
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=str(tmp), log_to_driver=True,
             configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(_test_paths())}})
    yield ray
    ray.shutdown()


def _test_paths() -> list[str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [root, os.path.join(root, "tests")]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Every shared-behaviour test runs once per backend."""
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


@pytest.fixture(params=PROCESS_BACKENDS)
def process_backend(request) -> str:
    """Backends whose ranks are real processes."""
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


def pytest_sessionfinish(session, exitstatus):
    # No worker process of ours may outlive the test run.
    try:
        import psutil
    except ImportError:
        return
    leftovers = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "spmdcall.backends.process" in " ".join(child.cmdline()):
                leftovers.append(child.pid)
        except psutil.Error:
            pass
    if leftovers:
        print(f"\nERROR: spmdcall worker processes left running after the tests: {leftovers}")
        session.exitstatus = 1
