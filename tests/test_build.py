"""The package builds and installs: sdist and wheel via ``python -m build``, then the wheel alone in a fresh venv.

Catches what an editable install hides: a module or data file left out of the wheel, an import
of something that is not a declared dependency, a version that disagrees with pyproject.toml.
Needs the ``build`` package (in the ``dev`` extra) and a package index for the build backend,
cloudpickle and numpy.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(600)

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


for backend in ("inline", "process"):
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Counter, start=10), backend=backend) as wg:
        assert wg.add([1, 2]) == [(0, 11), (1, 12)], backend
print(sc.__version__)
"""


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert out.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    )
    return out


def test_wheel_builds_installs_and_runs(tmp_path):
    pytest.importorskip("build", reason="the build package is not installed (it is in the dev extra)")
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)

    # Build from a copy of the sources, so the build leaves nothing (egg-info, build/) in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    for package in ("spmdcall", "rl_extension"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)])

    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"spmdcall-{version}-py3-none-any.whl"]
    assert [s.name for s in sdists] == [f"spmdcall-{version}.tar.gz"]
    with zipfile.ZipFile(wheels[0]) as whl:
        names = set(whl.namelist())
    # Every file of the packages (modules, py.typed, YAML presets, ...) is in the wheel.
    sources = {
        p.relative_to(src).as_posix()
        for package in ("spmdcall", "rl_extension")
        for p in (src / package).rglob("*")
        if p.is_file()
    }
    missing = sorted(sources - names)
    assert not missing, (
        f"files missing from the wheel (add them to [tool.setuptools.package-data]): {missing}"
    )
    with tarfile.open(sdists[0]) as sdist:
        assert f"spmdcall-{version}/pyproject.toml" in sdist.getnames()

    # A fresh venv with the wheel and its two dependencies, nothing from this checkout.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "--no-deps", str(wheels[0])])
    _run([*pip, "cloudpickle", "numpy"])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    work = tmp_path / "work"
    work.mkdir()
    (work / "smoke.py").write_text(SMOKE)
    out = _run([python, "smoke.py"], cwd=work, env=env, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == version
    printed = _run([python, "-c", "import spmdcall; print(spmdcall.__version__)"], cwd=work, env=env)
    assert printed.stdout.strip() == version
