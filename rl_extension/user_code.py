"""Loading a user's function named ``module.path:function`` or ``/path/to/file.py:function``.

A scorer (``reward.scorer``) and a tool (``rollout.multi_turn.tools``) may be given this way
wherever a registered name is accepted; importing the module also runs the registration
decorators in it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["load_function"]


def load_function(spec: str, what: str = "function") -> Callable[..., Any]:
    """Import the function ``spec`` names.

    Args:
        spec: ``"package.module:function"`` (importable from sys.path) or ``"/path/to/file.py:function"``.
        what: how error messages call it (``"reward function"``, ``"tool"``).

    Raises:
        ValueError: a malformed spec, a missing file, or no callable of that name.

    Example:
        >>> load_function("os.path:join")("a", "b")
        'a/b'
    """
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise ValueError(f"{what} {spec!r} must look like 'module.path:function_name'")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"{what} file {path} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"_user_code_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"{module_name} has no function {function_name!r}")
    return function
