"""``tools/verl_compat.py`` (``make verl-compat``) end to end on a stand-in verl checkout: it builds
the re-export package with verl's utils beside it, runs the test files in their own pytest
processes on the chosen backend, and reports passed/failed per file and the pass rate."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from repo_scripts import load_script

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(240)

tool = load_script("tools/verl_compat.py", "verl_compat_tool")

FILES = {
    "verl/__init__.py": "raise ImportError('the real verl package must not be imported')\n",
    "verl/single_controller/__init__.py": "",
    # verl's own utils/__init__ pulls in packages the tests never use: the tool replaces it.
    "verl/utils/__init__.py": "import omegaconf_is_not_installed\n",
    "verl/utils/device.py": "def get_device_name():\n    return 'cpu'\n",
    "tests/__init__.py": "",
    "tests/single_controller/__init__.py": "",
    "tests/test_protocol_on_cpu.py": """
        import numpy as np
        import torch

        from verl import DataProto
        from verl.protocol import union_numpy_dict


        def test_concat():
            data = DataProto.from_dict({"x": torch.arange(4)})
            assert DataProto.concat(data.chunk(2)).batch["x"].tolist() == [0, 1, 2, 3]
            union_numpy_dict({"a": np.zeros(2)}, {"a": np.zeros(2)})
    """,
    "tests/single_controller/test_group_on_cpu.py": """
        import os

        import ray

        from verl.single_controller.base import Worker
        from verl.single_controller.base.decorator import Dispatch, register
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.utils.device import get_device_name


        @ray.remote
        class Actor(Worker):
            @register(dispatch_mode=Dispatch.ONE_TO_ALL)
            def where(self):
                return self.rank, os.environ["SPMDCALL_VERL_BACKEND"]


        def test_group():
            pool = RayResourcePool([2], use_gpu=False)
            wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=Actor), device_name=get_device_name())
            assert wg.where() == [(0, "inline"), (1, "inline")]


        def test_that_fails():
            assert False, "counted as a failure"
    """,
}


def fake_checkout(root: Path) -> Path:
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip())
    return root


def test_runs_each_file_on_the_backend_and_reports(tmp_path, capsys):
    checkout = fake_checkout(tmp_path / "verl")
    # 2 of 3 pass: under the pass rate asked for, so the exit status says so.
    assert tool.main([str(checkout), "--backend", "inline", "--min-pass-rate", "0.7"]) == 1
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  tests/")}
    assert "passed   1  failed   1" in lines["tests/single_controller/test_group_on_cpu.py"], out
    assert "passed   1  failed   0" in lines["tests/test_protocol_on_cpu.py"], out
    assert "inline: 2 of 3 passed (66.7%)" in out
    assert "FAILED tests/single_controller/test_group_on_cpu.py::test_that_fails" in out
    assert "not run: tests/single_controller/test_rvdz.py" in out  # the GPU-only files are named


def test_fails_below_the_pass_rate_and_refuses_what_is_not_verl(tmp_path, capsys):
    checkout = fake_checkout(tmp_path / "verl")
    assert (
        tool.main([str(checkout), "--backend", "inline", "-k", "fails or concat"]) == 1
    )  # 1 of 2: under 90%
    with pytest.raises(SystemExit):
        tool.main([str(tmp_path / "nothing")])
    assert "not a verl checkout" in capsys.readouterr().err
