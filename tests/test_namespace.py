"""``spmdcall``'s namespace is its public API: ``dir(spmdcall)`` (and so ``help()`` and tab
completion) lists ``__all__`` and the module's dunders, nothing it imports to build them."""

from __future__ import annotations

import subprocess
import sys

import spmdcall


def test_dir_lists_the_public_api_and_nothing_else():
    public = [name for name in dir(spmdcall) if not name.startswith("__")]
    assert public == sorted(spmdcall.__all__)
    # Names the module imports (helpers, submodules) stay reachable but out of sight.
    for hidden in ("annotations", "importlib", "TYPE_CHECKING", "Any", "worker_group", "backends"):
        assert hidden not in dir(spmdcall)
    assert "__version__" in dir(spmdcall)


def test_every_public_name_resolves():
    missing = [name for name in spmdcall.__all__ if not hasattr(spmdcall, name)]
    assert not missing, f"names in spmdcall.__all__ that spmdcall does not have: {missing}"


def test_star_import_gives_the_public_api():
    namespace: dict = {}
    exec("from spmdcall import *", namespace)
    assert sorted(name for name in namespace if name != "__builtins__") == sorted(spmdcall.__all__)


def test_dir_and_import_load_neither_torch_nor_ray():
    code = "import sys, spmdcall; dir(spmdcall); print(sorted({'torch', 'ray'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
