"""The backend conformance suite: what every backend, ours or a third party's, must do.

Run it against a backend with one command (pytest must be installed; ``pip install pytest``)::

    python -m spmdcall.testing my_package.my_backend:MyBackend      # an import path module:factory
    python -m spmdcall.testing my-cluster                           # a registered or entry-point name
    python -m spmdcall.testing my_package.my_backend:MyBackend -x -k threads   # then pytest's options

or through pytest itself::

    pytest --pyargs spmdcall.testing -p spmdcall.testing.plugin --spmdcall-backend=my-cluster

The suite drives the backend through the public API only (``sc.WorkerGroup`` and friends), as a
user would. Tests that move DataProtos skip without torch and tensordict. What a backend may
lack, it declares (see docs/backends/writing-a-backend.md); the suite skips those tests and says why.

Importing this package loads neither pytest nor torch; ``import spmdcall`` does not import it.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import spmdcall as sc

SUITE_DIR = Path(__file__).resolve().parent

__all__ = ["SUITE_DIR", "main", "resolve_backend"]


def resolve_backend(spec: str) -> str:
    """The name a ``WorkerGroup`` accepts for the backend ``spec``, registering it if need be.

    Args:
        spec: a name registered with ``sc.register_backend`` or through the entry-point group
            ``spmdcall.backends``, or an import path ``module:factory`` (registered here under
            ``spec`` itself).

    Raises:
        ValueError: ``spec`` names no backend; the message says what was expected.

    Example:
        >>> resolve_backend("inline")
        'inline'
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"the backend to test must be a name or 'module:factory', got {spec!r}")
    if ":" not in spec:
        available = sc.available_backends()
        if spec not in available:
            raise ValueError(
                f"unknown backend {spec!r}: expected a name registered with sc.register_backend or "
                f"through the entry-point group 'spmdcall.backends' (here: {', '.join(available)}), "
                "or an import path 'module:factory'"
            )
        return spec
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"backend {spec!r}: an import path must read 'module:factory', e.g. 'my_pkg.backend:MyBackend'"
        )
    try:
        factory: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"backend {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            raise ValueError(f"backend {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(factory):
        raise ValueError(
            f"backend {spec!r}: expected a class or function building a backend, got {type(factory).__name__}"
        )
    try:
        backend = factory()
    except Exception as exc:
        raise ValueError(f"backend {spec!r}: {attr}() failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(backend, sc.Backend):
        lacks = [member for member in _PROTOCOL_MEMBERS if not hasattr(backend, member)]
        raise ValueError(
            f"backend {spec!r}: {attr}() returned a {type(backend).__name__}, which is not a sc.Backend "
            f"(it lacks {', '.join(lacks)})"
        )
    sc.register_backend(spec, factory, overwrite=True)
    return spec


_PROTOCOL_MEMBERS = (
    "name",
    "capabilities",
    "start",
    "submit",
    "wait",
    "worker_info",
    "restart",
    "shutdown",
)


_USAGE = """usage: python -m spmdcall.testing BACKEND [pytest options]

Run spmdcall's backend conformance suite against BACKEND: a name registered with
sc.register_backend or through the entry-point group 'spmdcall.backends', or an import path
module:factory (a class or function that takes no arguments and returns the backend).

  python -m spmdcall.testing my_package.my_backend:MyBackend
  python -m spmdcall.testing my-cluster -x -rs -k errors"""


def main(argv: list[str] | None = None) -> int:
    """``python -m spmdcall.testing BACKEND [pytest options]``: run the suite, return pytest's exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(_USAGE, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    spec, pytest_args = argv[0], argv[1:]
    try:
        resolve_backend(spec)
    except ValueError as exc:
        print(f"python -m spmdcall.testing: {exc}", file=sys.stderr)
        return 2
    try:
        import pytest
    except ImportError:
        print("python -m spmdcall.testing: the suite runs under pytest: pip install pytest", file=sys.stderr)
        return 2
    args = [str(SUITE_DIR), "-p", "spmdcall.testing.plugin", f"--spmdcall-backend={spec}"]
    # No cache folder in site-packages, and the suite's own rootdir rather than the caller's project.
    args += ["-p", "no:cacheprovider", f"--rootdir={SUITE_DIR}", *pytest_args]
    return int(pytest.main(args))
