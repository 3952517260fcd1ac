"""Shared set-up for ``make bench``: collects ``bench_*.py``, one Ray per session (for the cases
that need it, which run last), labelled cases.

Every benchmark names its group (``benchmark.group``), a readable label, the label of the baseline
it is compared with in that group, and the target it must meet; ``report.py`` turns the JSON into
the table and chart of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import os
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Superseded by bench_echo.py (same three cases, in the "echo 32 MiB" group); still runs when named.
_NOT_COLLECTED = {"bench_ray_echo.py"}


def pytest_collect_file(file_path, parent):
    # pytest only collects test_*.py by itself; files named on the command line it collects anyway.
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("bench_")
        and file_path.name not in _NOT_COLLECTED
        and not parent.session.isinitpath(file_path)
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def _uses_ray(item: pytest.Item) -> bool:
    if "ray_session" in item.fixturenames:
        return True
    params = getattr(item, "callspec", None)
    values = params.params.values() if params is not None else ()
    return any(v == "ray" or (isinstance(v, tuple) and "ray" in v) for v in values)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    # Every case that needs Ray runs after all that do not: Ray's daemons (GCS, raylet, its idle
    # workers) wake up every few milliseconds, and on 2 cores they would lengthen the process
    # backend's and the pipes' calls, which a user of those does not pay. The order within each
    # part stays as pytest chose it (module-scoped groups are built once).
    items.sort(key=_uses_ray)


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """One local Ray for the whole run: 4 logical CPUs (a world-4 group, or two world-2 groups),
    2 GiB of object store, its files under pytest's temp dir; shut down at the end."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        yield ray
        return
    ray.init(
        num_cpus=4,
        object_store_memory=2 << 30,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([HERE, ROOT])}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture
def case(benchmark):
    """Label this benchmark: ``case(group, label, baseline=..., target_s=..., target_ratio=...)``.

    ``baseline`` is the label of the case in the same group this one is compared with (None: this
    one is a baseline); ``target_s`` bounds its median in seconds, ``target_ratio`` its ratio.
    """

    def describe(
        group: str,
        label: str,
        *,
        baseline: str | None = None,
        target_s: float | None = None,
        target_ratio: float | None = None,
    ):
        benchmark.group = group
        benchmark.extra_info.update(
            label=label, baseline=baseline, target_s=target_s, target_ratio=target_ratio
        )
        return benchmark

    return describe


def pytest_sessionfinish(session, exitstatus):
    # Nothing we started may outlive the run: worker processes, Ray's daemons, pipe servers.
    try:
        import psutil
    except ImportError:
        return
    deadline = time.monotonic() + 10.0
    while True:
        leftovers = []
        for child in psutil.Process().children(recursive=True):
            try:
                # multiprocessing's resource tracker (started by the spawn context) and the process
                # backend's templates (ranks are forked from them) end with this process
                cmdline = " ".join(child.cmdline()).strip()
                if (
                    child.status() != psutil.STATUS_ZOMBIE
                    and "multiprocessing.resource_tracker" not in cmdline
                    and not cmdline.startswith("spmdcall template")
                ):
                    leftovers.append(f"{child.pid} {cmdline[:120]}")
            except psutil.Error:
                pass
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if leftovers:
        print("\nbenchmarks left processes behind:\n  " + "\n  ".join(leftovers))
        session.exitstatus = 1


# -- the 32 MiB echo's data (bench_echo.py, bench_monarch.py: 2 ranks) -------------------------


@pytest.fixture(scope="module")
def batch():
    from workers import MIB, make_batch

    return make_batch(32 * MIB, num_columns=2)


@pytest.fixture(scope="module")
def halves(batch):
    """The rows each of 2 ranks gets, as a dict of tensors per rank."""
    return [{k: v for k, v in part.batch.items()} for part in batch.chunk(2)]
