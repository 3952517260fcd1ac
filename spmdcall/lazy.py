"""Optional dependencies (torch, Ray) and spmdcall's own modules that import them, loaded on demand.

Asking ``sys.modules`` whether a module is loaded is not enough when several threads run: a module
another thread is still importing is already there, half-built (a name looked up in it fails as
"partially initialized module"). :func:`loaded` answers only for a module whose import finished.
"""

from __future__ import annotations

import sys
from types import ModuleType


def loaded(name: str) -> ModuleType | None:
    """The module ``name`` if its import has finished (in any thread), else None; never imports."""
    module = sys.modules.get(name)
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None  # another thread is still running its top level
    return module
