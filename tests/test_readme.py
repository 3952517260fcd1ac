"""Every Python block in the README runs as written."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    script = tmp_path / f"readme_{index}.py"
    script.write_text(BLOCKS[index])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
