"""Loading a user's code: the modules of the config's ``imports``, and functions named ``module:function``.

``import_modules`` imports the modules a config lists in ``imports`` (a dotted name, or the path of
a ``.py`` file) before the config's names are checked, so that what they register with
``@register_adv_estimator``, ``@register_policy_loss``, ``@register_scorer``,
``@register_tool_format`` or ``@tool`` can be named in the config, from the command line and YAML.

A scorer (``reward.scorer``) and a tool (``rollout.multi_turn.tools``) may also be given as
``module.path:function`` or ``/path/to/file.py:function`` wherever a registered name is accepted;
importing the module also runs the registration decorators in it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["import_modules", "load_function"]


def import_modules(specs: Sequence[str], key: str = "imports") -> list[ModuleType]:
    """Import each module of ``specs``, in order; importing one again does nothing.

    A file is imported as the module named after it (``plugins/my_losses.py``: ``my_losses``), with
    its folder put first on ``sys.path`` as ``python plugins/my_losses.py`` would. So it is an
    ordinary module, and the workers, which start with the controller's ``sys.path``, import it by
    name where a function of it reaches them (a policy loss goes to the actor's ranks that way).

    Args:
        specs: dotted module names importable from ``sys.path`` (``my_pkg.estimators``), or paths of
            ``.py`` files (relative to the current directory).
        key: how error messages call the list (the config key).

    Returns:
        The modules.

    Raises:
        ValueError: a module that is not found, a missing file, a file whose name is not a module
            name or clashes with a module of another file, or an exception raised by the import
            (its type and message).

    Example:
        >>> [m.__name__ for m in import_modules(["json", "os.path"])]
        ['json', 'posixpath']
    """
    return [_import_module(spec, key) for spec in specs]


def _import_module(spec: str, key: str) -> ModuleType:
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{key}: expected module names or .py files, got {spec!r}")
    name = spec
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec).resolve()
        name = path.stem
        if not path.is_file() or path.suffix != ".py":
            raise ValueError(f"{key}: {spec!r} is not a .py file ({path} does not exist)")
        if not name.isidentifier():
            raise ValueError(f"{key}: {spec!r}: {name!r} is not a module name (rename the file)")
        loaded = sys.modules.get(name)
        if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() != path:
            raise ValueError(
                f"{key}: {spec!r} would be the module {name!r}, which is {loaded.__file__} already "
                "(rename the file)"
            )
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(f"{exc.name}.")):
            raise ValueError(
                f"{key}: no module named {name!r} on sys.path "
                f"(give a file by its path, e.g. ./{name.replace('.', '/')}.py, or set PYTHONPATH)"
            ) from None
        raise ValueError(f"{key}: importing {spec!r} raised ModuleNotFoundError: {exc}") from exc
    except Exception as exc:
        raise ValueError(f"{key}: importing {spec!r} raised {type(exc).__name__}: {exc}") from exc


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
