"""The package as a new user meets it: built, installed from the wheel, and used as the docs say.

The sdist and the wheel are built (``python -m build``: the sdist, then the wheel from the sdist)
from a copy of the checkout's files, the wheel is installed into fresh virtual environments, and
there, with nothing from the checkout on the path:

- plain ``pip install spmdcall``: the inline and process backends work, ``import spmdcall`` loads
  neither torch nor Ray, and DataProto, ``init_distributed``, ``backend="ray"`` and the
  ``spmdcall-rl`` command each name the extra to install;
- the same environment with ``[ray]`` added: a group runs on Ray;
- ``[torch]``: the README's Quickstart prints what its comments say (tests/test_docs.py checks
  docs/index.md's, and the README's again, in the test's own environment), and ``backend="ray"``
  still names ``[ray]``;
- the same environment with ``[rl]`` added: ``spmdcall-rl presets`` and the Python block of
  docs/rl/quickstart.md run, and so do tests shipped in the sdist (every test module is collected
  from the unpacked sdist; those that read the docs, examples, benchmarks and presets run).

An extra is added to an environment rather than given one of its own, to save installing torch
twice: pip resolves ``[rl]`` over ``[torch]`` to the environment it would build from nothing. The
tests of a module-scoped environment run in file order (each checks which extras it has).

torch is the release the README's CPU-wheel command names, from the indexes pip is set up with:
the CPU wheel where they hold it (a developer's machine, CI), PyPI's CUDA build elsewhere (as the
Makefile's TORCH_SPEC). pip keeps its cache, so what it could cache from earlier runs is not
downloaded again, and installs with --no-compile (bytecode is written as modules are first
imported). Needs ``build`` (the dev extra), git (the files to package are the checkout's, as
``git ls-files`` sees them) and a package index.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_docs import check_printed

ROOT = Path(__file__).resolve().parent.parent
VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
# Files of the checkout the sdist leaves out: CI's own set-up.
NOT_IN_SDIST = {".ci/run", ".gitignore"}
# What the build writes into the sdist besides the checkout's files.
SDIST_GENERATED = re.compile(r"^(PKG-INFO|setup\.cfg|spmdcall\.egg-info/.*)$")
CPU_TORCH = re.compile(r"^pip install (torch==\S+) --index-url https://download\.pytorch\.org/whl/cpu$", re.M)
STEP_TIMEOUT_S = 300

pytestmark = pytest.mark.timeout(900)


def _run(cmd: list, *, cwd: Path | None = None, env: dict | None = None, check: bool = True):
    try:
        out = subprocess.run(
            [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"{' '.join(map(str, cmd))} ran longer than {STEP_TIMEOUT_S} s\n{exc.stdout}\n{exc.stderr}"
        )
    if check:
        assert out.returncode == 0, (
            f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-6000:]}\n{out.stderr[-6000:]}"
        )
    return out


class Venv:
    """A fresh virtual environment; ``extras`` are the extras of spmdcall installed in it.

    One ``pip install`` may run in the background; anything done with the environment waits for it.
    """

    def __init__(self, path: Path):
        _run([sys.executable, "-m", "venv", path])
        self.bin = path / "bin"
        self.extras: set[str] = set()
        self.work = path.parent / f"{path.name}-work"  # the cwd of what runs here: no checkout in sight
        self.work.mkdir()
        # Nothing from the test's own environment: not its packages, not the checkout. Bytecode is
        # written on first import, as in a user's environment (pip installs with --no-compile).
        dropped = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
        self.env = {k: v for k, v in os.environ.items() if k not in dropped}
        self.env["PATH"] = f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"
        self._pending: subprocess.Popen | None = None

    def pip_install(self, *requirements: str | Path, background: bool = False) -> None:
        """``pip install`` into this environment; the bytecode compiles on first import."""
        self.wait()
        cmd = [self.bin / "python", "-m", "pip", "install", "-q", "--no-compile", *requirements]
        if not background:
            _run(cmd, env=self.env)
            return
        with (self.work / "pip.log").open("w") as log:  # the child keeps its own handle
            self._pending = subprocess.Popen([str(c) for c in cmd], env=self.env, stdout=log, stderr=log)

    def install(self, wheel: Path, extra: str | None, *more: str) -> None:
        """``pip install "spmdcall[extra]"`` from ``wheel`` (with ``more`` requirements)."""
        self.pip_install(f"{wheel}[{extra}]" if extra else wheel, *more)
        if extra:
            self.extras.add(extra)

    def wait(self) -> None:
        """Wait for the install running in the background, if any; fail if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            returncode = pending.wait(timeout=STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pending.kill()
            returncode = pending.wait()
        log = (self.work / "pip.log").read_text()
        assert returncode == 0, f"{' '.join(map(str, pending.args))} failed ({returncode}):\n{log[-6000:]}"

    def stop(self) -> None:
        """Stop an install still running in the background (a test before its wait failed)."""
        if self._pending is not None:
            self._pending.kill()
            self._pending.wait()

    def expect(self, *extras: str) -> None:
        self.wait()
        if self.extras != set(extras):
            pytest.fail(f"this test needs extras {sorted(extras)}, the environment has {sorted(self.extras)}")

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess:
        self.wait()
        script = self.work / "script.py"
        script.write_text(code)
        return _run([self.bin / "python", script, *args], cwd=self.work, env=self.env)

    def command(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        self.wait()
        return _run([self.bin / args[0], *args[1:]], cwd=self.work, env=self.env, check=check)


def _section(markdown: str, heading: str) -> str:
    """The text under ``## heading`` up to the next heading of that level."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def _blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", markdown, re.M | re.S)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, set[str]]:
    """A copy of the checkout's files (tracked, or new and not ignored): what a commit would hold."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout: the package is built from the files git sees")
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    files = {
        name
        for name in listed.split("\0")
        if name and (ROOT / name).is_file() and not (ROOT / name).is_symlink()
    }
    src = tmp_path_factory.mktemp("src")
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    return src, files


@pytest.fixture(scope="module")
def torch_spec() -> str:
    """The torch the README tells CPU-only users to install first (its CPU build)."""
    match = CPU_TORCH.search((ROOT / "README.md").read_text())
    assert match, "the README should say how to install the CPU build of torch"
    return match.group(1)


@pytest.fixture(scope="module")
def cpu_torch_venv(torch_spec, tmp_path_factory) -> Iterator[Venv]:
    """A fresh environment installing torch in the background: the README's first step on a machine
    without a GPU, and the longest install, so it overlaps the build and the checks before it."""
    venv = Venv(tmp_path_factory.mktemp("torch") / "venv")
    venv.pip_install(torch_spec, background=True)
    yield venv
    venv.stop()


@pytest.fixture(scope="module")
def dist(sources, cpu_torch_venv, tmp_path_factory) -> dict:
    # cpu_torch_venv only to have its install start first.
    pytest.importorskip("build", reason="the build package is not installed (it is in the dev extra)")
    out = tmp_path_factory.mktemp("dist")
    log = _run([sys.executable, "-m", "build", "--outdir", out, sources[0]])
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"spmdcall-{VERSION}-py3-none-any.whl"]
    assert [s.name for s in sdists] == [f"spmdcall-{VERSION}.tar.gz"]
    return {"wheel": wheels[0], "sdist": sdists[0], "log": log.stdout + log.stderr}


@pytest.fixture(scope="module")
def sdk_venv(dist, tmp_path_factory) -> Venv:
    venv = Venv(tmp_path_factory.mktemp("sdk") / "venv")
    venv.install(dist["wheel"], None)
    return venv


@pytest.fixture(scope="module")
def ray_venv(sdk_venv, dist) -> Venv:
    sdk_venv.install(dist["wheel"], "ray")
    return sdk_venv


@pytest.fixture(scope="module")
def torch_venv(cpu_torch_venv, dist, torch_spec) -> Venv:
    cpu_torch_venv.install(dist["wheel"], "torch", torch_spec)
    return cpu_torch_venv


@pytest.fixture(scope="module")
def rl_venv(torch_venv, dist, torch_spec) -> Venv:
    torch_venv.install(dist["wheel"], "rl", torch_spec)
    return torch_venv


def test_sdist_and_wheel_hold_the_project_and_its_license(sources, dist):
    files = sources[1]
    assert "deprecat" not in dist["log"].lower(), f"the build warns:\n{dist['log']}"
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = set(whl.namelist())
        metadata = whl.read(f"spmdcall-{VERSION}.dist-info/METADATA").decode()
    # Every file of the packages (modules, py.typed, YAML presets, ...) is in the wheel, and the license.
    missing = sorted(f for f in files if f.split("/")[0] in ("spmdcall", "rl_extension") and f not in names)
    assert not missing, (
        f"files missing from the wheel (add them to [tool.setuptools.package-data]): {missing}"
    )
    assert f"spmdcall-{VERSION}.dist-info/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
    # What the package page and `pip show` show: where the docs, the source and the issues are.
    for label in ("Documentation", "Source", "Issues"):
        assert re.search(rf"^Project-URL: {label}, https://\S+$", metadata, re.M), f"no {label} URL"
    for field in ("Author", "Keywords", "Classifier"):
        assert re.search(rf"^{field}: \S", metadata, re.M), f"no {field} in the wheel's metadata"
    # The sdist holds the checkout (tests and the docs, examples and benchmarks they read) and nothing else.
    with tarfile.open(dist["sdist"]) as sdist:
        held = {m.name.partition("/")[2] for m in sdist.getmembers() if m.isfile()}
    held = {name for name in held if not SDIST_GENERATED.match(name)}
    assert "LICENSE" in held
    assert sorted(files - NOT_IN_SDIST - held) == [], "files missing from the sdist (see MANIFEST.in)"
    assert sorted(held - files) == [], "files in the sdist that the checkout does not have"


SMOKE = r"""
import os, sys
import spmdcall as sc

assert os.path.realpath(sc.__file__).startswith(os.path.realpath(sys.prefix)), sc.__file__
import spmdcall.compat.verl  # noqa: F401  (the compat layer ships too)
assert not {"torch", "ray"} & set(sys.modules), "import spmdcall must stay free of torch and ray"


class Counter(sc.Worker):
    def __init__(self, start):
        self.n = start

    @sc.register(dispatch_mode=sc.Dispatch.ALL_TO_ALL)
    def add(self, k):
        self.n += k
        return (self.rank, self.n)


for backend in sys.argv[1:] or ("inline", "process"):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter, start=10), backend=backend) as wg:
        assert wg.add([1, 2]) == [(0, 11), (1, 12)], backend
print(sc.__version__)
"""

# Print the message of each error a missing extra causes, one a line.
ERROR_OF = r"""
import spmdcall as sc


def error(statement):
    try:
        exec(statement)
    except ModuleNotFoundError as exc:
        return str(exc)
    return "no error"
"""
TORCH_ERRORS = (
    ERROR_OF
    + r"""
print(error("sc.DataProto"))
print(error("from spmdcall.data import DataProto"))
print(error("sc.init_distributed()"))
print(error("from spmdcall import *"))
"""
)
RAY_ERRORS = (
    ERROR_OF
    + r"""
print(sc.available_backends())
print(error('sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(dict), backend="ray")'))
"""
)
NEEDS_TORCH = 'needs torch, which is not installed: pip install "spmdcall[torch]"'
NEEDS_RAY = "the 'ray' backend needs ray, which is not installed: pip install \"spmdcall[ray]\""


def test_plain_install_runs_the_sdk_without_torch_or_ray(sdk_venv):
    sdk_venv.expect()
    assert sdk_venv.python(SMOKE).stdout.strip().splitlines()[-1] == VERSION


def test_plain_install_names_the_extra_each_missing_package_needs(sdk_venv):
    sdk_venv.expect()
    assert sdk_venv.python(TORCH_ERRORS).stdout.splitlines() == [
        f"DataProto {NEEDS_TORCH}",
        f"DataProto {NEEDS_TORCH}",
        f"init_distributed() {NEEDS_TORCH}",
        "no error",
    ]
    assert sdk_venv.python(RAY_ERRORS).stdout.splitlines() == ["['inline', 'process']", NEEDS_RAY]
    cli = sdk_venv.command("spmdcall-rl", "presets", check=False)
    assert cli.returncode != 0 and 'pip install "spmdcall[rl]"' in cli.stderr.strip().splitlines()[-1], (
        cli.stderr
    )


@pytest.mark.ray
def test_ray_extra_runs_a_group_on_ray(ray_venv):
    ray_venv.expect("ray")
    out = ray_venv.python(SMOKE, "ray")
    assert out.stdout.strip().splitlines()[-1] == VERSION
    # Still no torch here: DataProto names its extra.
    assert ray_venv.python(TORCH_ERRORS).stdout.splitlines()[0] == f"DataProto {NEEDS_TORCH}"


def test_readme_quickstart_prints_what_it_says_after_the_install_it_names(torch_venv):
    torch_venv.expect("torch")
    quickstart = _section((ROOT / "README.md").read_text(), "Quickstart")
    assert [b.strip() for b in _blocks(quickstart, "bash")] == ['pip install "spmdcall[torch]"']
    (code,) = _blocks(quickstart, "python")
    check_printed(code, torch_venv.python(code).stdout, "README's Quickstart")


def test_torch_extra_without_ray_names_the_ray_extra(torch_venv):
    torch_venv.expect("torch")
    assert torch_venv.python(RAY_ERRORS).stdout.splitlines() == ["['inline', 'process']", NEEDS_RAY]


def test_rl_extra_runs_the_cli_and_the_rl_quickstart(rl_venv):
    rl_venv.expect("torch", "rl")
    quickstart = (ROOT / "docs" / "rl" / "quickstart.md").read_text()
    install = _blocks(quickstart, "bash")[0].strip().splitlines()[0]
    assert install.split("#")[0].strip() == 'pip install "spmdcall[rl]"'
    assert "tiny-cpu " in rl_venv.command("spmdcall-rl", "presets").stdout
    (code,) = _blocks(quickstart, "python")
    last = rl_venv.python(code).stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"step 2: held-out accuracy \d\.\d\d, reward -?\d\.\d\d", last), last


# The shipped tests run from the unpacked sdist: those that read what the sdist carries besides the
# packages (docs/, examples/, benchmarks/, mkdocs.yml, the presets). The whole suite is collected.
SDIST_TESTS = (
    "test_nav_lists_every_page or test_api_reference or test_index_links or test_block_parser"
    " or test_example_docstring or test_docs_name_the_examples or (test_example and any_class and process)"
    " or test_bench_report or test_presets_only_override or test_docs_config_reference or test_cli_presets"
)


def test_tests_shipped_in_the_sdist_pass_from_it(rl_venv, dist, tmp_path):
    rl_venv.expect("torch", "rl")
    rl_venv.pip_install("pytest", "pytest-timeout", "psutil")
    with tarfile.open(dist["sdist"]) as sdist:
        sdist.extractall(tmp_path)
    unpacked = tmp_path / f"spmdcall-{VERSION}"
    out = _run(
        [
            rl_venv.bin / "python",
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests",
            "-k",
            SDIST_TESTS,
        ],
        cwd=unpacked,
        env=rl_venv.env,
    )
    summary = out.stdout.strip().splitlines()[-1]
    assert re.match(r"=* ?\d+ passed, ", summary) and not re.search("failed|error", summary), out.stdout[
        -3000:
    ]
    # Only modules of extras this environment lacks may be skipped (at collection).
    skipped = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all(re.search(r"\b(ray|vllm|monarch)\b", line) for line in skipped), skipped
