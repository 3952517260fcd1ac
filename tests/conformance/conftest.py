"""spmdcall's own run of the shipped conformance suite (``spmdcall/testing/``): every built-in
backend takes it, in this session. Each module here collects one module of the suite; this file
gives its tests their ``spmd_backend``: each of tests/conftest.py's backends in turn."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def spmd_backend(module_backend: str) -> str:
    return module_backend
