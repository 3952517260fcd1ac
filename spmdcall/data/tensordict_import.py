"""Import tensordict without importing ``torch._dynamo`` with it.

When tensordict is imported, it registers a few of its functions with torch.compile through
``torch.compiler.allow_in_graph`` and ``assume_constant_result``, and each of those imports
``torch._dynamo``, the largest part of torch (docs/benchmarks-log.md, "What a worker's start costs").
Every process that touches a DataProto would pay for it, whether or not it ever compiles anything.

Here the registrations keep their effect but wait for dynamo: ``assume_constant_result`` only
marks the function, which is done at once, as dynamo does it; ``allow_in_graph`` is applied the
moment ``torch._dynamo`` is imported, by ``torch.compile`` or anyone else, so before anything
can be compiled. Once dynamo is loaded, tensordict is imported as usual.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_DYNAMO = "torch._dynamo"
_lock = threading.Lock()


def import_tensordict() -> ModuleType:
    """``import tensordict``, deferring its torch.compile registrations until dynamo is loaded."""
    with _lock:
        if "tensordict" in sys.modules or _DYNAMO in sys.modules:
            import tensordict

            return tensordict
        import torch.compiler

        deferred: list[Callable] = []
        real = torch.compiler.allow_in_graph, torch.compiler.assume_constant_result
        torch.compiler.allow_in_graph = _deferring_allow_in_graph(deferred, real[0])
        torch.compiler.assume_constant_result = _mark_constant
        try:
            import tensordict
        finally:
            torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = real
        if deferred:
            sys.meta_path.insert(0, _AfterDynamo(deferred))
        return tensordict


def _deferring_allow_in_graph(deferred: list[Callable], real: Callable) -> Callable:
    def allow_in_graph(fn: Any) -> Any:
        if _DYNAMO in sys.modules:  # loaded meanwhile (by another thread): register at once
            return real(fn)
        deferred.extend(fn if isinstance(fn, (list, tuple)) else [fn])
        return fn  # what dynamo returns too: the function itself

    return allow_in_graph


def _mark_constant(fn: Any) -> Any:
    fn._dynamo_marked_constant = True  # all that dynamo's assume_constant_result does
    return fn


class _AfterDynamo(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` as the other finders would, and registers the deferred functions
    as soon as its module has run; then steps aside."""

    def __init__(self, deferred: Sequence[Callable]):
        self.deferred = deferred

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader, deferred = spec.loader, self.deferred
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            for fn in deferred:
                module.allow_in_graph(fn)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
