"""The one command of the conformance suite, as a third party runs it: ``python -m spmdcall.testing``
against ``examples/thread_backend.py`` (the backend docs/backends/writing-a-backend.md walks
through), and against the smallest backend the page itself writes, copied outside the repository.
Both must pass; a bad backend spec must say what was expected."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import spmdcall as sc

ROOT = Path(__file__).resolve().parent.parent
SUITE_TIMEOUT_S = 400
# The page's backend: the python block right after this marker.
DOCS_BACKEND_MARKER = "<!-- the smallest backend -->"


def run_suite(
    spec: str, cwd: Path, *pytest_args: str, timeout: float = SUITE_TIMEOUT_S
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(cwd)])}
    return subprocess.run(
        [sys.executable, "-m", "spmdcall.testing", spec, "-q", *pytest_args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def passed(proc: subprocess.CompletedProcess) -> int:
    """How many tests passed; fails the test with pytest's output if any did not."""
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0 and "failed" not in summary and "error" not in summary, (
        proc.stdout + proc.stderr
    )
    return int(re.search(r"(\d+) passed", summary).group(1))


def test_the_thread_backend_example_passes_the_suite():
    assert passed(run_suite("examples.thread_backend:ThreadBackend", ROOT)) >= 50


def test_a_backend_written_from_the_docs_outside_the_repository_passes_the_suite(tmp_path):
    page = (ROOT / "docs" / "backends" / "writing-a-backend.md").read_text()
    after = page.split(DOCS_BACKEND_MARKER, 1)[1]
    code = re.search(r"```python\n(.*?)^```", after, re.S | re.M).group(1)
    (tmp_path / "my_backend.py").write_text(code)
    assert passed(run_suite("my_backend:SmallestBackend", tmp_path)) >= 50


def test_a_bad_backend_spec_says_what_was_expected(tmp_path):
    for spec, said in [
        ("no-such-backend", "unknown backend 'no-such-backend': expected a name registered with"),
        ("no_such_module:Backend", "cannot import module 'no_such_module'"),
        ("os:NoSuchBackend", "module 'os' has no attribute 'NoSuchBackend'"),
        ("os:sep", "expected a class or function building a backend, got str"),
        ("os:getcwd", "getcwd() returned a str, which is not a sc.Backend (it lacks name, "),
    ]:
        proc = run_suite(spec, tmp_path, timeout=60)
        assert proc.returncode == 2 and said in proc.stderr, (spec, proc.stderr)
        assert f"{spec!r}" in proc.stderr


def test_the_plugin_refuses_a_run_without_a_backend(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "spmdcall.testing",
            "-p",
            "spmdcall.testing.plugin",
            "-q",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 4 and "--spmdcall-backend=NAME" in proc.stdout + proc.stderr


def test_the_example_is_a_backend_by_the_protocol():
    from repo_scripts import load_script

    module = load_script("examples/thread_backend.py", "thread_backend_example")
    assert isinstance(module.ThreadBackend(), sc.Backend)


@pytest.mark.parametrize("spec", ["inline", "process"])
def test_resolving_a_builtin_name_registers_nothing(spec):
    from spmdcall.testing import resolve_backend

    before = sc.available_backends()
    assert resolve_backend(spec) == spec and sc.available_backends() == before


class _InController:
    """A backend class as far as its declaration goes: ranks in the controller's process."""

    capabilities = sc.Capabilities(ranks_in_own_processes=False)


def test_what_a_backend_offers_is_known_by_its_name_before_one_is_built(monkeypatch):
    import spmdcall.backends as backends
    from spmdcall.group.detached import attach

    assert not sc.backend_capabilities("inline").ranks_in_own_processes
    process = sc.backend_capabilities("process")
    assert process.ranks_in_own_processes and process.env and not process.detached
    monkeypatch.setitem(backends._registry, "declared-test", _InController)
    monkeypatch.setitem(backends._registry, "undeclared-test", lambda: None)
    assert sc.backend_capabilities("declared-test") is _InController.capabilities
    with pytest.raises(TypeError, match="'undeclared-test': its factory declares no capabilities"):
        sc.backend_capabilities("undeclared-test")
    with pytest.raises(ValueError, match=r"the 'process' backend keeps no workers .*capabilities.detached"):
        attach("anything", backend="process")
