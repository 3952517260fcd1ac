"""Load the repository's scripts (benchmarks/, examples/, scripts/, tools/) by path, as modules."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_script(relative: str | Path, name: str) -> ModuleType:
    """The file ``relative`` (to the repository root) run as module ``name``; it stays in
    ``sys.modules`` under that name, where dataclasses and pickle look their module up."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    assert spec is not None and spec.loader is not None, relative
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def script_with_its_folder(relative: str | Path, name: str) -> Iterator[ModuleType]:
    """``load_script(relative, name)`` with the script's folder on ``sys.path`` while in use: for a
    script that imports a module beside it (benchmarks/rl's scripts import ``engines.py``)."""
    folder = str((ROOT / relative).parent)
    sys.path.insert(0, folder)
    try:
        yield load_script(relative, name)
    finally:
        sys.path.remove(folder)
