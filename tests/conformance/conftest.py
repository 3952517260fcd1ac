"""spmdcall's own run of the shipped conformance suite (``spmdcall/testing/``): every built-in
backend takes it, in this session. Each module here collects one module of the suite; this file
gives its tests their ``spmd_backend``: each of tests/conftest.py's ``SUITE_BACKENDS`` in turn
(``monarch`` among them where torchmonarch is installed)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def spmd_backend(suite_backend: str) -> str:
    return suite_backend
