"""Shared fixtures: the backend parametrization, a Ray session, and a check for leftover workers."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import tempfile
from importlib import metadata as _metadata
from pathlib import Path

import pytest

# Ray's distribution, not find_spec("ray"): pytest puts tests/ on sys.path, where tests/ray/ passes
# for a namespace package named ray when Ray is not installed.
HAVE_RAY = (
    importlib.util.find_spec("spmdcall.backends.ray.backend") is not None
    and next(iter(_metadata.distributions(name="ray")), None) is not None
)
BACKENDS = ["inline", "process"] + (["ray"] if HAVE_RAY else [])
# Backends whose workers are separate processes (death, timeouts, torch.distributed).
PROCESS_BACKENDS = [b for b in BACKENDS if b != "inline"]
# The conformance suite (tests/conformance) runs on monarch too where torchmonarch is installed
# (spmdcall[monarch]): about 2 minutes on 2 cores, as `python -m spmdcall.testing monarch`.
SUITE_BACKENDS = BACKENDS + (["monarch"] if importlib.util.find_spec("monarch") is not None else [])


def _uses_ray(item) -> bool:
    if "ray_session" in item.fixturenames or "ray_cluster" in item.fixturenames:
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(isinstance(v, str) and v == "ray" for v in callspec.params.values())


# -- pytest-xdist: which worker runs what (make test runs `-n 2 --dist loadgroup`) ----------------
# The tests of one file run on one worker, so its module-scoped groups and models are made once;
# every test that needs Ray runs on one worker, so one Ray cluster serves them all. The workers
# know each test's group (its fixtures and parameters); the controller, which schedules, sees
# only test ids: each worker writes the groups to a file the controller reads. (pytest-xdist's own
# loadgroup puts the group into the test id, which pytest 9.2 no longer lets a plugin change.)
_GROUPS_FILE = "spmdcall_groups_file"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    config = node.config
    if not hasattr(config, "_spmdcall_groups"):
        config._spmdcall_groups = os.path.join(tempfile.mkdtemp(prefix="spmd-groups-"), "groups.json")
    node.workerinput[_GROUPS_FILE] = config._spmdcall_groups


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                with open(config._spmdcall_groups) as f:
                    self.groups = json.load(f)
            return self.groups.get(nodeid, nodeid.partition("::")[0])

    return ByGroup(config, log)


def pytest_unconfigure(config):
    _write_durations(config)
    if hasattr(config, "_spmdcall_groups"):
        shutil.rmtree(os.path.dirname(config._spmdcall_groups), ignore_errors=True)


def _write_groups(config, items) -> None:
    path = getattr(config, "workerinput", {}).get(_GROUPS_FILE)
    if path is None:
        return
    groups = {item.nodeid: "ray" if _uses_ray(item) else item.nodeid.partition("::")[0] for item in items}
    mine = f"{path}.{os.getpid()}"
    with open(mine, "w") as f:
        json.dump(groups, f)
    os.replace(mine, path)  # every worker writes the same groups: whichever is there will do


# -- the fast tier: make test-fast runs `-m "not slow"` ------------------------------------------
# A test is slow when tests/durations.json (written by make test-durations) records it taking over
# SLOW_S seconds, setup and teardown included; the quickest test of each file stays in the fast tier,
# so that it still touches every file's subject. A test that is not recorded yet counts as fast.
DURATIONS = Path(__file__).with_name("durations.json")
SLOW_S = 1.0  # seconds in a make test run (two workers sharing the cores)


def pytest_addoption(parser):
    parser.addoption(
        "--write-durations",
        metavar="PATH",
        help="record the seconds (setup + call + teardown) of each test run in PATH, a JSON file",
    )


def _mark_slow(items) -> None:
    try:
        recorded = json.loads(DURATIONS.read_text())
    except FileNotFoundError:
        return
    quickest: dict[str, tuple[float, str]] = {}
    for item in items:
        seconds = recorded.get(item.nodeid, 0.0)
        file = item.nodeid.partition("::")[0]
        if seconds < quickest.get(file, (float("inf"), ""))[0]:
            quickest[file] = (seconds, item.nodeid)
    keep = {nodeid for _, nodeid in quickest.values()}
    for item in items:
        if recorded.get(item.nodeid, 0.0) > SLOW_S and item.nodeid not in keep:
            item.add_marker(pytest.mark.slow)


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if report.passed or report.failed or report.skipped:
        _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def _write_durations(config) -> None:
    path = config.getoption("write_durations", None)
    if path and not hasattr(config, "workerinput") and _seconds:  # the controller has every report
        try:  # a run of some tests updates theirs and keeps the others
            recorded = json.loads(Path(path).read_text())
        except FileNotFoundError:
            recorded = {}
        recorded.update({k: round(v, 2) for k, v in _seconds.items()})
        with open(path, "w") as f:
            json.dump(dict(sorted(recorded.items())), f, indent=0)
            f.write("\n")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselects
def pytest_collection_modifyitems(config, items):
    _write_groups(config, items)
    _mark_slow(items)
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


@pytest.fixture(scope="session", autouse=True)
def _monarch_logs_in_tmp(tmp_path_factory):
    """The rank logs of the suite's monarch groups go to a temporary folder, not the user's."""
    saved = os.environ.get("SPMDCALL_LOG_DIR")
    os.environ["SPMDCALL_LOG_DIR"] = str(tmp_path_factory.mktemp("monarch-logs"))
    yield
    if saved is None:
        del os.environ["SPMDCALL_LOG_DIR"]
    else:
        os.environ["SPMDCALL_LOG_DIR"] = saved


@pytest.fixture(scope="session")
def ray_tmp():
    """A short folder for a Ray cluster's files, removed at the end. Not under pytest's basetemp:
    Ray's sockets live there, and a Unix socket's path holds 107 bytes at most (pytest-xdist's
    workers nest their basetemp a level deeper)."""
    tmp = tempfile.mkdtemp(prefix="spmd-ray-")
    yield Path(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_session(ray_tmp):
    """One simulated 3-node Ray cluster for the whole run, shut down at the end: a head node with
    8 CPUs and 2 simulated GPUs, and two 2-CPU nodes advertising ``spmd_test_node: 2`` (so
    tests/ray can place a ``[2, 2]`` pool on two distinct nodes). The shared tests only see "a Ray".
    """
    if not HAVE_RAY:
        pytest.skip("ray is not installed")
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        yield ray
        return
    tmp = ray_tmp
    (tmp / "ray").mkdir(exist_ok=True)  # the other session fixture may have made it
    with _ray_tmpdir(tmp):  # Ray records the cluster address under RAY_TMPDIR: keep it out of /tmp/ray
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 8,
                "num_gpus": 2,
                "include_dashboard": False,
                "temp_dir": str(tmp),
                "object_store_memory": 512 << 20,
            },
        )
        for _ in range(2):
            cluster.add_node(num_cpus=2, resources={"spmd_test_node": 2}, object_store_memory=256 << 20)
    ray.init(address=cluster.address, log_to_driver=True, configure_logging=False)
    yield ray
    ray.shutdown()
    with _ray_tmpdir(tmp):
        cluster.shutdown()


@contextlib.contextmanager
def _ray_tmpdir(tmp):
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(tmp)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["RAY_TMPDIR"]
        else:
            os.environ["RAY_TMPDIR"] = saved


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Every shared-behaviour test runs once per backend."""
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


@pytest.fixture(scope="module", params=BACKENDS)
def module_backend(request) -> str:
    """``backend`` for a module's shared groups (when starting them is most of the tests' time)."""
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


@pytest.fixture(scope="module", params=SUITE_BACKENDS)
def suite_backend(request) -> str:
    """``backend`` of the conformance suite's modules: every built-in backend installed."""
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


@pytest.fixture(scope="module", params=PROCESS_BACKENDS)
def module_process_backend(request) -> str:
    """``process_backend`` for a module's shared groups."""
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


@pytest.fixture(params=PROCESS_BACKENDS)
def process_backend(request) -> str:
    """Backends whose ranks are real processes."""
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


# What SIGINT was when the run started, and the tests after which it was not any more (a test that
# changes it is found, and SIGINT is put back). The runner keeps SIGINT as it was given: a shell
# starts a background job (`make test &`) with SIGINT ignored, and a run so started is not stopped
# by a SIGINT sent to its process group. The programs a test must Ctrl-C are started with SIGINT
# on (tests/procs.py: with_sigint).
_SIGINT_AT_START: list = []
_SIGINT_CHANGED_BY: list[str] = []


def _sigint_state() -> tuple:
    return signal.getsignal(signal.SIGINT), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def pytest_sessionstart(session):
    _SIGINT_AT_START[:] = [_sigint_state()]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _SIGINT_AT_START and _sigint_state() != _SIGINT_AT_START[0]:
        _SIGINT_CHANGED_BY.append(f"{item.nodeid}: {_sigint_state()}")
        handler, blocked = _SIGINT_AT_START[0]
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_BLOCK if blocked else signal.SIG_UNBLOCK, [signal.SIGINT])


def pytest_terminal_summary(terminalreporter):
    if _SIGINT_CHANGED_BY:
        terminalreporter.write_line("SIGINT changed (and restored) after: " + "; ".join(_SIGINT_CHANGED_BY))


def pytest_sessionfinish(session, exitstatus):
    # No worker process of ours may outlive the test run (the templates ranks are forked from end
    # with this process: tests/test_process_templates.py).
    from procs import live_ranks

    try:
        leftovers = [p.pid for p in live_ranks()]
    except ImportError:  # psutil is not installed
        return
    if leftovers:
        print(f"\nERROR: spmdcall worker processes left running after the tests: {leftovers}")
        session.exitstatus = 1
