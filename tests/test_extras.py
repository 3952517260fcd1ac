"""Without an optional package, the feature that needs it names the extra that installs it.

Each case runs in a fresh interpreter in which the package is hidden (``sys.modules[name] = None``
makes its import fail as if it were not installed). tests/test_build.py checks the same in
virtual environments where the packages really are missing.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCH_HINT = 'pip install "spmdcall[torch]"'
RAY_HINT = 'pip install "spmdcall[ray]"'
RL_HINT = 'pip install "spmdcall[rl]"'


def _run_without(hidden: list[str], code: str) -> str:
    """Run ``code`` with the ``hidden`` packages unimportable; its stdout (it must exit 0)."""
    script = f"import sys\nfor _name in {hidden!r}:\n    sys.modules[_name] = None\n{code}"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _error_of(hidden: list[str], statement: str) -> str:
    """The ``ModuleNotFoundError`` message ``statement`` raises with the ``hidden`` packages missing."""
    code = f"try:\n    {statement}\nexcept ModuleNotFoundError as exc:\n    print(exc)\nelse:\n    print('no error')\n"
    return _run_without(hidden, code).strip()


@pytest.mark.parametrize(
    "statement",
    [
        "import spmdcall as sc; sc.DataProto",
        "from spmdcall import DataProto",
        "from spmdcall.data import DataProto",
    ],
)
@pytest.mark.parametrize("hidden", ["torch", "tensordict"])
def test_dataproto_names_the_torch_extra(statement, hidden):
    assert _error_of([hidden], statement) == f"DataProto needs {hidden}, which is not installed: {TORCH_HINT}"


@pytest.mark.parametrize("function", ["init_distributed()", "build_device_mesh((1,), ('dp',))"])
def test_distributed_helpers_name_the_torch_extra(function):
    name = function.partition("(")[0]
    message = _error_of(["torch"], f"import spmdcall as sc; sc.{function}")
    assert message == f"{name}() needs torch, which is not installed: {TORCH_HINT}"


def test_star_import_works_without_torch_and_holds_dataproto_with_it():
    code = "from spmdcall import *\nprint('WorkerGroup' in dir(), 'DataProto' in dir())\n"
    assert _run_without(["torch"], code).split() == ["True", "False"]
    assert _run_without([], code).split() == ["True", "True"]


def test_ray_backend_names_the_ray_extra():
    code = """
import spmdcall as sc
print(sc.available_backends())
try:
    sc.WorkerGroup(sc.ResourcePool([1]), sc.ClassWithInitArgs(dict), backend="ray")
except ModuleNotFoundError as exc:
    print(exc)
"""
    listed, message = _run_without(["ray", "monarch"], code).strip().splitlines()
    assert listed == "['inline', 'process']"
    assert message == f"the 'ray' backend needs ray, which is not installed: {RAY_HINT}"


def test_an_error_no_extra_cures_is_left_alone():
    from spmdcall.errors import missing_extra

    exc = ModuleNotFoundError("No module named 'sympy'", name="sympy")
    assert missing_extra(exc, "DataProto") is exc


def test_rl_extension_names_the_rl_extra():
    message = _error_of(["transformers", "yaml"], "import rl_extension.app.cli")
    assert message == f"rl_extension needs transformers, yaml, not installed here: {RL_HINT}"


def test_rl_extension_checks_every_package_of_the_rl_extra():
    tomllib = pytest.importorskip("tomllib")
    import rl_extension

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    import_name = {"pyyaml": "yaml"}  # distributions whose import name differs
    declared = set()
    for requirement in extras["rl"] + extras["torch"]:
        name = requirement.split(";")[0].strip()
        for sep in "<>=![ ":
            name = name.split(sep)[0]
        if name != "spmdcall":
            declared.add(import_name.get(name.lower(), name.lower()))
    assert set(rl_extension.REQUIRED_MODULES) == declared
